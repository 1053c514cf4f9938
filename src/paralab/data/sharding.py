"""Which samples each rank sees: ``DistributedSampler`` semantics, as plain functions.

For epoch ``e`` the whole index list is shuffled with a generator seeded by
``seed + e`` (the same on every rank), padded by repeating its head until its
length divides the number of replicas, and rank ``r`` takes positions
``r, r + N, r + 2N, ...``. Cutting that per-rank list into batches of
``b = B / N`` means the step-``i`` batches of all ranks together are exactly
positions ``[i*B, (i+1)*B)`` of the padded permutation: the same *global*
batch a single process would see. The reference run relies on this.
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


def steps_per_epoch(n: int, num_replicas: int, per_rank_batch: int) -> int:
    """Steps in one epoch; the last batch may be smaller (it is kept)."""
    return math.ceil(math.ceil(n / num_replicas) / per_rank_batch)
