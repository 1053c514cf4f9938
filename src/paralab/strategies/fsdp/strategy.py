"""``fsdp``: fully sharded data parallelism from primitives, ZeRO stages 1, 2 and 3.

One mechanism with three settings (``--zero-stage``, default 3). Every unit
of the model (a flat ``nn.Sequential`` of units) that has parameters becomes
a :class:`~.flat.FlatUnit`; the optimizer (the run's factory: SGD with or
without momentum, or Adam) is given only this rank's shards, so its state
covers 1/N of the model at every stage. Stage 2 shards the gradients too,
stage 3 the parameters as well. The step, as this file reads:

- forward, unit by unit, each its own autograd graph (its input detached):
  the unit's parameters bound as views of its full flat tensor and the unit
  run; at stage 3 they are gathered first (the next unit's gather launched
  ahead, ``--prefetch``) and freed after (the last unit's stay: backward
  starts with them);
- backward, unit by unit from the last, with ``torch.autograd.grad``: at
  stage 3 the parameters re-gathered into the storage forward used; the
  gradients of the unit's input and parameters computed, and the flat
  gradient reduce-scattered to this rank's shard (stage 1: once backward is
  over);
- the optimizer step: on each unit's shard as soon as its gradient is
  reduced (stages 2-3; ``--no-step-in-backward`` turns it off), or on all
  shards after backward; at stages 1-2 the shard is a view of the full
  parameters, stepped in place and completed by an asynchronous all-gather;
  then BatchNorm buffers broadcast from rank 0 (``first-replica``).

A memory ledger (:mod:`..memory_ledger`) is told every byte as it is
allocated and freed (``run/held.py`` reads it over a run's first step). Under ``--tp`` (no ``--pp``) stages 2-3 run this class on
each rank's tensor-parallel slice of the units (``ctx.shard``, ``ctx.loss``),
sharded over the mesh's dp group; under ``--pp`` each stage is wrapped in a
ZeRO flavour instead (:mod:`.zero1`, :mod:`.zero23`), and so is stage 1 under
``--tp``. HSDP (``--replicate R``): sharded over the mesh's ``shard`` group,
each gradient shard all-reduced over ``replicate`` (``docs/hsdp.md``).
``--accumulate`` and parameters shared between units are not supported.

Why, and how it compares with PyTorch's: docs/fsdp.md#compared-with-pytorchs-fsdp-torch-fsdp
(the stage table, the primitives, why the step runs in backward, where the memory peaks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...comm import nbytes
from ...errors import UsageError
from ...kinds import MEMORY, MemoryModel
from ...options import option
from ..base import StepResult, Strategy, broadcast_buffers
from ..memory_ledger import Ledger, optimizer_kind, optimizer_state_bytes
from ..portable import Portable, flat_optimizer_portable, flat_optimizer_shard, shard_of, slots
from .flat import FlatUnit, step_shards, unpadded_note
from .zero1 import ZeroOneReplicas
from .zero23 import ZeroThreeReplicas, ZeroTwoReplicas


@dataclass
class FSDPOptions:
    """fsdp: ZeRO stage, optimizer step placement, prefetch"""
    zero_stage: int = option(3, "fsdp: what is sharded: 1 optimizer state, 2 + gradients, 3 + parameters",
                             choices=(1, 2, 3), identity=True)
    step_in_backward: bool = option(True, "fsdp stages 2-3: step each unit's shard as soon as its gradient is "
                                          "reduced, so gradient shards never pile up (off: one step after "
                                          "backward)")
    prefetch: bool = option(True, "fsdp stage 3: gather the next unit's parameters one unit ahead")
    replicate: int = option(1, "fsdp: HSDP, the data-parallel replicas split into this many replica groups, each "
                               "sharding the model over dp / R ranks; gradient shards all-reduced across groups "
                               "(e.g. 'fsdp --workers 4 --replicate 2' is 2 replicas x shard 2)", minimum=1,
                            identity=True)


class FSDP(Strategy):
    name = "fsdp"
    data_parallel = True
    bn_rule = "first-replica"
    options = (FSDPOptions,)
    #: it can split its data-parallel dimension into replica groups of shard groups (--replicate)
    hsdp = True
    clips = True

    @classmethod
    def validate(cls, cfg, world):
        if cfg.accumulate != 1:
            raise UsageError("fsdp does not support --accumulate; drop it (use a larger --batch-size)")

    @classmethod
    def mesh_shape(cls, cfg, world):
        shape = super().mesh_shape(cfg, world)
        if cfg.replicate > 1:
            if shape.dp % cfg.replicate:
                raise UsageError(f"--replicate {cfg.replicate} must divide the {shape.dp} data-parallel replicas "
                                 "(workers / (pp x tp)): change --replicate or --workers")
            shape = dataclasses.replace(shape, replicate=cfg.replicate)
        return shape

    @classmethod
    def pipeline_replicas(cls, cfg):
        """The ZeRO flavour of the stage that wraps each pipeline stage (``--pp``; and stage 1 under ``--tp``)."""
        return {1: ZeroOneReplicas, 2: ZeroTwoReplicas, 3: ZeroThreeReplicas}[cfg.zero_stage]

    @classmethod
    def runs_tensor_parallel(cls, cfg) -> bool:
        """Under ``--tp`` without ``--pp``: stages 2-3 run this strategy on the sharded units (per-unit
        gathers and frees, the step in backward) rather than a flavour around the sharded model."""
        return cfg.zero_stage >= 2

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.stage = ctx.options.zero_stage
        self.shard_params = self.stage >= 3
        self.shard_grads = self.stage >= 2
        self.replicated = not self.shard_params  # stages 1-2 keep a full replica on every rank
        # stages 2-3 reduce each unit's gradient as soon as its backward is done, so its shard can be
        # stepped there and then (stage 1 has no reduced gradient before backward ends)
        # --clip-grad, --on-nonfinite and fp16's loss scale need every gradient before any step (the norm is the
        # whole model's, and a step found bad is skipped on every rank): one step at the end
        self.step_in_backward = self.shard_grads and ctx.options.step_in_backward and not ctx.guarded
        self.prefetch = ctx.options.prefetch
        self.ledger = Ledger()
        self.reduce_scatter_kind: str | None = None
        comms = ctx.mesh.comms if ctx.mesh is not None else {}
        self.dp_comm = comms.get("dp", ctx.comm)  # the replicas: BatchNorm statistics from its rank 0
        # HSDP: sharded over the shard group, gradient shards all-reduced over the replicate group
        self.shard_comm, self.replicate_comm = comms.get("shard", self.dp_comm), comms.get("replicate")

        model = model_fn()  # every rank builds the same model (seeded factory), then keeps its shard
        if ctx.tp is not None:  # tensor parallelism: this rank's slice of every unit, then sharded over dp
            model = nn.Sequential(*ctx.shard(dict(enumerate(model))).values())
        self.keys = list(model.state_dict().keys())
        self.units = list(model)
        self.flat: dict[int, FlatUnit] = {}
        for i, unit in enumerate(self.units):
            if any(p.requires_grad for p in unit.parameters()):
                self.flat[i] = FlatUnit(i, unit, self.shard_comm, self.ledger, ctx.device,
                                        replicate=self.replicate_comm)
        self.model = model.to(ctx.device)  # what is left: modules without parameters, and buffers
        self.param_units = sorted(self.flat)
        self.flat_units = [self.flat[i] for i in self.param_units]
        for fu in self.flat_units:
            if self.shard_params:
                fu.hold_shard()
            else:
                fu.hold_full()
        self.optimizer = optim_fn([fu.shard for fu in self.flat_units])
        self.parameters = sum(fu.numel for fu in self.flat_units)

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        """Forward unit by unit; the loss; backward unit by unit from the last, each unit's gradient
        reduce-scattered to its shard as soon as it is computed (stage 1: once backward is over) and,
        stepping in backward, the shard stepped at once (else one step at the end); then BatchNorm
        statistics from rank 0."""
        self.model.train()
        graphs, logits = self._forward(x)
        with self.rec.span("compute", "forward", unit="loss"):
            with self.ctx.autocast():
                loss = self.ctx.loss(logits, y)
        with self.rec.span("compute", "backward", unit="loss"):
            grad = torch.autograd.grad(loss, logits)[0]
        for i in reversed(range(len(self.units))):
            grad = self._backward_unit(i, graphs.pop(), grad)
        if not self.shard_grads:  # stage 1: every flat gradient was held until backward is over
            for fu in self.flat_units:
                self.reduce_scatter_kind = fu.reduce_scatter(fu.grad)
                fu.grad = None
        self.clip_gradients()
        if not self.step_in_backward:
            self._step(self.flat_units, unit="all")
        broadcast_buffers(self.dp_comm, self.model)
        return StepResult(loss.item(), len(y))

    def held_gradients(self):
        """The gradient shards, each element counted as its parameter (HSDP: its replicas too)."""
        return [(fu.shard.grad, fu.shard_copies(self.copies)) for fu in self.flat_units if fu.shard.grad is not None]

    def _forward(self, x: torch.Tensor):
        """Unit by unit, each its own autograd graph (its input detached): the unit's parameters
        gathered (the next unit's gather launched) and bound, the unit run, its parameters freed (the
        last unit's stay: backward starts with them). Returns each unit's (input, output, parameter
        views), and the logits."""
        last = self.param_units[-1] if self.param_units else None
        self._prefetch(self._neighbour(-1, 1))
        graphs, h = [], x
        for i, unit in enumerate(self.units):
            fu = self._forward_ready(i)
            h_in = h.detach().requires_grad_(i > 0)
            with self.rec.span("compute", "forward", unit=i):
                leaves = fu.bind(fu.full, train=True) if fu is not None else []
                with self.ctx.autocast():
                    h = unit(h_in)
            if fu is not None and i != last:
                fu.free()
            graphs.append((h_in, h, leaves))
        return graphs, h

    def _backward_unit(self, i: int, graph, grad: torch.Tensor) -> torch.Tensor | None:
        """Unit ``i``'s backward, given its (input, output, parameter views) and its output's gradient;
        returns its input's gradient.

        The unit's parameters are re-gathered into the storage its forward
        used, the gradients of its input and parameters computed, the
        parameters freed and their gradients flattened; the previous unit's
        gather is launched only now (before this backward it would hold three
        units' full tensors at once), so it overlaps the reduce-scatter of
        this unit's flat gradient and, stepping in backward, its shard's step.
        """
        h_in, h_out, leaves = graph
        fu = self.flat.get(i)
        if fu is not None:
            fu.materialize()
        inputs = ([h_in] if i > 0 else []) + leaves
        if not inputs:  # a first unit without parameters: nothing to differentiate
            return None
        with self.rec.span("compute", "backward", unit=i):
            grads = torch.autograd.grad(h_out, inputs, grad, allow_unused=True, materialize_grads=True)
        grad_in = grads[0] if i > 0 else None
        if fu is None:
            return grad_in
        param_grads = grads[1:] if i > 0 else grads
        self.ledger.add("grads", sum(nbytes(g) for g in param_grads), f"backward unit {i}")  # autograd's
        fu.free()
        fu.unbind()
        flat_grad = fu.flatten_grads(param_grads)
        del grads, param_grads
        self._prefetch(self._neighbour(i, -1))
        if not self.shard_grads:
            fu.grad = flat_grad  # stage 1: reduced once backward is over
            return grad_in
        self.reduce_scatter_kind = fu.reduce_scatter(flat_grad)
        del flat_grad
        if self.step_in_backward:
            self._step([fu], unit=i)  # this unit's shard only; its gradient shard goes at once
        return grad_in

    def _step(self, units: list[FlatUnit], unit) -> None:
        step_shards(self.rec, self.optimizer, self.ledger, units, skip=self.ctx.skipping, unit=unit)

    # ------------------------------------------------------------ which unit's parameters, when
    def _forward_ready(self, i: int) -> FlatUnit | None:
        """Unit ``i``'s flat parameters, gathered (the next unit's gather launched), or None if it has none."""
        fu = self.flat.get(i)
        if fu is not None:
            fu.materialize()
            self._prefetch(self._neighbour(i, 1))
        return fu

    def _prefetch(self, index: int | None) -> None:
        if self.prefetch and index is not None:
            self.flat[index].prefetch()

    def _neighbour(self, i: int, step: int) -> int | None:
        """The next unit with parameters after (step=1) or before (step=-1) unit ``i``."""
        j = i + step
        while 0 <= j < len(self.units):
            if j in self.flat:
                return j
            j += step
        return None

    def _settle(self) -> None:
        """Wait for every gather still in flight (before reading or saving the parameters)."""
        for fu in self.flat_units:
            fu.wait()

    # ------------------------------------------------------------ evaluation and state
    @torch.no_grad()
    def predict(self, x):
        self.model.eval()
        self._prefetch(self._neighbour(-1, 1))
        h = x
        for i, unit in enumerate(self.units):
            fu = self._forward_ready(i)
            if fu is not None:
                fu.bind(fu.full, train=False)
            with self.ctx.autocast():
                h = unit(h)
            if fu is not None:
                fu.free()
                fu.unbind()
        return h.to(self.ctx.dtype)

    @torch.no_grad()
    def full_state_dict(self):
        """Complete, unpadded tensors under the plain model's keys, on every rank (collective)."""
        self._settle()
        tensors = {}
        for i, fu in zip(self.param_units, self.flat_units):
            tensors.update({f"{i}.{k}": v for k, v in fu.unflatten(fu.current()).items()})
        tensors.update({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return {k: tensors[k] for k in self.keys}

    def state_dict(self):
        self._settle()
        return {"zero_stage": self.stage, "world": self.shard_comm.world, "rank": self.shard_comm.rank, **self._hsdp(),
                "shards": [fu.shard.detach().clone() for fu in self.flat_units],
                "optimizer": self.optimizer.state_dict(),
                "buffers": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}

    @torch.no_grad()
    def load_state_dict(self, state):
        if state.get("zero_stage") != self.stage or state.get("world") != self.shard_comm.world:
            raise ValueError(f"checkpoint is fsdp stage {state.get('zero_stage')} sharded over {state.get('world')} "
                             f"ranks; this run is stage {self.stage} over {self.shard_comm.world}")
        self._settle()
        for fu, shard in zip(self.flat_units, state["shards"]):
            fu.shard.copy_(shard)
            if not fu.sharded:
                fu.gather(async_op=False)  # the other ranks' slices of the full parameters
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.load_state_dict(state["buffers"])
        self.ledger.set("optimizer", optimizer_state_bytes(self.optimizer), "load")

    @classmethod
    @torch.no_grad()
    def consolidate(cls, states, model):
        """Offline: per unit with parameters (as :class:`FlatUnit` lays it out: its trainable
        parameters in registration order, flat, zero-padded to a multiple of the ranks), the ranks'
        shards in rank order are the padded flat tensor; the padding is cut and the rest cut back
        into the parameters. Buffers (BatchNorm statistics): rank 0's, broadcast after every step."""
        states = [s for s in states if s.get("replica", 0) == 0]  # HSDP: one replica group holds every shard
        world = states[0]["world"]
        if len(states) != world or [s["rank"] for s in states] != list(range(world)):
            raise ValueError(f"fsdp: {len(states)} rank state(s) for a run on {world} workers")
        units = [(i, unit) for i, unit in enumerate(model) if any(p.requires_grad for p in unit.parameters())]
        if any(len(s["shards"]) != len(units) for s in states):
            raise ValueError(f"fsdp: the checkpoint holds {len(states[0]['shards'])} sharded units; "
                             f"this model has {len(units)}")
        tensors = {}
        for n, (i, unit) in enumerate(units):
            flat = torch.cat([s["shards"][n].reshape(-1) for s in states])
            offset = 0
            for name, p in unit.named_parameters():
                if p.requires_grad:
                    if offset + p.numel() > flat.numel():
                        raise ValueError(f"fsdp: unit {i}'s shards hold {flat.numel()} values, fewer than its "
                                         "parameters")
                    tensors[f"{i}.{name}"] = flat[offset:offset + p.numel()].view(p.shape).clone()
                    offset += p.numel()
        tensors.update(states[0]["buffers"])
        return tensors

    @classmethod
    @torch.no_grad()
    def portable(cls, states, model):
        """As :meth:`consolidate`, and each unit's optimizer state (the optimizer's parameter ``n`` is
        the ``n``-th flat unit's shard) put together and cut back the same way."""
        tensors = cls.consolidate(states, model)
        states = [s for s in states if s.get("replica", 0) == 0]
        units = [(i, unit) for i, unit in enumerate(model) if any(p.requires_grad for p in unit.parameters())]
        optimizer: dict[str, dict] = {}
        for n, (i, unit) in enumerate(units):
            optimizer |= flat_optimizer_portable([s["optimizer"]["state"].get(n, {}) for s in states], i,
                                                 slots(unit))
        return Portable(tensors, optimizer)

    def load_portable(self, portable):
        """This rank's shard of every flat unit's parameters and optimizer state; the buffers whole."""
        shards, state = [], {}
        for n, fu in enumerate(self.flat_units):
            layout = [(name, shape) for _, _, name, shape, _, _ in fu.slots]
            shards.append(shard_of([portable.tensors[f"{fu.index}.{name}"] for name, _ in layout], fu.padded,
                                   self.shard_comm.rank, self.shard_comm.world))
            held = flat_optimizer_shard(portable.optimizer, fu.index, layout, fu.padded, self.shard_comm.rank,
                                        self.shard_comm.world)
            if held is not None:
                state[n] = held
        self.load_state_dict({
            "zero_stage": self.stage, "world": self.shard_comm.world, "rank": self.shard_comm.rank, "shards": shards,
            "optimizer": {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]},
            "buffers": {k: portable.tensors[k] for k in self.model.state_dict()}})

    def _hsdp(self) -> dict:
        """Under HSDP, the replica groups and which one this rank is in."""
        if self.replicate_comm is None:
            return {}
        return {"replicate": self.replicate_comm.world, "replica": self.replicate_comm.rank}

    # ------------------------------------------------------------ records
    def memory_model(self) -> MemoryModel:
        """What the cost model needs to predict this rank's memory (``run/records.py`` asks it)."""
        # autocast (bf16) keeps parameters, gradients and state in fp32: the fp32 model applies
        return MemoryModel(parameters=self.parameters, workers=self.shard_comm.world, zero_stage=self.stage,
                           optimizer=optimizer_kind(self.optimizer), precision="fp32",
                           unit_parameters=max((fu.numel for fu in self.flat_units), default=0),
                           step_in_backward=self.step_in_backward)

    def unexercised(self) -> list[str]:
        return unpadded_note("fsdp", self.flat_units, self.shard_comm.world)

    def extra_summary(self):
        largest = max(self.flat_units, key=lambda fu: fu.numel, default=None)
        return {
            "zero_stage": self.stage,
            **self._hsdp(),
            "reduce_scatter": self.reduce_scatter_kind,
            "prefetch": self.prefetch and self.shard_params,
            "step_in_backward": self.step_in_backward,
            "units_sharded": len(self.flat_units),
            "padding_elements": sum(fu.padded - fu.numel for fu in self.flat_units),
            "shard_elements": sum(fu.shard_numel for fu in self.flat_units),
            "largest_unit": None if largest is None else {"index": largest.index, "parameters": largest.numel,
                                                          "bytes": largest.full_bytes},
            MEMORY: {"model": self.memory_model().to_dict()},  # measured: the rank's held record (run/held.py)
        }
