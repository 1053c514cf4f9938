"""What a rank holds in memory, measured on any device: its model states and its saved activations.

A CPU has no allocator that counts (CUDA's ``max_memory_allocated`` is
recorded where there is one, ``recorder.allocator_peaks``), so a rank
measures what the memory model predicts, in the first step of each start
of a run (a warm-up step unless ``--warmup 0``: the hooks cost a few
microseconds per saved tensor, and no averaged step pays them), with a
:class:`Probe`:

- **Saved activations** (``training/saved.py``): the peak of what autograd
  held for backward over the step, once per storage. A save on a storage
  the strategy held before the step (a parameter, the flat tensor fsdp
  gathers a unit's parameters into, a bucket) is model state, counted
  below, not an activation: each byte is counted once.
- **Gradients**: the most gradient bytes alive at once during the step
  (most strategies free them after it; ZeRO-2/3 free each unit's after
  reducing it), counted from when autograd accumulates one into a
  parameter until it is freed, or, for a gradient a strategy assigns
  itself (a shard's), as the optimizer steps.
- **The rest of the model states**, after the step: every tensor reachable
  from the strategy and its optimizers (``gc.get_referents``, so a
  ``--check`` reference model or a data batch is not counted), once per
  storage: parameters (and leaves trained in their place; a DTensor counts
  its local shard), optimizer state, and other (buffers, flat tensors,
  gradient buckets). What lives only in C++ (a torch-ddp reducer's
  buckets) is not seen.
- **A strategy's own ledger** (``strategies/memory_ledger.py``, kept by
  ``fsdp``, its ZeRO flavours under ``--pp``/``--tp``/``--ep``, and
  ``torch-fsdp``): the strategy tells it the tensors it makes and frees
  inside the step that the two counts above cannot see (fsdp's gathered units and
  their full gradients, the flat copy of a unit's gradient a flavour
  reduce-scatters). Where the rank keeps any (several: a pipeline rank's
  stages, the experts' flavour beside the dense one), they are added up
  over the step, and their parameters and gradients at the moment they sum
  to most (the resident peak), with the optimizer state after the step,
  replace the three above; ``other`` stays the walk's.

The record is a sum of peaks (model states, saved activations), as the
memory model's formula is. It is the only place a run measures memory: a
strategy's ledger is its instrument and is read here, and a strategy's own
details carry no memory figures (its ``memory`` record holds only the
``model`` the cost model predicts from).

Records: ``strategy_details[rank]["held"]`` (``kinds.HELD``); the report's
memory figure, ``paralab calc memory RUN`` and ``bench/plan.py`` set it
beside the prediction.
"""
from __future__ import annotations

import gc
import types
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from ..strategies.memory_ledger import CATEGORIES, Ledger
from ..training.saved import SavedActivations, storage


#: objects the walk does not enter: code and namespaces lead to everything a program imported
_OPAQUE = (type, str, bytes, int, float, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
           types.FrameType)


def reachable(roots: list) -> list:
    """Every object reachable from ``roots`` through Python references (and a tensor's ``.grad``), but
    code and namespaces; a tensor's own referents are not entered."""
    seen_obj: set[int] = set()
    found: list = []
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen_obj or isinstance(obj, _OPAQUE):
            continue
        seen_obj.add(id(obj))
        found.append(obj)
        if torch.is_tensor(obj):
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, types.FunctionType):  # what a closure holds, not the module it was defined in
            todo.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            todo.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def reachable_tensors(roots: list) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through Python references (and a tensor's ``.grad``)."""
    return [t for t in reachable(roots) if torch.is_tensor(t)]


def is_parameter(t: torch.Tensor) -> bool:
    """An ``nn.Parameter``, or a leaf that autograd gives a gradient (a view a strategy trains in place of one)."""
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


def parameter_storages(roots: list) -> set[int]:
    return {found[0] for t in reachable_tensors(roots) if is_parameter(t) for found in [storage(t)]
            if found is not None}


def state_storages(roots: list) -> set[int]:
    """The storages of every tensor reachable from ``roots``: what the strategy holds before a step
    (parameters, optimizer state, buffers, the flat tensors fsdp gathers into, buckets), model state
    whatever autograd saves of it during the step."""
    return {found[0] for t in reachable_tensors(roots) for found in [storage(t)] if found is not None}


def model_states(roots: list, optimizers: list) -> dict:
    """Bytes of every tensor reachable from ``roots`` and ``optimizers``, once per storage, by kind."""
    in_state = {id(t) for o in optimizers for st in o.state.values() for t in st.values() if torch.is_tensor(t)}
    tensors = reachable_tensors(list(roots) + list(optimizers))
    seen_storage: set[int] = set()
    grads = {id(t.grad) for t in tensors if t.grad is not None}
    held = {"parameters": 0, "gradients": 0, "optimizer": 0, "other": 0}  # gradients: of the step, not here
    for t in sorted(tensors, key=lambda t: (not is_parameter(t), id(t) not in grads)):
        found = storage(t)
        if found is None or found[0] in seen_storage:
            continue
        seen_storage.add(found[0])
        kind = ("parameters" if is_parameter(t) else "gradients" if id(t) in grads
                else "optimizer" if id(t) in in_state else "other")
        held[kind] += found[1]
    return held


class Gradients:
    """The most gradient bytes alive at once over a step: each parameter's ``.grad`` counted from when
    autograd accumulates it (``register_post_accumulate_grad_hook``) until it is freed, and what the
    optimizers step on (a shard's gradient a strategy assigns itself), read as each ``step`` begins."""

    def __init__(self, roots: list, optimizers: list):
        self.live = self.peak = self.at_step = 0
        self._alive: dict[int, int] = {}
        params = [t for t in reachable_tensors(roots) if is_parameter(t) and t.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]
        self._handles += [o.register_step_pre_hook(self._stepping) for o in optimizers]

    def _accumulated(self, p) -> None:
        if p.grad is None:  # a strategy's own hook took it already (ZeRO-2/3 under a pipeline reduce it there)
            return
        found = storage(p.grad)
        if found is None or found[0] in self._alive:
            return
        key, size = found
        self._alive[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(p.grad, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._alive.pop(key)

    def _stepping(self, optimizer, args, kwargs) -> None:
        grads = dict(storage(p.grad) for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None)
        self.at_step += sum(grads.values())

    def close(self) -> int:
        for h in self._handles:
            h.remove()
        return max(self.peak, self.at_step)


class Ledgers:
    """The memory ledgers reachable from ``roots`` added up over a step, as their tensors are made and
    freed (``Ledger.listen``): each category's peak, and the resident peak of the step's tensors (the most
    parameters and gradients held at once) with its split. The optimizer state is counted as it is after
    the step: in a run's first step it is made as the step ends (or unit by unit, stepping in backward),
    and from then on it is held throughout."""

    def __init__(self, roots: list):
        self.ledgers = [o for o in reachable(roots) if isinstance(o, Ledger)]
        self.now = {c: sum(led.now[c] for led in self.ledgers) for c in CATEGORIES}
        self.peak = dict(self.now)
        self.split, self.where = dict(self.now), "before the step"
        self._stop = [led.listen(self._change) for led in self.ledgers]

    @staticmethod
    def _resident(held: dict) -> int:
        return held["params"] + held["grads"]

    def _change(self, category: str, size: int, where: str) -> None:
        self.now[category] += size
        self.peak[category] = max(self.peak[category], self.now[category])
        if self._resident(self.now) > self._resident(self.split):
            self.split, self.where = dict(self.now), where

    def close(self) -> dict | None:
        """The step's figures (None if the strategy keeps no ledger)."""
        for stop in self._stop:
            stop()
        self._stop = []
        if not self.ledgers:
            return None
        split = {"params": self.split["params"], "grads": self.split["grads"], "optimizer": self.now["optimizer"]}
        observed = sorted({led.observes for led in self.ledgers if led.observes})
        return {"ledgers": len(self.ledgers), "resident_peak_bytes": sum(split.values()),
                "resident_peak_split": split, "resident_peak_at": self.where,
                "peak_bytes": dict(self.peak), "sum_of_peaks_bytes": sum(self.peak.values())} | (
                    {"observed": "; ".join(observed)} if observed else {})


class Probe:
    """What a rank holds over one step: ``with probe.watch(): step``, then :meth:`record`."""

    def __init__(self, roots: list, optimizers: list):
        self.roots, self.optimizers = list(roots), list(optimizers)
        self.saved = SavedActivations(state_storages(self.roots + self.optimizers))
        self.gradients = Gradients(self.roots, self.optimizers)
        self.ledgers = Ledgers(self.roots)

    @contextmanager
    def watch(self):
        with self.saved.watch():
            yield self

    def record(self, step: int) -> dict:
        """The ``held`` record of the step watched (stops the counting)."""
        walked = model_states(self.roots, self.optimizers) | {"gradients": self.gradients.close()}
        return record(self.saved, walked, step, self.ledgers.close())


#: the ledger's categories under the record's names
_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer"}


def record(saved: SavedActivations, states: dict, step: int, ledger: dict | None = None) -> dict:
    """The ``held`` record of one rank (``states``: the walk's, by kind; ``ledger``: :meth:`Ledgers.close`'s)."""
    counted = ("saved activations: saved_tensors_hooks per storage over the step, less the storages the "
               "strategy held before it; gradients: the most alive at once in the step; the rest: tensors "
               "reachable from the strategy and its optimizers after it (not what lives only in C++)")
    out = {"step": step, "saved_activations_peak_bytes": saved.peak, "saved_tensors": saved.tensors}
    if ledger is not None:
        out |= {"walked_bytes": dict(states), "ledger": ledger}
        states = {_NAMES[k]: v for k, v in ledger["resident_peak_split"].items()} | {"other": states["other"]}
        counted += ("; parameters and gradients: the strategy's ledgers at the most they held at once in the "
                    "step, optimizer state: theirs after it (the walk's figures: walked_bytes)")
    return out | {"model_states_bytes": states, "model_states_total_bytes": sum(states.values()),
                  "counted": counted}
