"""Dropout that every layout draws alike: the mask is a function of where a value sits, not of who computes it.

``torch.nn.Dropout`` draws its mask from the generator's stream, so the mask a
value gets depends on everything drawn before it in that process: which rank
holds the value, which microbatch came first, which pipeline stage runs the
layer. Split the batch, the sequence or the model, and the masks change; no
single process draws those masks, and ``--check`` could not compare. Here the
mask of a value is decided by four things only:

- the run's seed and the step;
- the unit (a gpt block's index in the whole model): before a block runs,
  the CPU generator is seeded from (seed, step, block) (:func:`enter_unit`,
  from the block's ``__call__``, outside its ``forward``);
- the sample's row in the step's **global** batch: each draw is a mask for
  the whole global batch, ``[B, T, D]``, of which this forward takes its
  rows. The entered step value says where this process's rows start
  (``training/step.py``: ``rows``, ``first``, built by the driver), and
  whoever cuts them into microbatches says where each one starts
  (``step.split``, ``step.microbatch``): data parallelism's accumulation, a
  pipeline's schedule, the reference;
- the token's position in the sequence: a layout that holds part of the
  sequence (context parallelism's chunks, sequence parallelism's shard) sets
  ``position_ids`` on the block's :class:`Dropout`, as it sets the
  embedding's.

Inside a block the draws follow one another from the seeded generator, so a
recomputed block (``--recompute full``) must restore the generator's state,
and the step value its forward was in (a recompute runs in backward, when
another microbatch may be current), to draw the same masks again
(``training/recompute.py`` does both): those paths are exercised, and a
check would catch either failing.

The masks are drawn on the CPU in float32 for the whole global batch: exact
under every layout, and slower than ``torch.nn.Dropout`` (a lab's trade).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..training import step as steps


def enter_unit(index: int) -> None:
    """Seed the CPU generator for unit ``index`` of the entered step (before the unit's forward)."""
    at = steps.current()
    torch.random.default_generator.manual_seed(((at.seed * 1_000_003 + at.index) * 1009 + index) % (2 ** 63))


class Dropout(nn.Module):
    """Dropout of probability ``p`` on ``[B, T, D]`` activations of a ``context``-token model (see the module)."""
    #: the global positions of the tokens this instance is given (context or sequence parallelism); None: 0..T-1
    position_ids: torch.Tensor | None = None

    def __init__(self, p: float, context: int):
        super().__init__()
        self.p, self.context = p, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        b, t, d = x.shape
        at = steps.current()
        rows = at.rows or b
        if at.offset is None:
            raise RuntimeError("dropout: a microbatch the step was not split into (training/step.py: split)")
        first = at.first + at.offset if at.rows else 0
        if first + b > rows:
            raise RuntimeError(f"dropout: rows {first}..{first + b} of a global batch of {rows}: a driver did "
                               "not say where this forward's samples sit (training/step.py)")
        keep = torch.empty(rows, self.context, d).bernoulli_(1 - self.p)[first:first + b]
        keep = keep[:, :t] if self.position_ids is None else keep.index_select(1, self.position_ids.cpu())
        return x * keep.to(x.device, x.dtype) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
