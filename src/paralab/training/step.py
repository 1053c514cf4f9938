"""One training step as a value: what every forward of that step needs to know, built once by its driver.

A forward needs more than its input tensor. The gpt's dropout draws masks
that depend on the run's seed, the step and where each sample sits in the
step's **global** batch (``models/dropout.py``); packed documents need each
token's document for the attention mask (``models/documents.py``); the loss
over documents divides by the global batch's valid targets, which no shard
sees alone (``training/losses.py``). Those facts belong to the step, not to
any module, so they are one frozen :class:`Step`:

- ``index``, ``seed``, ``lr``: which step, the run's seed, its learning rate;
- ``x``, ``y``: the rows this process's forwards take (a rank's shard, or the
  reference's whole batch);
- ``rows`` and ``first``: how many samples the global batch holds and where
  ``x`` starts in it (0 rows: this forward's own rows are the whole batch,
  as in evaluation);
- ``valid`` and ``elements``: the global batch's valid targets and all of its
  target elements (0: not documents, the plain mean);
- ``doc_ids``: each token's document in ``x``'s rows (``--packing``);
- ``offsets`` and ``offset``: where each microbatch of ``x`` starts, and the
  current one's (:func:`split`, :func:`microbatch`).

Each driver builds its steps here, from the data it holds and with no
communication (:func:`of_shard`: the loop and the first-divergence replay,
from a rank's shard, reading the other shards' targets from the same data as
the reference does; :func:`of_rows`: the reference; :func:`whole`: evaluation
and a check's predictions, from a test batch) and runs the step's forwards inside :func:`entered`. A torch
module's ``forward`` takes tensors only, so the modules that need the step
read the one entered (:func:`current`), the way torch's own autocast and
grad modes are read: a context variable, set for the driver's ``with`` and
restored after it, never written by a module. Whoever cuts the step's rows
into microbatches says so (:func:`split`: data parallelism's accumulation, a
pipeline's schedule, the reference) and enters each (:func:`microbatch`); a
recompute in backward, long after its forward, re-enters the step value it
kept (``training/recompute.py``: backward may run on another thread, where
nothing is entered).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..data.documents import doc_ids, valid_targets


@dataclass(frozen=True)
class Step:
    """One step's facts (see the module); ``Step()`` is no step: forwards over their own rows, no documents."""
    index: int = 0
    seed: int = 0
    x: Any = None
    y: Any = None
    lr: float | None = None
    rows: int = 0                  # samples in the global batch (0: the forward's own rows are the whole batch)
    first: int = 0                 # x's first row in the global batch
    valid: int = 0                 # the global batch's valid targets (0: not documents)
    elements: int = 0              # the global batch's target elements
    doc_ids: Any = None            # [len(x), T]: each token's document (--packing; None: plain causal attention)
    offsets: tuple = (0,)          # each microbatch's first row within x
    offset: int | None = 0         # the current microbatch's (None: one the step was not split into)

    @property
    def documents(self) -> bool:
        """Whether the loss is the sum over valid targets over their global count (``training/losses.py``)."""
        return self.elements > 0

    def on(self, device, dtype) -> Step:
        """The step with its rows on ``device`` (images cast to ``dtype``, tokens kept integer)."""
        x = self.x.to(device, dtype if self.x.is_floating_point() else None, non_blocking=True)
        return replace(self, x=x, y=self.y.to(device, non_blocking=True))

    def __repr__(self) -> str:  # the tensors by shape only
        shape = None if self.x is None else tuple(self.x.shape)
        return (f"Step(index={self.index}, x={shape}, rows={self.rows}, first={self.first}, valid={self.valid}, "
                f"elements={self.elements}, packed={self.doc_ids is not None}, offsets={self.offsets}, "
                f"offset={self.offset})")


_CURRENT: ContextVar[Step] = ContextVar("paralab.step", default=Step())


def current() -> Step:
    """The step the running forward belongs to (``Step()`` where no driver entered one)."""
    return _CURRENT.get()


@contextmanager
def entered(step: Step):
    """Forwards inside belong to ``step`` (restored on leaving, whatever happened inside)."""
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)


def split(sizes: list[int]) -> None:
    """The entered step's rows are cut into microbatches of ``sizes`` samples, in order (until the driver's
    :func:`entered` ends)."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n
    _CURRENT.set(replace(current(), offsets=tuple(offsets), offset=0))


@contextmanager
def microbatch(index: int):
    """Forwards inside compute microbatch ``index`` of the :func:`split` (beyond it, where nothing said where
    its rows sit: a dropout that draws refuses, one that does not is unaffected)."""
    now = current()
    with entered(replace(now, offset=now.offsets[index] if index < len(now.offsets) else None)):
        yield


# ------------------------------------------------------------ the drivers' steps
def of_rows(index: int, seed: int, x: torch.Tensor, y: torch.Tensor, rows: int, first: int,
            targets: list[torch.Tensor] | None, packing: bool, lr: float | None = None) -> Step:
    """Step ``index`` for forwards over ``(x, y)``, rows ``first ..`` of a global batch of ``rows`` samples;
    ``targets``: every data-parallel shard's targets (None: not documents)."""
    if targets is None:
        return Step(index, seed, x, y, lr, rows, first)
    return Step(index, seed, x, y, lr, rows, first, valid=sum(valid_targets(t) for t in targets),
                elements=sum(t.numel() for t in targets), doc_ids=doc_ids(x.cpu()) if packing else None)


def of_shard(source, index: int, x: torch.Tensor, y: torch.Tensor, seed: int, lr: float | None = None) -> Step:
    """Step ``index`` of a rank holding ``source``'s shard ``(x, y)`` of it; the other shards' targets read from
    the same data (``source.batch(index, rank)``)."""
    targets = None
    if source.documents:
        targets = [y if r == source.rank else source.batch(index, r)[1] for r in range(source.replicas)]
    return of_rows(index, seed, x, y, rows=len(y) * source.replicas, first=len(y) * source.rank,
                   targets=targets, packing=source.packing, lr=lr)


def whole(x: torch.Tensor, packing: bool) -> Step:
    """Forwards over the rows ``x`` whole, outside training (evaluation, a check's predictions)."""
    return Step(x=x, doc_ids=doc_ids(x.cpu()) if packing else None)
