"""ZeRO stages 2 and 3 as data-parallel flavours: ``fsdp --zero-stage 2|3`` under ``--pp`` (and 3-D).

The flavour contract (``replicas.py``) synchronises gradients once per step,
by the backward that completes them. ZeRO-1 (:mod:`.zero1`) reduce-scatters
every unit after that backward; these two do it *inside* it:

- **ZeRO-2** (:class:`ZeroTwoReplicas`): during the step's last backward
  (``last_backward()``, the stage's last microbatch), as soon as every
  parameter of a unit has received its gradient (a post-accumulate-grad hook
  per parameter), the unit's full gradient, accumulated over the step's
  microbatches, is flattened, reduce-scattered, and dropped; this rank keeps
  only its shard's mean. Earlier microbatches only accumulate, so a unit's
  gradient crosses the network once per step, whatever ``--microbatches``.
  Memory, honestly: across the microbatches the stage's whole gradient is held
  (it is accumulating there); what ZeRO-2 saves over ZeRO-1 is that each unit's
  full gradient goes as soon as it is complete, during the last backward,
  and the shards are all that is left for the optimizer.
- **ZeRO-3** (:class:`ZeroThreeReplicas`): also the parameters sharded. Between
  steps a rank holds only its shards. A unit's parameters are all-gathered
  when the step's first forward reaches it (the next unit's gather launched
  ahead, ``--prefetch``) and kept gathered across the step's microbatches,
  forwards and backwards, until the optimizer has stepped the shards; then
  their storage is freed. Gathering per microbatch instead would cost 2M
  all-gathers per unit and step (M forwards, M backwards, interleaved by the
  schedule) for a peak that a pipeline's schedule already sets with many
  microbatches alive; torchtitan makes the same choice under pipelines (it
  does not reshard after forward there). So during a step the stage's
  parameters are whole, as ZeRO-2's; the saving is between steps (and in
  the optimizer state and gradients, as ZeRO-2). Plain ``fsdp`` (no
  pipeline) frees each unit after its forward and re-gathers it for backward.

Both shard over the mesh's ``dp`` group (under HSDP its ``shard`` group, the
shards' gradients then all-reduced over ``replicate``: :mod:`.flat`).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn

from .flat import FlatUnit, step_shards
from .zero1 import ZeroOneReplicas


class ZeroTwoReplicas(ZeroOneReplicas):
    """ZeRO-2 over a module: optimizer state and gradients sharded, each unit's gradient reduce-scattered
    during the step's last backward as soon as it is complete."""

    flavour = "zero2"
    zero_stage = 2

    def __init__(self, module: nn.Module, optim_fn, comm, ctx):
        super().__init__(module, optim_fn, comm, ctx)
        self._last = False
        self._arrived: dict[int, int] = {}   # unit position -> parameters whose gradient is complete
        self.in_backward = 0                 # reductions made by the hooks, since the start
        for n, fu in enumerate(self.units):
            for p in fu.params:
                p.register_post_accumulate_grad_hook(partial(self._arrive, n))

    def start(self) -> None:
        super().start()
        self._arrived = {}

    @contextmanager
    def last_backward(self):
        """The step's last backward: each unit is reduced as its gradient completes."""
        self._last = True
        try:
            yield
        finally:
            self._last = False

    def _arrive(self, n: int, _p: torch.Tensor) -> None:
        if not self._last:
            return  # an earlier microbatch: the gradient only accumulates
        self._arrived[n] = self._arrived.get(n, 0) + 1
        if self._arrived[n] == len(self.units[n].params):
            self._reduce(n)

    @torch.no_grad()
    def _reduce(self, n: int) -> None:
        """Unit ``n``'s full gradient flattened, reduce-scattered to this rank's shard, and dropped."""
        fu: FlatUnit = self.units[n]
        for p in fu.params:
            if p.grad is None:  # unused in this step: a zero gradient, as the reduction expects one
                p.grad = torch.zeros_like(p)
                self._accumulated(p)
        grads = [p.grad for p in fu.params]
        flat_grad = fu.flatten_grads(grads)
        del grads
        for p in fu.params:
            p.grad = None
        self.reduce_scatter_kind = fu.reduce_scatter(flat_grad)
        self.in_backward += self._last  # how many reductions ran inside the last backward (summary)
        self._arrived[n] = -1  # reduced

    def summary(self) -> dict:
        return super().summary() | {"reduced_in_backward": self.in_backward}

    def finish(self) -> None:
        """The units no hook reduced (a parameter without a gradient this step), in order."""
        for n in range(len(self.units)):
            if self._arrived.get(n) != -1:
                self._reduce(n)
        self._arrived = {}


class ZeroThreeReplicas(ZeroTwoReplicas):
    """ZeRO-3 over a module: parameters sharded too; gathered when the step's first forward reaches a
    unit, kept for the step's microbatches, freed after the optimizer step."""

    flavour = "zero3"
    zero_stage = 3

    def __init__(self, module: nn.Module, optim_fn, comm, ctx):
        super().__init__(module, optim_fn, comm, ctx)
        self.prefetch = getattr(ctx.options, "prefetch", True)
        for n, fu in enumerate(self.units):
            fu.module.register_forward_pre_hook(lambda *_, n=n: self._ready(n))
            for register in (fu.module.register_state_dict_pre_hook, fu.module.register_load_state_dict_pre_hook):
                register(lambda *_, fu=fu: fu.materialize())
            fu.release_full()  # from now on only the shard is held between steps

    def _ready(self, n: int) -> None:
        """Unit ``n``'s parameters gathered (a no-op once they are), the next unit's gather launched."""
        self.units[n].materialize()
        if self.prefetch and n + 1 < len(self.units):
            self.units[n + 1].prefetch()

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """dp rank 0's parameters on every replica: gathered for the broadcast, freed after."""
        for fu in self.units:
            fu.materialize()
        super().broadcast_parameters()
        for fu in self.units:
            fu.shard.copy_(fu._my_slice(fu.full))
            fu.free()

    def step(self) -> None:
        self.settle()
        step_shards(self.rec, self.optimizer, self.ledger, self.units, skip=self.ctx.skipping)
        for fu in self.units:  # the step is over: only the shards stay
            fu.free()

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)  # copies the shards and gathers the full parameters
        for fu in self.units:
            fu.free()
