"""Activation recomputation (``--recompute none|selective|full``): keep less for backward, compute it again.

A recomputed piece of a model (a unit, or the gpt's attention core) runs its
forward as usual, under ``saved_tensors_hooks``: every tensor autograd wants
to save is numbered in order; a tensor the piece did not compute (a
parameter, a buffer, one of the piece's inputs, which the piece keeps
anyway) is kept, the others are dropped. The first time backward asks for a
dropped tensor, the piece's forward runs again on the kept inputs (under
grad, so the same ops save the same tensors, numbered in the same order),
and each dropped number is answered by the tensor its twin saved. Gradients
flow through the original graph, so they are exactly those of no
recomputation; the parameters' gradients accumulate as usual (every
flavour's hooks fire, a zero-bubble stage's input/weight split still holds:
if its W needs a tensor its I already used, the piece is recomputed again).

What the second forward must not change:
- random draws (dropout): the CPU generator's state (and CUDA's, on a GPU)
  at the original forward is restored for the recompute, then put back, and
  the step value the forward was in is entered again (``training/step.py``:
  where its rows sat in the global batch, which the gpt's dropout masks
  depend on, and their documents), since a recompute runs in backward, when
  another microbatch may be current;
- BatchNorm running statistics: the piece's buffers are copied before the
  recompute and restored after it, so they are updated once per forward;
- autocast: the recompute runs under the autocast state of the original.

The modes (``apply``):
- ``full``: every unit (a gpt block, the embedding, the head; a CNN's conv
  block, pool, classifier) keeps only its input.
- ``selective``, on the gpt: Korthikanti et al. (2022)'s choice, the
  attention core (``QK^T``, softmax, attention times ``V``: any module's
  ``core`` method) recomputed, its inputs q, k, v kept, every matmul's saves
  kept. On the CNNs: every unit without parameters (the max-pools) is
  recomputed, so their int64 indices are not kept; a conv block keeps its
  saves (with an in-place ReLU, recomputing BatchNorm and ReLU frees nothing:
  their input is the convolution's output, which a recompute must keep).

A module is recomputed by swapping its class for a subclass (as FSDP2 does),
so its parameter names, ``isinstance`` and state dict are unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn

from . import step as steps
from ..options import option
from .saved import SavedActivations, outer_hooks, storage

MODES = ("none", "selective", "full")


@dataclass
class RecomputeOptions:
    """activation recomputation (docs/recompute.md)"""
    recompute: str = option("none", "recompute activations in backward: none, selective (the gpt's attention "
                                    "core; a CNN's pools) or full (each unit keeps only its input)",
                            choices=MODES)


class _Piece:
    """One call of a recomputed function: its inputs and the tensors it kept (both through the hooks
    outside it, if any: a pipeline stage's byte count, ``measure_saved``), and the recomputed twins."""

    def __init__(self, fn, module: nn.Module, args: tuple):
        self.fn, self.module = fn, module
        self.outer_pack, self.outer_unpack = outer_hooks()
        # what exists before the piece runs: its inputs and its module's buffers (parameters are leaves)
        self.outside = {id(a) for a in args if isinstance(a, torch.Tensor)} | {id(b) for b in module.buffers()}
        self.args = [(True, self.outer_pack(a)) if isinstance(a, torch.Tensor) else (False, a) for a in args]
        self.kept: set[int] = set()
        self.again: dict[int, torch.Tensor] = {}
        self.count = 0
        self.cpu_rng = torch.get_rng_state()
        self.step = steps.current()  # the step value the forward was in (where its rows sat: dropout, documents)
        self.cuda = any(a.is_cuda for a in args if isinstance(a, torch.Tensor))
        self.cuda_rng = torch.cuda.get_rng_state() if self.cuda else None
        device = "cuda" if self.cuda else "cpu"
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))

    def pack(self, t: torch.Tensor):
        n = self.count
        self.count += 1
        if (t.is_leaf and t.requires_grad) or id(t) in self.outside:  # not computed here: keep it
            self.kept.add(n)
            return self, n, self.outer_pack(t)
        return self, n, None

    def recompute(self) -> None:
        buffers = [b.detach().clone() for b in self.module.buffers()]
        args = [self.outer_unpack(a) if is_tensor else a for is_tensor, a in self.args]
        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        twins: list[torch.Tensor] = []
        device, enabled, dtype = self.autocast
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else [],
                                   device_type="cuda" if self.cuda else "cpu"):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda:
                torch.cuda.set_rng_state(self.cuda_rng)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), steps.entered(self.step), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: twins.append(t) or None, _never):
                self.fn(*args)
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers):
                b.copy_(saved)
        if len(twins) != self.count:
            raise RuntimeError(f"recompute: the forward saved {len(twins)} tensors again, {self.count} the first "
                               "time (a forward that depends on more than its inputs and random state?)")
        self.again = {n: t for n, t in enumerate(twins) if n not in self.kept}


def _never(_):
    raise RuntimeError("recompute: a recomputed forward's own graph is never run backward")


def _unpack(packed):
    piece, n, outer = packed
    if n in piece.kept:
        return piece.outer_unpack(outer)
    if n not in piece.again:  # first use, or used again after being handed out (a zero-bubble W after I)
        piece.recompute()
    return piece.again.pop(n)


#: forwards inside ``suspended()`` keep everything (depth of nesting)
_suspended = 0


@contextmanager
def suspended():
    """No recomputation inside: for a forward whose backward comes next (a pipeline stage's microbatch
    whose B directly follows its F), where keeping everything costs no memory and saves the recompute."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def run(fn, module: nn.Module, *args):
    """``fn(*args)``, keeping for backward only what ``fn`` did not compute; ``module``'s buffers are
    restored after each recompute (BatchNorm statistics)."""
    if not torch.is_grad_enabled() or _suspended:
        return fn(*args)
    piece = _Piece(fn, module, args)
    with torch.autograd.graph.saved_tensors_hooks(piece.pack, _unpack):
        return fn(*args)


class RecomputedUnit:
    """Mixed in before a unit's class: its whole forward recomputed (``full``)."""

    def forward(self, *args):
        return run(super().forward, self, *args)


class RecomputedCore:
    """Mixed in before a class with a ``core`` method (the gpt's attention): only ``core`` recomputed."""

    def core(self, *args):
        return run(super().core, self, *args)


def _swap(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, mixin):
        return
    module.__class__ = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})


def apply(units, mode: str):
    """Recompute in ``units`` (an ``nn.Sequential`` model, or a dict index -> unit) as ``mode`` says;
    in place (each module's class swapped), returned. Idempotent: a sharded twin is applied again."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {', '.join(MODES)} (got {mode!r})")
    if mode == "none":
        return units
    for unit in (units.values() if isinstance(units, dict) else units):
        if mode == "full":
            _swap(unit, RecomputedUnit)
            continue
        cores = [m for m in unit.modules() if callable(getattr(m, "core", None))]
        for m in cores:
            _swap(m, RecomputedCore)
        if not cores and not any(True for _ in unit.parameters()):
            _swap(unit, RecomputedUnit)  # selective on a CNN: the parameter-free units
    return units


def factory(model_fn, mode: str):
    """A model factory whose models recompute as ``mode`` says (``model_fn`` itself for none)."""
    if mode == "none":
        return model_fn

    def make():
        return apply(model_fn(), mode)
    return make


@contextmanager
def measure_saved(model: nn.Module | None = None):
    """The bytes autograd keeps for backward inside the block (``saved.SavedActivations``: distinct
    storages at their peak), ``model``'s parameters and buffers left out (they are held anyway; a
    recomputed piece passes what it keeps through these hooks). Yields an object whose ``bytes`` is the
    count, read after the block."""
    held = [] if model is None else [*model.parameters(), *model.buffers()]
    probe = SavedActivations({storage(t)[0] for t in held})
    meter = SimpleNamespace(bytes=0)
    try:
        with probe.watch():
            yield meter
    finally:
        meter.bytes = probe.peak


__all__ = ["MODES", "RecomputeOptions", "apply", "factory", "measure_saved", "run", "suspended"]
