"""The data-parallel dimension: how the replicas of one module agree on its gradients.

A :class:`Replicas` object is one data-parallel *flavour* (gather-scatter,
all-reduce, bucketed DDP, PyTorch's DDP, ZeRO-1) applied to one module on the
mesh's ``dp`` group. The same object serves two layouts:

- pure data parallelism: the module is the whole model
  (:class:`~paralab.strategies.data_parallel.DataParallel`);
- data x pipeline parallelism: the module is one pipeline stage's units, and
  each stage's ``dp`` replicas agree among themselves
  (:class:`~paralab.strategies.pipeline.strategy.Pipeline`).

The model is staged first, then each stage wrapped. A step, whatever the
layout, drives a flavour in this order::

    replicas.start()                      # a new step: nothing reduced yet
    for each microbatch's backward:
        with replicas.last_backward() if it is the last one else nothing:
            backward                      # parameter .grad accumulates
    replicas.finish()                     # .grad is the mean over dp (or the shard of it)
    replicas.step()                       # optimizer step, gradients dropped
    replicas.sync_buffers()               # BatchNorm statistics: dp rank 0's

Parameters stay real ``nn.Parameter``s, current after ``step()`` on every
replica (ZeRO-1 keeps them as views of its flat buffers). Gradients are
synchronised once per step, by the last microbatch's backward: hooks that
fire during a backward (bucketed DDP, PyTorch's reducer) do nothing outside
``last_backward()``. The base class is the trivial flavour: one replica
(``single``, and the pure pipeline whose ``dp`` is 1).

Why, and how it compares with torchtitan's: docs/strategies.md#composed-data--tensor--pipeline-parallelism-on-a-mesh
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from ..comm import Comm
from .base import broadcast_buffers
from .portable import optimizer_by_name, optimizer_for, trainable


class Replicas:
    """A module replicated over the ``dp`` group, with the optimizer over what this rank updates."""

    #: name in summaries
    flavour = "local"
    gradient_copy = False  # whether it keeps a flat copy of the gradients between steps (ddp's buckets)
    #: a narrower dtype its gradients cross the wire in that the check's reference does not replay (a user's
    #: fp16 all-reduce): its data-parallel strategy declares it (``Strategy.gradient_wire``), for the check's band
    gradient_wire: torch.dtype | None = None

    def __init__(self, module: nn.Module, optim_fn, comm: Comm, ctx):
        self.module, self.comm, self.ctx = module, comm, ctx
        self.rec = ctx.recorder
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer(optim_fn)

    # ------------------------------------------------------------ set-up
    def build_optimizer(self, optim_fn) -> torch.optim.Optimizer:
        return optim_fn(self.params)

    def forward_module(self) -> nn.Module:
        """The module to run forward through when this flavour owns the whole model (pure data
        parallelism): PyTorch's DDP returns its wrapper. Pipeline stages run their own units."""
        return self.module

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """dp rank 0's parameters and buffers on every replica (they are equal already, built from
        the same seed; this is what a real launch with independent initialisations needs)."""
        if self.comm.world == 1:
            return
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            self.comm.broadcast(t, 0, name="broadcast_params")

    # ------------------------------------------------------------ one step
    def start(self) -> None:
        """A new step begins: no gradient is final yet."""

    def accumulating(self):
        """Context for a backward that is *not* the step's last (pure data parallelism's
        ``--accumulate``): only PyTorch's DDP needs one (``no_sync``)."""
        return nullcontext()

    @contextmanager
    def last_backward(self):
        """Context for the backward that completes this step's gradients."""
        yield

    def finish(self) -> None:
        """After the last backward: make ``.grad`` the mean over the dp replicas."""

    def held_gradients(self, keys: dict[int, str], copies) -> list[tuple[torch.Tensor, object]]:
        """After :meth:`finish`: each gradient this replica holds, with how many ranks hold the same: the
        group's size times ``copies(plain name)`` (the ranks of other dimensions holding it: tp's for a
        parameter it does not split). ``keys``: ``id(parameter) -> plain name`` (``--clip-grad``)."""
        return [(p.grad, self.comm.world * copies(keys[id(p)])) for p in self.params if p.grad is not None]

    def step(self) -> None:
        with self.rec.span("optimizer", "step"):
            self.ctx.update(self.optimizer)  # (--on-nonfinite skip: the step's gradients dropped, nothing updated)

    def sync_buffers(self, after_step: bool = True) -> None:
        """BatchNorm running statistics: dp rank 0's are authoritative (as PyTorch's DDP).

        Called after every step, and before the weights are read or used for
        evaluation (``after_step=False``; redundant but for PyTorch's DDP,
        which broadcasts them at the start of its next forward instead)."""
        broadcast_buffers(self.comm, self.module)

    # ------------------------------------------------------------ state and records
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def optimizer_portable(cls, states: list[dict], units: dict) -> dict[str, dict]:
        """Offline: the flavour states (:meth:`state_dict`) of one module's dp replicas, in dp order,
        -> each trainable parameter's whole optimizer state by plain name. ``units``: plain index ->
        unit, as the module held them. Every flavour but ZeRO-1 keeps the whole state on every replica."""
        return optimizer_by_name(states[0]["optimizer"], [n for n, _ in trainable(units)])

    def state_from_portable(self, portable, units: dict) -> dict:
        """This replica's :meth:`state_dict` made from a ``Portable`` (``units``: as the module holds them)."""
        return {"optimizer": optimizer_for(self.optimizer, [n for n, _ in trainable(units)], portable.optimizer)}

    def summary(self) -> dict:
        """Flavour-specific figures for summary.json."""
        return {}

    def unexercised(self) -> list[str]:
        """What this flavour leaves trivial here (``Strategy.unexercised``)."""
        return []
