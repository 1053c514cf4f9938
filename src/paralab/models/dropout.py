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
  rows. The training loop says where this rank's shard starts
  (:func:`at_step`); whoever cuts the shard into microbatches says where
  each one starts (:func:`split`, :func:`microbatch`): data parallelism's
  accumulation, a pipeline's schedule, the reference;
- the token's position in the sequence: a layout that holds part of the
  sequence (context parallelism's chunks, sequence parallelism's shard) sets
  ``position_ids`` on the block's :class:`Dropout`, as it sets the
  embedding's.

Inside a block the draws follow one another from the seeded generator, so a
recomputed block (``--recompute full``) must restore the generator's state,
and where its samples sat (:func:`where`, :func:`placed`: a recompute runs in
backward, when another microbatch may be current), to draw the same masks
again (``training/recompute.py`` does both): those paths are exercised, and a
check would catch either failing.

The masks are drawn on the CPU in float32 for the whole global batch: exact
under every layout, and slower than ``torch.nn.Dropout`` (a lab's trade).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn


class _Draws:
    """Where the current forward sits: the run's seed, the step, the global batch's rows, and the first
    row of this rank's shard and of the microbatch being computed."""
    seed = 0
    step = 0
    rows = 0           # samples in the step's global batch (0: not set, this forward's own)
    first = 0          # this rank's shard's first row in the global batch
    offsets = (0,)     # each microbatch's first row within the shard (split)
    offset = 0         # the current microbatch's


DRAWS = _Draws()


def at_step(seed: int, step: int, rows: int, first: int) -> None:
    """A new step (the training loop, the reference): ``rows`` samples in the global batch, this shard
    from row ``first``; one microbatch until :func:`split` says otherwise."""
    DRAWS.seed, DRAWS.step, DRAWS.rows, DRAWS.first = seed, step, rows, first
    DRAWS.offsets, DRAWS.offset = (0,), 0


def split(sizes: list[int]) -> None:
    """This step's shard is cut into microbatches of ``sizes`` samples, in order."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n
    DRAWS.offsets = tuple(offsets)


@contextmanager
def microbatch(index: int):
    """Forwards inside compute microbatch ``index`` of the :func:`split` (beyond it, where nothing said
    where the samples sit: a dropout that draws refuses, one that does not is unaffected)."""
    before, DRAWS.offset = DRAWS.offset, DRAWS.offsets[index] if index < len(DRAWS.offsets) else None
    try:
        yield
    finally:
        DRAWS.offset = before


def where() -> tuple:
    """Where the current forward sits (see :class:`_Draws`): what a recompute restores beside the generator."""
    return DRAWS.seed, DRAWS.step, DRAWS.rows, DRAWS.first, DRAWS.offsets, DRAWS.offset


@contextmanager
def placed(at: tuple):
    """Forwards inside sit where :func:`where` said (a recompute in backward, long after the forward)."""
    before = where()
    DRAWS.seed, DRAWS.step, DRAWS.rows, DRAWS.first, DRAWS.offsets, DRAWS.offset = at
    try:
        yield
    finally:
        DRAWS.seed, DRAWS.step, DRAWS.rows, DRAWS.first, DRAWS.offsets, DRAWS.offset = before


def enter_unit(index: int) -> None:
    """Seed the CPU generator for unit ``index`` of this step (before the unit's forward)."""
    torch.random.default_generator.manual_seed(((DRAWS.seed * 1_000_003 + DRAWS.step) * 1009 + index) % (2 ** 63))


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
        rows = DRAWS.rows or b
        if DRAWS.offset is None:
            raise RuntimeError("dropout: a microbatch the step was not split into (models/dropout.py: split)")
        first = DRAWS.first + DRAWS.offset if DRAWS.rows else 0
        if first + b > rows:
            raise RuntimeError(f"dropout: rows {first}..{first + b} of a global batch of {rows}: a driver did "
                               "not say where this forward's samples sit (models/dropout.py)")
        keep = torch.empty(rows, self.context, d).bernoulli_(1 - self.p)[first:first + b]
        keep = keep[:, :t] if self.position_ids is None else keep.index_select(1, self.position_ids.cpu())
        return x * keep.to(x.device, x.dtype) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
