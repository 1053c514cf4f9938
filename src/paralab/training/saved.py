"""Bytes autograd saves for backward, counted once per allocation from save to release, and their peak.

``SavedActivations().watch()`` installs ``saved_tensors_hooks`` around a
step: every tensor autograd saves is counted once per storage (a view and
its base are one allocation) from when it is saved until autograd lets it go
(a ``weakref.finalize`` on the box the hook hands autograd), so ``peak`` is
the most the step held at once: every microbatch's activations under GPipe,
a few under 1F1B. Tensors on the storages it is given (``model_state``: a
parameter's, a weight kept for its input's gradient; ``run/held.py`` gives
every storage the strategy held before the step, so the flat tensor fsdp
gathers a unit's parameters into, which its ledger counts, is one of them)
are model state, not activations, and are not counted: a gathered unit is
held for as long as the strategy keeps it gathered, not for as long as
autograd keeps a view of it (fsdp frees it after the unit's forward and
gathers it again for its backward).

Only the innermost ``saved_tensors_hooks`` sees a save, so code that
installs its own (a pipeline stage measuring its microbatches, a recomputed
piece) hands each tensor it keeps on to the hooks that were in force when it
installed its own (:func:`outer_hooks`): a probe around the step still sees
it.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

def storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of a tensor's allocation (the key names its storage, on the meta device too); None for
    one without storage (sparse)."""
    t = getattr(t, "_local_tensor", t)  # a DTensor holds its shard
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return s._cdata, s.nbytes()


class SavedActivations:
    """Live bytes autograd holds for backward, per storage, and their peak (use :meth:`watch`)."""

    def __init__(self, model_state: set[int] = frozenset()):
        """``model_state``: the storage keys (:func:`storage`) whose saves are not counted."""
        self.live, self.peak, self.tensors = 0, 0, 0
        self.parameters = model_state
        self._count: dict[int, list[int]] = {}  # storage key -> [references, bytes]

    def _pack(self, t: torch.Tensor):
        found = storage(t)
        if found is None or found[0] in self.parameters:
            return t  # a parameter (or a view of one), or another tensor of the model state, kept as it is
        key, size = found
        ref = self._count.setdefault(key, [0, size])
        if ref[0] == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        self.tensors += 1
        box = _Box(t)
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key: int) -> None:
        ref = self._count[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._count[key]

    @staticmethod
    def _unpack(box):
        return box.tensor if isinstance(box, _Box) else box

    @contextmanager
    def watch(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Box:
    """What autograd keeps in place of a saved tensor: freed exactly when autograd frees the save."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor



def _identity(t):
    return t


def outer_hooks():
    """The (pack, unpack) of the ``saved_tensors_hooks`` in force now, identities if none: what code that
    installs hooks of its own calls on each tensor it keeps, so the hooks outside it see it too."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top if top is not None else (_identity, _identity)
