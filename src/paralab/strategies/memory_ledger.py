"""Memory accounting for the sharded strategies: bytes held per category, and their peaks.

A :class:`Ledger` is told every time a strategy allocates or frees a
parameter, gradient or optimizer-state tensor (``add``, ``sub``, ``set``,
with where it happened). It keeps each category's current bytes, each
category's peak, and the peak of their sum (``resident_peak_bytes``) with
its split and its place. ``fsdp`` counts its tensors where its primitives
allocate them; ``torch-fsdp`` counts what it can see from outside PyTorch's
FSDP. What the figures show is in ``docs/fsdp.md``. A listener (:meth:`Ledger.listen`)
is told every change as it happens: ``run/held.py`` adds up the ledgers of
one rank (a pipeline stage's flavours, the experts' and the dense part's)
over the step it measures.
"""
from __future__ import annotations

import torch

from ..comm import nbytes

CATEGORIES = ("params", "grads", "optimizer")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The memory model's name for a built optimizer: "adam", "sgd-momentum" or "sgd"."""
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    return "sgd-momentum" if optimizer.param_groups[0].get("momentum") else "sgd"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(nbytes(t) for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


class Ledger:
    """Bytes held per category, as tensors are allocated and freed; peaks of each and of the sum."""

    def __init__(self):
        self.now = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.peak_split: dict[str, int] = dict(self.now)  # each category at the moment of peak_total
        self.peak_where = ""
        self._listeners: list = []

    def listen(self, fn):
        """Call ``fn(category, change, where)`` at every change from now on; returns what stops it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def add(self, category: str, size: int, where: str = "") -> None:
        for fn in self._listeners:
            fn(category, size, where)
        self.now[category] += size
        self.peak[category] = max(self.peak[category], self.now[category])
        total = sum(self.now.values())
        if total > self.peak_total:
            self.peak_total, self.peak_split, self.peak_where = total, dict(self.now), where

    def sub(self, category: str, size: int) -> None:
        for fn in self._listeners:
            fn(category, -size, "")
        self.now[category] -= size

    def set(self, category: str, size: int, where: str = "") -> None:
        self.add(category, size - self.now[category], where)

    def report(self) -> dict:
        return {"peak_bytes": dict(self.peak), "sum_of_peaks_bytes": sum(self.peak.values()),
                "resident_peak_bytes": self.peak_total, "resident_peak_split": dict(self.peak_split),
                "resident_peak_at": self.peak_where}
