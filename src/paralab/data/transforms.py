"""Batched augmentation and normalisation on uint8 tensors.

Random crop (4-pixel zero padding) and horizontal flip are drawn once per
epoch for *every sample index* from a generator seeded by (seed, epoch). A
sample is therefore augmented the same way whichever rank, shard or
microbatch it lands in, so a parallel run and the single-process reference
see bit-identical inputs.
"""
from __future__ import annotations

import torch

PAD = 4


def augmentation_params(n: int, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample crop offsets ``[n, 2]`` in ``[0, 2*PAD]`` and flip flags ``[n]``."""
    gen = torch.Generator().manual_seed((seed + 1) * 1_000_033 + epoch)
    offsets = torch.randint(0, 2 * PAD + 1, (n, 2), generator=gen)
    flips = torch.randint(0, 2, (n,), generator=gen).bool()
    return offsets, flips


def crop_flip(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """Crop each padded image at its offset and flip where asked; batched gather."""
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    rows = offsets[:, :1] + torch.arange(h).view(1, h)  # [b, h]
    cols = offsets[:, 1:] + torch.arange(w).view(1, w)  # [b, w]
    cols = torch.where(flips.view(b, 1), cols.flip(1), cols)
    idx = torch.arange(b).view(b, 1, 1)
    out = padded[idx, :, rows.view(b, h, 1), cols.view(b, 1, w)]  # [b, h, w, c]
    return out.permute(0, 3, 1, 2).contiguous()


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    x = images.float().div_(255)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


class Augmenter:
    """Holds one epoch's augmentation draws; ``apply`` is a pure function of indices."""

    def __init__(self, n: int, seed: int, enabled: bool = True):
        self.n, self.seed, self.enabled = n, seed, enabled
        self.epoch = None
        self.offsets = self.flips = None

    def apply(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        if not self.enabled:
            return images
        if epoch != self.epoch:
            self.offsets, self.flips = augmentation_params(self.n, self.seed, epoch)
            self.epoch = epoch
        return crop_flip(images, self.offsets[indices], self.flips[indices])
