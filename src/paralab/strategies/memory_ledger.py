"""Memory accounting for the sharded strategies: the bytes held per category, told as they change.

A :class:`Ledger` is told every time a strategy allocates or frees a
parameter, gradient or optimizer-state tensor (``add``, ``sub``, ``set``,
with where it happened) and keeps each category's current bytes. It is the
strategy's instrument, not a record: ``fsdp`` counts its tensors where its
primitives allocate them, ``torch-fsdp`` what it can see from outside
PyTorch's FSDP (``observes`` says what that is). Memory is measured in one
place, ``run/held.py``: it listens to every ledger of a rank (a pipeline
stage's flavours, the experts' and the dense part's) over the step it
measures and records their peaks in the rank's ``held`` record. What the
figures show is in ``docs/fsdp.md``.
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
    """Bytes held per category, as tensors are allocated and freed; listeners told every change."""

    def __init__(self, observes: str | None = None):
        self.now = dict.fromkeys(CATEGORIES, 0)
        self.observes = observes  # when the counts are read, where a strategy cannot see every change
        self._listeners: list = []

    def listen(self, fn):
        """Call ``fn(category, change, where)`` at every change from now on; returns what stops it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def add(self, category: str, size: int, where: str = "") -> None:
        for fn in self._listeners:
            fn(category, size, where)
        self.now[category] += size

    def sub(self, category: str, size: int) -> None:
        for fn in self._listeners:
            fn(category, -size, "")
        self.now[category] -= size

    def set(self, category: str, size: int, where: str = "") -> None:
        self.add(category, size - self.now[category], where)
