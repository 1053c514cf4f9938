"""The whole model's gradient norm under any layout, and clipping to it (``--clip-grad NORM``).

After a step's gradients are synchronised every rank holds some of the
model's gradient: all of it (a data-parallel replica), a slice (a weight
tensor parallelism splits, a ZeRO or FSDP shard, an expert, a pipeline
stage's units), and much of it in copies other ranks hold too (every dp
replica holds the averaged gradient; every tp rank holds a LayerNorm's).
The norm of the whole gradient sums each *distinct* element's square once:

    ||g||^2 = sum over ranks r, over each gradient tensor t rank r holds:  sum(t^2) / copies(t)

where ``copies(t)`` is how many ranks hold that same tensor (per element
where a flat shard mixes split and replicated parameters). One all-reduce of
one number over every rank gives every rank the same norm; each rank then
scales what it holds by ``min(1, NORM / (norm + 1e-6))``, torch's
``clip_grad_norm_`` rule, so every copy stays equal. Counting a replicated
tensor once per holder (a norm tp or dp times too large), leaving a stage
or an expert out, or averaging the experts' sums instead of adding them are
the classic bugs; ``--check`` compares this norm with the single process's
``torch.nn.utils.clip_grad_norm_`` at every step.

The squares are summed in float64 whatever the training precision, and the
clip factor is computed in the gradients' dtype as torch computes it.
"""
from __future__ import annotations

import torch

from ..comm import Comm

#: what torch's clip_grad_norm_ adds to the norm before dividing
EPS = 1e-6


def square_sum(held: list[tuple[torch.Tensor, float | torch.Tensor]]) -> torch.Tensor:
    """Sum over ``(gradient, copies)`` of ``sum(gradient^2 / copies)``, a float64 scalar on the gradients'
    device (``copies``: a number, or a tensor of the gradient's shape)."""
    device = held[0][0].device if held else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, copies in held:
        sq = g.detach().double().pow(2)
        total += (sq / copies).sum() if isinstance(copies, torch.Tensor) else sq.sum() / copies
    return total


def reduce(comm: Comm, local: torch.Tensor, device: torch.device, bad_loss: bool | None = None
           ) -> tuple[float, list[int], list[int]]:
    """One all-reduce over ``comm`` (every rank of the run, each calling this at the same point of the same
    step) of this rank's share of the squares (:func:`square_sum`) and, for the non-finite guard
    (``bad_loss`` given: whether this rank's loss was not finite this step), one flag per rank for its loss
    and one for its gradient. Returns (the norm, the ranks whose loss was not finite, the ranks whose
    gradient was not finite)."""
    guard = bad_loss is not None
    vec = torch.zeros(1 + (2 * comm.world if guard else 0), dtype=torch.float64, device=device)
    vec[0] = local.to(device)
    if guard:
        vec[1 + comm.rank] = float(bad_loss)
        vec[1 + comm.world + comm.rank] = float(not torch.isfinite(local))
    if comm.world > 1:
        comm.all_reduce(vec, name="grad_norm_all_reduce")
    flags = vec[1:].tolist()
    return (float(vec[0].sqrt()), [r for r in range(comm.world) if guard and flags[r]],
            [r for r in range(comm.world) if guard and flags[comm.world + r]])


class NonFinite(RuntimeError):
    """``--on-nonfinite stop``: a loss or gradient that is not finite, found on every rank in the same step."""


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (norm + 1e-6))`` (torch's clip_grad_norm_ rule)."""
    for g in grads:
        coef = torch.clamp(max_norm / (torch.tensor(norm, dtype=g.dtype, device=g.device) + EPS), max=1.0)
        g.mul_(coef)
