"""What a rank holds in memory, measured on any device: its model states and its saved activations.

A CPU has no allocator that counts (CUDA's ``max_memory_allocated`` is
recorded where there is one, ``recorder.allocator_peaks``), so a rank
measures what the memory model predicts, in the first step of each start
of a run (a warm-up step unless ``--warmup 0``: the hooks cost a few
microseconds per saved tensor, and no averaged step pays them):

- **Saved activations** (``training/saved.py``): the peak of what autograd
  held for backward over the step, once per storage, parameters left out.
- **Gradients**: the most gradient bytes alive at once during the step
  (most strategies free them after it; ZeRO-2/3 free each unit's after
  reducing it), counted from when autograd accumulates one into a
  parameter until it is freed, or, for a gradient a strategy assigns
  itself (a shard's), as the optimizer steps. fsdp rebuilds its units'
  parameters inside the step, so only its shards' gradients are seen here;
  its own ledger (``kinds.MEMORY``) counts the full ones.
- **The rest of the model states**, after the step: every tensor reachable
  from the strategy and its optimizers (``gc.get_referents``, so a
  ``--check`` reference model or a data batch is not counted), once per
  storage: parameters (and leaves trained in their place; a DTensor counts
  its local shard), optimizer state, and other (buffers, flat tensors,
  gradient buckets). What lives only in C++ (a torch-ddp reducer's
  buckets) is not seen.

The record is a sum of peaks, as the memory model's formula is.

Records: ``strategy_details[rank]["held"]`` (``kinds.HELD``); the report's
memory figure and ``bench/plan.py`` set it beside the prediction.
"""
from __future__ import annotations

import gc
import types
import weakref

import torch
from torch import nn

from ..training.saved import SavedActivations, storage


#: objects the walk does not enter: code and namespaces lead to everything a program imported
_OPAQUE = (type, str, bytes, int, float, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
           types.FrameType)


def reachable_tensors(roots: list) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through Python references (and a tensor's ``.grad``)."""
    seen_obj: set[int] = set()
    tensors: list[torch.Tensor] = []
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen_obj or isinstance(obj, _OPAQUE):
            continue
        seen_obj.add(id(obj))
        if torch.is_tensor(obj):
            tensors.append(obj)
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
    return tensors


def is_parameter(t: torch.Tensor) -> bool:
    """An ``nn.Parameter``, or a leaf that autograd gives a gradient (a view a strategy trains in place of one)."""
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


def parameter_storages(roots: list) -> set[int]:
    return {found[0] for t in reachable_tensors(roots) if is_parameter(t) for found in [storage(t)]
            if found is not None}


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


def record(saved: SavedActivations, states: dict, step: int) -> dict:
    """The ``held`` record of one rank."""
    return {"step": step, "saved_activations_peak_bytes": saved.peak, "saved_tensors": saved.tensors,
            "model_states_bytes": states, "model_states_total_bytes": sum(states.values()),
            "counted": "saved activations: saved_tensors_hooks per storage over the step; gradients: the most "
                       "alive at once in the step; the rest: tensors reachable from the strategy and its "
                       "optimizers after it (not what lives only in C++)"}
