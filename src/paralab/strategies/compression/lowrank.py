"""PowerSGD's shared arithmetic: a tensor as a matrix, which tensors it compresses, the first Q, and
Gram-Schmidt; ddp's bucket path and the reference use the same functions, so they round alike.
"""
from __future__ import annotations

import torch

from .methods import MIN_COMPRESSION_RATE, Q_SEED


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    n = shape[0] if len(shape) else 1
    return n, max(1, int(torch.Size(shape).numel()) // max(n, 1))


def compressible(shape: torch.Size, rank: int) -> bool:
    """PowerSGD sends this tensor as P and Q: it is a matrix and that saves at least half its numbers."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return n * m >= MIN_COMPRESSION_RATE * rank * (n + m)


def initial_q(shape: torch.Size, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The first Q (m x r) of a tensor: the same on every rank and in the reference."""
    n, m = matrix_shape(shape)
    gen = torch.Generator().manual_seed(Q_SEED * 1_000_003 + n * 7919 + m)
    return torch.randn(m, rank, generator=gen, dtype=torch.float64).to(dtype)


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (n x r), in place."""
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(torch.linalg.vector_norm(col).clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p
