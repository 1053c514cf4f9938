"""Which samples each rank sees: ``DistributedSampler`` semantics, as plain functions.

For epoch ``e`` the whole index list is shuffled with a generator seeded by
``seed + e`` (the same on every rank), padded by repeating its head until its
length divides the number of replicas, and rank ``r`` takes positions
``r, r + N, r + 2N, ...``. Cutting that per-rank list into batches of
``b = B / N`` means the step-``i`` batches of all ranks together are exactly
positions ``[i*B, (i+1)*B)`` of the padded permutation: the same *global*
batch a single process would see, for every step but the last of an epoch
when ``n`` does not divide over ``N``: there the padding adds the
``N - n mod N`` first samples of the permutation a second time (a single
process has no padding). The reference run relies on this.

With ``drop_last`` (``--drop-last``: ``DistributedSampler(drop_last=True)``
plus ``DataLoader(drop_last=True)``) an epoch is ``n // B`` full global
batches, positions ``[i*B, (i+1)*B)`` of the unpadded permutation, the same
for every ``N`` including one process; the last ``n mod B`` samples of each
epoch's permutation are left out (other ones each epoch) and none repeats.
"""
from __future__ import annotations

import math

import torch


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen)


def shard_indices(n: int, num_replicas: int, rank: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, drop_last: bool = False) -> torch.Tensor:
    """Indices rank ``rank`` of ``num_replicas`` reads in ``epoch`` (as DistributedSampler)."""
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} outside [0, {num_replicas})")
    order = epoch_permutation(n, seed, epoch, shuffle)
    if drop_last and n % num_replicas:
        per_rank = n // num_replicas
        order = order[: per_rank * num_replicas]
    else:
        per_rank = math.ceil(n / num_replicas)
        padding = per_rank * num_replicas - n
        if padding:
            repeats = math.ceil(padding / n)
            order = torch.cat([order, order.repeat(repeats)[:padding]])
    return order[rank::num_replicas]


def steps_per_epoch(n: int, num_replicas: int, per_rank_batch: int, drop_last: bool = False) -> int:
    """Steps in one epoch: ``ceil(n / B)``, the last batch possibly smaller (it is kept);
    with ``drop_last``, ``n // B`` full batches (``B = num_replicas * per_rank_batch``)."""
    if drop_last:
        return n // (num_replicas * per_rank_batch)
    return math.ceil(math.ceil(n / num_replicas) / per_rank_batch)


def padded_samples(n: int, num_replicas: int, drop_last: bool = False) -> int:
    """How many samples each epoch repeats so that ``n`` divides over the replicas (0 with drop_last)."""
    return 0 if drop_last else math.ceil(n / num_replicas) * num_replicas - n
