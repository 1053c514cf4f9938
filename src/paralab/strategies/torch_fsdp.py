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

With ``--tp T`` (the gpt): torchtitan's order, tensor parallelism first, then
FSDP. A 2-D ``DeviceMesh`` (dp x tp, the mesh's own rank order) is made;
``parallelize_module`` lays the gpt out on its tp dimension exactly as
``torch-tp`` does (``torch_tp.tp_plan``), then ``fully_shard`` shards every
unit over its dp dimension, so each parameter is a DTensor placed
``(_StridedShard(0), Shard(d))``: FSDP's dim-0 chunk of this rank's tp slice.
The loss runs inside ``loss_parallel()``; checkpoints keep the local tensors,
put back together per tp rank along dim 0 (FSDP), then along the tp dimension.
DTensor's tp collectives are not ``comm`` spans (as ``torch-tp``).

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
from ..errors import UsageError
from ..kinds import MEMORY, MemoryModel
from ..mesh import MeshShape
from .base import StepResult, Strategy, broadcast_buffers
from .data_parallel import AccumulateOptions
from .dtensor_state import (held_gradients, load_local_state, local, local_from_portable, local_state,
                            portable_from_local)
from .memory_ledger import Ledger, optimizer_kind
from .portable import Portable, tp_chunk
from .tensor.strategy import TensorOptions


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
    options = (AccumulateOptions, TensorOptions)
    clips = True

    @classmethod
    def why_not_pipelined(cls, cfg) -> str:
        return ("FSDP2 shards whole-model parameters across every rank; composing it with pipeline stages "
                "(as torchtitan does) is not built here. Use 'ddp --pp' or 'fsdp --zero-stage 1 --pp'")

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        """dp over the workers, or dp x tp under ``--tp`` (FSDP2 on PyTorch's DTensor tp); no ``--pp``."""
        if cfg.pp > 1:
            raise UsageError(f"strategy {cls.name!r} cannot be composed with pipeline stages (--pp {cfg.pp}): "
                             f"{cls.why_not_pipelined(cfg)}")
        return MeshShape.for_world(world, tp=cfg.tp)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        if cfg.tp > 1:  # PyTorch's tp layout of the gpt, on the tp dimension
            from .torch_tp import TorchTP
            TorchTP.validate(cfg, cfg.tp)
            if cfg.accumulate != 1:
                raise UsageError("torch-fsdp with --tp does not take --accumulate; drop it")

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.microbatches = ctx.options.accumulate
        self.model = model_fn().to(ctx.device)
        self.keys = list(self.model.state_dict().keys())
        tp = ctx.mesh.size("tp") if ctx.mesh is not None else 1
        self.tp_comm = ctx.mesh.comm("tp") if tp > 1 else None
        self.tp_layout: dict[str, int] = {}
        if tp > 1:  # torchtitan's order: PyTorch's tp on the tp dimension, then FSDP2 over dp
            from torch.distributed.tensor.parallel import parallelize_module
            from .torch_tp import _shard_dim, tp_plan
            mesh = init_device_mesh(ctx.device.type, (ctx.world // tp, tp), mesh_dim_names=("dp", "tp"))
            parallelize_module(self.model, mesh["tp"], tp_plan(self.model, ctx.options.sequence_parallel))
            for unit in list(self.model)[1:-1]:  # this rank's heads (q, k, v are column-split)
                unit.attn.heads //= tp
            self.tp_layout = {k: d for k, v in self.model.state_dict().items() if (d := _shard_dim(v)) is not None}
            self.mesh = mesh["dp"]
        else:
            self.mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        self.dp_comm = ctx.mesh.comm("dp") if ctx.mesh is not None else ctx.comm
        self.local_parameters = sum(local(p).numel() for p in self.model.parameters())  # this tp rank's
        self.units = [u for u in self.model if any(True for _ in u.parameters())]
        self.unit_parameters = max(sum(local(p).numel() for p in u.parameters()) for u in self.units)
        for unit in self.units:
            fully_shard(unit, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.reduce_scatter = None
        if AllGather is not None:  # on CUDA too: spans are device events, nothing synchronises (docstring)
            self.reduce_scatter = TimedReduceScatter(self.dp_comm)
            gather = TimedAllGather(self.dp_comm)
            for unit in self.units:
                unit.set_custom_all_gather(gather)
                unit.set_custom_reduce_scatter(self.reduce_scatter)
        self.params = list(self.model.parameters())
        self.parameters = sum(p.numel() for p in self.params)
        self.optimizer = optim_fn(self.params)
        self.ledger = Ledger(observes="torch-fsdp: at forward unit boundaries, after backward and at the step: "
                                      "a lower bound (backward's internals are not visible)")
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
        loss = self.forward_backward(self.model, x, y, self._no_sync if self.microbatches > 1 else None,
                                     last=self._loss_parallel if self.tp_comm is not None else None)
        self._observe("after backward")
        self.clip_gradients()
        with self.rec.span("optimizer", "step"):
            self.ctx.update(self.optimizer)
            self.ledger.set("optimizer", self._optimizer_bytes(), "optimizer step")
            self.ledger.set("grads", 0)
        broadcast_buffers(self.dp_comm, self.model)
        return StepResult(loss, len(y))

    def held_gradients(self):
        """Every parameter is a DTensor sharded over dp (and over tp where the plan splits it): its local
        shard, counted once per rank it is replicated over."""
        return held_gradients(list(self.model.parameters()), self.ctx.world)

    @staticmethod
    def _loss_parallel():
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()

    @torch.no_grad()
    def predict(self, x):
        logits = self.eval_logits(self.model, x)
        if self.tp_comm is None:
            return logits
        part = local(logits).movedim(-1, 0).contiguous()  # this tp rank's vocabulary columns, gathered
        out = part.new_empty((part.shape[0] * self.tp_comm.world,) + tuple(part.shape[1:]))
        self.tp_comm.all_gather_into(out, part, name="torch_fsdp_tp_gather_logits")
        return out.movedim(0, -1)

    @torch.no_grad()
    def full_state_dict(self):
        state = self.model.state_dict()
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v.detach()).clone() for k, v in state.items()}

    def _tp_meta(self) -> dict:
        if self.tp_comm is None:
            return {}
        return {"tp": {"rank": self.tp_comm.rank, "size": self.tp_comm.world, "layout": self.tp_layout}}

    def state_dict(self):
        return {"world": self.ctx.world, **self._tp_meta(), **local_state(self.model, self.optimizer)}

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
        if "tp" in states[0]:  # each tp rank's slices over its dp replicas, then the slices along the tp dim
            return cls.portable(states, model).tensors
        params = dict(model.named_parameters())
        return {k: torch.cat([s["model"][k] for s in states], dim=0) if k in params else v
                for k, v in states[0]["model"].items()}

    @classmethod
    def portable(cls, states, model):
        """Parameters and their optimizer state: ``Shard(0)`` chunks concatenated; buffers rank 0's."""
        params = dict(model.named_parameters())
        if "tp" not in states[0]:
            return portable_from_local(states, list(params), lambda k: 0 if k in params else None)
        meta = states[0]["tp"]  # under --tp: per tp rank (its dp replicas in rank order), then along the tp dim
        layout = meta["layout"]
        parts = [portable_from_local([s for s in states if s["tp"]["rank"] == r], list(params),
                                     lambda k: 0 if k in params else None) for r in range(meta["size"])]

        def whole(key, pieces):
            return torch.cat(pieces, layout[key]) if key in layout and pieces[0].dim() > 0 else pieces[0]
        tensors = {k: whole(k, [p.tensors[k] for p in parts]) for k in parts[0].tensors}
        optimizer = {n: {key: whole(n, [p.optimizer[n][key] for p in parts]) if torch.is_tensor(v) else v
                         for key, v in st.items()} for n, st in parts[0].optimizer.items()}
        return Portable(tensors, optimizer)

    def load_portable(self, portable):
        params = dict(self.model.named_parameters())
        rank, world = self.ctx.rank, self.ctx.world
        if self.tp_comm is not None:  # this tp rank's slices first; FSDP's chunks of them below
            layout, r, t = self.tp_layout, self.tp_comm.rank, self.tp_comm.world

            def mine(k, v):
                return tp_chunk(v, layout[k], r, t) if k in layout and v.dim() > 0 else v
            portable = Portable({k: mine(k, v) for k, v in portable.tensors.items()},
                                {n: {key: mine(n, v) if torch.is_tensor(v) else v for key, v in st.items()}
                                 for n, st in portable.optimizer.items()}, portable.notes)
            rank, world = self.dp_comm.rank, self.dp_comm.world
        self.load_state_dict({"world": self.ctx.world, **self._tp_meta(), **local_from_portable(
            portable, self.model, self.optimizer, lambda k: 0 if k in params else None, rank, world)})

    def extra_summary(self):
        model = MemoryModel(parameters=self.local_parameters, workers=self.dp_comm.world, zero_stage=3,
                            optimizer=optimizer_kind(self.optimizer), precision="fp32",
                            unit_parameters=self.unit_parameters)
        return {"zero_stage": 3, "collectives_timed": self.reduce_scatter is not None,
                "reduce_scatter": self.reduce_scatter.kind if self.reduce_scatter else None,
                MEMORY: {"model": model.to_dict()}}  # measured: the held record (run/held.py)
