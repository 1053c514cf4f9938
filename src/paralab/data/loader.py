"""Turn a step number into the tensors one rank trains on: normalised float images, or byte tokens."""
from __future__ import annotations

import math

import torch

from .datasets import Dataset
from .documents import mask_targets
from .sharding import padded_samples, shard_indices, steps_per_epoch
from .transforms import Augmenter, normalize


def to_device(x: torch.Tensor, device, dtype: torch.dtype, non_blocking: bool = False) -> torch.Tensor:
    """Inputs onto ``device``: images in the run's float ``dtype``; token ids (integers) stay integers."""
    if x.is_floating_point():
        return x.to(device, dtype, non_blocking=non_blocking)
    return x.to(device, non_blocking=non_blocking)


class BatchSource:
    """Batches for one data-parallel replica (``replicas`` = 1 for a single process).

    ``batch(step)`` is deterministic: the same (seed, step) always returns the
    same samples, augmented the same way, so a resumed run and the reference
    run read exactly what the original run read. A text dataset's samples are
    windows of byte tokens, handed through as int64 (no augmentation, no
    normalisation).
    """

    def __init__(self, data: Dataset, *, per_rank_batch: int, replicas: int = 1, rank: int = 0,
                 seed: int = 0, augment: bool = True, drop_last: bool = False):
        self.data = data
        self.per_rank_batch = per_rank_batch
        self.replicas, self.rank, self.seed = replicas, rank, seed
        self.drop_last = drop_last
        self.text = getattr(data, "modality", "image") == "text"
        self.documents = getattr(data, "documents", False)  # targets outside a document are ignored (IGNORE)
        self.packing = getattr(data, "packing", False)      # rows hold several documents: document-causal attention
        self.augmenter = Augmenter(len(data.train_y), seed, augment and not self.text)
        self._orders: dict[int, torch.Tensor] = {}  # rank -> this epoch's shard order
        self._orders_epoch: int | None = None
        if self.steps_per_epoch == 0:
            raise ValueError(f"drop_last: {len(data.train_y)} samples make no full global batch of "
                             f"{replicas * per_rank_batch}")

    @property
    def global_batch(self) -> int:
        """Samples of a full step over every replica (an epoch's last step may hold fewer)."""
        return self.per_rank_batch * self.replicas

    @property
    def steps_per_epoch(self) -> int:
        """``ceil(n / B)`` steps, the last possibly smaller; with ``drop_last``, ``n // B`` full ones."""
        return steps_per_epoch(len(self.data.train_y), self.replicas, self.per_rank_batch, self.drop_last)

    @property
    def padding(self) -> int:
        """Samples each epoch repeats (in its last step) so the data divides over the replicas."""
        return padded_samples(len(self.data.train_y), self.replicas, self.drop_last)

    def repeated_samples(self, start: int, stop: int) -> int:
        """How many repeated (padding) samples steps ``[start, stop)`` train on, over all replicas:
        the padding, once for every epoch whose last step is among them."""
        s = self.steps_per_epoch
        return self.padding * max(0, stop // s - start // s)

    def data_note(self, start: int, stop: int) -> str | None:
        """What a run of steps ``[start, stop)`` does with samples that do not fill the epoch
        evenly (repeats them, or leaves them out with drop_last), or None: nothing to say."""
        n, b = len(self.data.train_y), self.global_batch
        s = self.steps_per_epoch
        repeated = self.repeated_samples(start, stop)
        if repeated:
            return (f"{n} training samples do not divide over {self.replicas} data-parallel replicas: "
                    f"as DistributedSampler does, the last step of each epoch repeats the epoch's first "
                    f"{self.padding} sample(s) so that every replica gets {math.ceil(n / self.replicas)}; "
                    f"this run trains on {repeated} repeated sample(s) ({repeated // self.padding} epoch end(s)), "
                    f"which a single process does not. --drop-last trains {n // b} full batches per epoch "
                    "instead, the same samples as `single --drop-last`")
        if self.drop_last and n % b and stop > start:
            return (f"--drop-last: each epoch is {s} step(s) of {b} samples; the last {n % b} of each "
                    f"epoch's {n} shuffled samples are left out (other ones each epoch), none repeats")
        return None

    def indices(self, step: int, rank: int | None = None) -> tuple[int, torch.Tensor]:
        """(epoch, indices) of ``rank``'s batch at global ``step``.

        Each rank's order for an epoch is computed once and kept while that
        epoch lasts (a full shuffle per step would sit in the training loop).
        """
        rank = self.rank if rank is None else rank
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._orders_epoch != epoch:
            self._orders, self._orders_epoch = {}, epoch
        if rank not in self._orders:
            self._orders[rank] = shard_indices(len(self.data.train_y), self.replicas, rank,
                                               seed=self.seed, epoch=epoch, drop_last=self.drop_last)
        return epoch, self._orders[rank][i * self.per_rank_batch:(i + 1) * self.per_rank_batch]

    def batch(self, step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (or ``rank``'s) training batch at ``step``: normalised float images, labels;
        or int64 tokens ``[b, context]`` and the next tokens ``[b, context]``."""
        epoch, idx = self.indices(step, rank)
        if self.text:
            x, y = self.data.train_x[idx].long(), self.data.train_y[idx].long()
            return x, (mask_targets(x, y) if self.documents else y)
        images = self.augmenter.apply(self.data.train_x[idx], idx, epoch)
        return normalize(images, self.data.mean, self.data.std), self.data.train_y[idx]

    def test_batches(self, batch_size: int, max_batches: int | None = None):
        """This rank's share of the test split, in batches of (images, labels, real).

        Rank r takes samples r, r+N, ...; shares are padded to equal length (as
        DistributedSampler does) so every rank makes the same number of equally
        sized predict calls, which sharded strategies need (their predict is a
        collective). ``real`` marks the rows that are not padding. ``max_batches``
        bounds the total to the first ``max_batches * batch_size`` test samples
        whatever the number of ranks.
        """
        n = len(self.data.test_y)
        if max_batches is not None:  # a bound on the *total*, so every strategy sees the same samples
            n = min(n, max_batches * batch_size)
        per_rank = math.ceil(n / self.replicas)
        positions = torch.arange(self.rank, per_rank * self.replicas, self.replicas)
        real = positions < n
        idx = torch.where(real, positions, positions % n)
        for start in range(0, per_rank, batch_size):
            sel = idx[start:start + batch_size]
            if self.text:
                x, y = self.data.test_x[sel].long(), self.data.test_y[sel].long()
                yield x, (mask_targets(x, y) if self.documents else y), real[start:start + batch_size]
                continue
            yield (normalize(self.data.test_x[sel], self.data.mean, self.data.std), self.data.test_y[sel],
                   real[start:start + batch_size])
