"""``torch-fsdp``: PyTorch's FSDP2 (``fully_shard``), the comparison for ``fsdp``.

``fully_shard`` is applied to every unit that has parameters and then to the
whole model, so PyTorch shards, gathers and frees at the same granularity as
our ``fsdp`` at stage 3 (each unit all-gathered before its forward and
backward and resharded after; gradients reduce-scattered and averaged over
ranks). Parameters become ``DTensor`` shards (dim 0 of each tensor); the
optimizer built from the run's factory holds state for the local shard only.

Its all-gathers and reduce-scatters go through ``comm.py``: FSDP2's
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` hooks are given two
small classes that call ``comm.all_gather_into`` / ``comm.reduce_scatter``
with the buffers, process group and reduce op FSDP chose, so each collective
is timed and its bytes counted. FSDP issues them from inside the unit's
forward and backward, so they are ``comm`` spans nested in ``compute`` spans
(each moment counted once, in the innermost span); on CUDA, where they run
on side streams, a span may outlast its unit's ``compute`` span and the
shared moments count as ``comm``.

BatchNorm buffers are not sharded: rank 0's are broadcast after every step
(``first-replica``). ``--accumulate K`` turns gradient reduction off for all
but the last microbatch (``set_requires_gradient_sync``).
``full_state_dict()`` turns every ``DTensor`` into a full tensor under the
plain model's keys; the checkpoint keeps each rank's local shards as plain
tensors and rebuilds DTensors on load.

Memory: the local parameter shards, the unsharded parameters FSDP has
gathered, the local gradient shards and the optimizer state, read before and
after each unit's forward, after backward and at the optimizer step.

Why, and how it compares with our fsdp: docs/fsdp.md#compared-with-pytorchs-fsdp-torch-fsdp
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed.fsdp  # noqa: F401  (the subpackage must be imported explicitly)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

try:  # FSDP2's custom-communication interface (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP's collectives stay untimed, inside compute
    AllGather = ReduceScatter = None

from ..comm import nbytes
from ..kinds import MEMORY, MemoryModel
from .base import StepResult, Strategy, broadcast_buffers
from .data_parallel import AccumulateOptions
from .dtensor_state import load_local_state, local, local_from_portable, local_state, portable_from_local
from .memory_ledger import Ledger, optimizer_kind


if AllGather is not None:
    class _Timed:
        """What both hooks share: comm.py to call, and plain buffers (as FSDP2's default)."""

        def __init__(self, comm):
            self.comm = comm

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class TimedAllGather(_Timed, AllGather):
        """FSDP2's all-gather of a unit's parameter shards, issued through comm.py."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if async_op:  # FSDP waits on the work itself, so hand it the backend's Work
                return self.comm.all_gather_into(output_tensor, input_tensor, name="fsdp2_all_gather",
                                                 async_op=True, group=group).work
            self.comm.all_gather_into(output_tensor, input_tensor, name="fsdp2_all_gather", group=group)
            return None

    class TimedReduceScatter(_Timed, ReduceScatter):
        """FSDP2's reduce-scatter of a unit's gradients, issued through comm.py (synchronously)."""

        kind = None  # "reduce_scatter" or "all_reduce+slice", as comm.py reports

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.kind = self.comm.reduce_scatter(output_tensor, input_tensor, name="fsdp2_reduce_scatter",
                                                 op=op, group=group)
            return None


class TorchFSDP(Strategy):
    name = "torch-fsdp"
    data_parallel = True
    replicated = False
    bn_rule = "first-replica"
    options = (AccumulateOptions,)

    @classmethod
    def why_not_pipelined(cls, cfg) -> str:
        return ("FSDP2 shards whole-model parameters across every rank; composing it with pipeline stages "
                "(as torchtitan does) is not built here. Use 'ddp --pp' or 'fsdp --zero-stage 1 --pp'")

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.microbatches = ctx.options.accumulate
        self.model = model_fn().to(ctx.device)
        self.keys = list(self.model.state_dict().keys())
        self.mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        self.units = [u for u in self.model if any(True for _ in u.parameters())]
        for unit in self.units:
            fully_shard(unit, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.reduce_scatter = None
        if AllGather is not None:  # on CUDA too: spans are device events, nothing synchronises (docstring)
            self.reduce_scatter = TimedReduceScatter(self.comm)
            gather = TimedAllGather(self.comm)
            for unit in self.units:
                unit.set_custom_all_gather(gather)
                unit.set_custom_reduce_scatter(self.reduce_scatter)
        self.params = list(self.model.parameters())
        self.parameters = sum(p.numel() for p in self.params)
        self.optimizer = optim_fn(self.params)
        self.ledger = Ledger()
        self.shard_bytes = sum(nbytes(local(p)) for p in self.params)
        self.ledger.add("params", self.shard_bytes, "init")
        for unit in self.units:
            unit.register_forward_pre_hook(lambda m, a: self._observe("forward"))
            unit.register_forward_hook(lambda m, a, o: self._observe("after forward"))

    # ------------------------------------------------------------ memory
    def _observe(self, where: str) -> None:
        """Count parameter and gradient bytes resident now (sharded + currently gathered)."""
        gathered = 0
        grads = 0
        for unit in self.units:
            for p in unit.parameters():
                if not isinstance(p, DTensor):  # FSDP swapped in the unsharded parameter
                    gathered += nbytes(p)
                if p.grad is not None:
                    grads += nbytes(local(p.grad))
        self.ledger.set("params", self.shard_bytes + gathered, where)
        self.ledger.set("grads", grads, where)

    def _optimizer_bytes(self) -> int:
        return sum(nbytes(local(t)) for state in self.optimizer.state.values() for t in state.values()
                   if torch.is_tensor(t))

    @contextmanager
    def _no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------ contract
    def train_step(self, x, y) -> StepResult:
        self.model.train()
        loss = self.forward_backward(self.model, x, y, self._no_sync if self.microbatches > 1 else None)
        self._observe("after backward")
        with self.rec.span("optimizer", "step"):
            self.optimizer.step()
            self.ledger.set("optimizer", self._optimizer_bytes(), "optimizer step")
            self.optimizer.zero_grad(set_to_none=True)
            self.ledger.set("grads", 0)
        broadcast_buffers(self.comm, self.model)
        return StepResult(loss, len(y))

    def predict(self, x):
        return self.eval_logits(self.model, x)

    @torch.no_grad()
    def full_state_dict(self):
        state = self.model.state_dict()
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v.detach()).clone() for k, v in state.items()}

    def state_dict(self):
        return {"world": self.ctx.world, **local_state(self.model, self.optimizer)}

    def load_state_dict(self, state):
        if state.get("world") != self.ctx.world:
            raise ValueError(f"checkpoint is from {state.get('world')} workers; this run has {self.ctx.world}")
        load_local_state(self.model, self.optimizer, self.params, state)
        self.ledger.set("optimizer", self._optimizer_bytes(), "load")

    @classmethod
    @torch.no_grad()
    def consolidate(cls, states, model):
        """Offline: each parameter from the ranks' local chunks (``Shard(0)``: torch.chunk's split of
        dim 0, the last ranks' chunks shorter or empty) concatenated in rank order; buffers (not
        sharded; rank 0's broadcast after every step): rank 0's."""
        world = states[0]["world"]
        if len(states) != world:
            raise ValueError(f"torch-fsdp: {len(states)} rank state(s) for a run on {world} workers")
        params = dict(model.named_parameters())
        return {k: torch.cat([s["model"][k] for s in states], dim=0) if k in params else v
                for k, v in states[0]["model"].items()}

    @classmethod
    def portable(cls, states, model):
        """Parameters and their optimizer state: ``Shard(0)`` chunks concatenated; buffers rank 0's."""
        params = dict(model.named_parameters())
        return portable_from_local(states, list(params), lambda k: 0 if k in params else None)

    def load_portable(self, portable):
        params = dict(self.model.named_parameters())
        self.load_state_dict({"world": self.ctx.world, **local_from_portable(
            portable, self.model, self.optimizer, lambda k: 0 if k in params else None, self.ctx.rank,
            self.ctx.world)})

    def extra_summary(self):
        measured = self.ledger.report() | {"observed": "forward unit boundaries, after backward, step: "
                                                       "a lower bound (backward internals not visible)"}
        if self.ctx.device.type == "cuda":
            measured["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        model = MemoryModel(parameters=self.parameters, workers=self.ctx.world, zero_stage=3,
                            optimizer=optimizer_kind(self.optimizer), precision="fp32",
                            unit_parameters=max(sum(p.numel() for p in u.parameters()) for u in self.units))
        return {"zero_stage": 3, "collectives_timed": self.reduce_scatter is not None,
                "reduce_scatter": self.reduce_scatter.kind if self.reduce_scatter else None,
                MEMORY: {"measured": measured, "model": model.to_dict()}}
