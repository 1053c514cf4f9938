"""``model``: naive model parallelism (CS1390 Part 2).

The model's flat unit list is cut into ``W`` contiguous stages
(``--partition``, see :mod:`paralab.partition`); rank ``k`` holds stage ``k``
only. One training step:

1. forward: stage 0 runs its units on the batch and sends the activation to
   stage 1; every later stage waits for the activation of the stage before
   it (its shape is known ahead from the partition), runs its units and sends
   on; the last stage computes the loss;
2. backward, in reverse: the last stage starts from the loss, every other
   stage waits for the gradient of its output; each stage goes back through
   its units one at a time with ``torch.autograd.grad`` (one call per unit:
   the calls grow with the units in the stage), accumulating the parameter
   gradients, and sends the gradient of its input to the stage before;
3. each stage steps its own optimizer on its own parameters.

Only one stage computes at a time; the others wait (``idle`` spans): that
waiting is the bubble, ``(W - 1) / W`` with equal stages, which the
``pipeline`` strategy shrinks with microbatches.

Every rank is handed the whole global batch (``data_parallel = False``);
stages after the first ignore the images, the last uses the labels.
BatchNorm running statistics need no synchronisation: each BN layer lives
on exactly one stage and sees the batch once, as in one process
(``bn_rule = "sequential"``).

:class:`Stage` and :class:`StagedStrategy` are shared with ``pipeline``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError
from ..partition import (boundary_shapes, measure_unit_times, parse_spec, partition_model, sample_batch,
                         split_costs, unit_label)
from .base import Context, StepResult, Strategy


class Stage:
    """One rank's contiguous slice of the units, with a per-unit forward and backward.

    ``forward(mb, x)`` runs each unit on a detached copy of the previous
    unit's output and keeps every (input, output) pair until ``backward(mb)``
    walks them back with one ``torch.autograd.grad`` call per unit. It also
    counts the microbatches whose activations are alive and the bytes autograd
    saved for them (measured with ``saved_tensors_hooks``), with their peaks.
    """

    def __init__(self, units: dict[int, nn.Module], first: bool, last: bool,
                 in_shape: tuple[int, ...], out_shape: tuple[int, ...], ctx: Context):
        self.indices = list(units)
        self.units = nn.ModuleList(units.values()).to(ctx.device)
        self.first, self.last = first, last
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)  # per sample
        self.ctx = ctx
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.saved_bytes: dict[int, int] = {}
        self.peak_alive = 0
        self.peak_bytes = 0
        self._param_ptrs = {p.data_ptr() for p in self.units.parameters()}

    # ------------------------------------------------------------ bookkeeping
    def parameters(self) -> list[nn.Parameter]:
        return list(self.units.parameters())

    def train(self, mode: bool = True) -> None:
        self.units.train(mode)

    def alive(self) -> int:
        return len(self.saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under the plain model's keys (``"<unit index>.<name>"``)."""
        return {f"{i}.{k}": v for i, unit in zip(self.indices, self.units) for k, v in unit.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, unit in zip(self.indices, self.units):
            prefix = f"{i}."
            unit.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    # ------------------------------------------------------------ compute
    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """Run the stage on microbatch ``mb``, keeping what backward needs."""
        seen: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor):
            if t.data_ptr() not in self._param_ptrs:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        pairs = []
        h = x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.ctx.autocast():
            for n, unit in enumerate(self.units):
                # a leaf per unit: its gradient is what the unit's backward hands to the one before
                inp = h.detach().requires_grad_(n > 0 or not self.first)
                h = unit(inp)
                pairs.append((inp, h))
        self.saved[mb] = pairs
        self.saved_bytes[mb] = sum(seen.values())
        self.peak_alive = max(self.peak_alive, len(self.saved))
        self.peak_bytes = max(self.peak_bytes, sum(self.saved_bytes.values()))
        return h

    def backward(self, mb: int, grad_output: torch.Tensor | None = None,
                 loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back through the units of microbatch ``mb``, last to first, one ``autograd.grad`` each.

        Starts from ``loss`` (last stage) or from ``grad_output``, the gradient
        of this stage's output. Parameter gradients accumulate in ``.grad``.
        Returns the gradient of the stage's input (None on the first stage).
        """
        pairs = self.saved.pop(mb)
        self.saved_bytes.pop(mb)
        grad = grad_output
        for unit, (inp, out) in zip(reversed(self.units), reversed(pairs)):
            params = [p for p in unit.parameters() if p.requires_grad]
            wrt = ([inp] if inp.requires_grad else []) + params
            if not wrt:
                grad = None
                continue
            if loss is not None:  # the last unit of the last stage: the loss is a function of its output
                grads = torch.autograd.grad(loss, wrt, allow_unused=True)
                loss = None
            else:
                grads = torch.autograd.grad(out, wrt, grad_outputs=grad.to(out.dtype), allow_unused=True)
            if inp.requires_grad:
                grad, grads = grads[0], grads[1:]
            else:
                grad = None
            for p, g in zip(params, grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return grad

    @torch.no_grad()
    def infer(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx.autocast():
            for unit in self.units:
                x = unit(x)
        return x


class StagedStrategy(Strategy):
    """What ``model`` and ``pipeline`` share: partition, stage, evaluation, weights, records."""

    data_parallel = False    # every rank is handed the whole global batch
    replicated = False       # each rank holds different weights
    bn_rule = "sequential"   # each BN layer sees the microbatches one after another

    def __init__(self, ctx: Context, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.microbatches = self.planned_microbatches()
        self._model_fn, self._optim_fn = model_fn, optim_fn
        model = model_fn()
        self.num_units = len(model)
        self.unit_labels = [unit_label(u) for u in model]
        self.unit_shapes = boundary_shapes(model)  # per-sample shape entering each unit, then the output
        self.partition_method = str(ctx.option("partition", "balanced"))
        self.ranges, self.unit_times = self._agree_on_partition(model)
        self._build_stage(model)

    # ------------------------------------------------------------ set-up
    def planned_microbatches(self) -> int:
        return 1

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        from ..models import build_model
        if cfg.accumulate != 1:
            raise UsageError(f"--accumulate is for data-parallel strategies; {cls.name} splits a batch "
                             "with --microbatches (strategy pipeline)")
        units = len(build_model(cfg.model, width=cfg.width, norm=cfg.norm))
        parse_spec(cfg.partition, world, units)

    def _agree_on_partition(self, model: nn.Module):
        """Rank 0 cuts the model (timing differs between processes) and every rank takes its cut."""
        ctx = self.ctx
        answer = None
        if ctx.rank == 0:
            method = parse_spec(self.partition_method, ctx.world, len(model))
            times = None
            if method == "balanced":
                batch = int(ctx.option("batch_size", 32) or 32) // self.microbatches
                sample = sample_batch(max(1, min(batch, 32)), device=ctx.device)
                times = measure_unit_times(model.to(ctx.device), sample)
                model.cpu()
                ranges = split_costs(times, ctx.world)
            else:
                ranges = partition_model(model, ctx.world, self.partition_method)
            answer = ([tuple(r) for r in ranges], times)
        ranges, times = self.comm.broadcast_object(answer, src=0)
        return [tuple(r) for r in ranges], times

    def _build_stage(self, model: nn.Module) -> None:
        rank, world = self.ctx.rank, self.ctx.world
        a, b = self.ranges[rank]
        self.stage = Stage({i: model[i] for i in range(a, b)}, first=rank == 0, last=rank == world - 1,
                           in_shape=self.unit_shapes[a], out_shape=self.unit_shapes[b], ctx=self.ctx)
        self.optimizer = self._optim_fn(self.stage.parameters())

    @property
    def first(self) -> bool:
        return self.stage.first

    @property
    def last(self) -> bool:
        return self.stage.last

    def check_input(self, x: torch.Tensor) -> None:
        if tuple(x.shape[1:]) != tuple(self.unit_shapes[0]):
            raise RuntimeError(f"{self.name}: inputs of shape {tuple(x.shape[1:])} per sample, but the stage "
                               f"boundaries were sized for {tuple(self.unit_shapes[0])}")

    # ------------------------------------------------------------ communication
    def receive(self, name: str, shape: tuple[int, ...], src: int, mb: int = 0) -> torch.Tensor:
        """Wait for a peer's tensor of a known shape; the wait is ``idle`` time."""
        buf = torch.empty(shape, device=self.ctx.device)
        self.comm.irecv(buf, src, name=name).wait(category="idle", mb=mb)
        return buf

    # ------------------------------------------------------------ contract
    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        """Collective over the stages: every rank calls it with the same batch; the last returns logits."""
        self.check_input(x)
        self.stage.train(False)
        rank = self.ctx.rank
        if self.first:
            h = x
        else:
            h = torch.empty((len(x),) + self.stage.in_shape, device=self.ctx.device)
            self.comm.recv(h, rank - 1, name="recv_act")
        out = self.stage.infer(h)
        if not self.last:
            self.comm.send(out.float().contiguous(), rank + 1, name="send_act")
            return None
        return out.float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gathers every stage's tensors (plain model keys)."""
        mine = {k: v.detach().cpu().clone() for k, v in self.stage.state_dict().items()}
        whole: dict[str, torch.Tensor] = {}
        for part in self.comm.all_gather_objects(mine):
            whole.update(part)
        return whole

    def state_dict(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges], "stage": self.stage.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        ranges = [tuple(r) for r in state["ranges"]]
        if ranges != self.ranges:  # a balanced cut is re-measured at start: keep the checkpoint's
            self.ranges = ranges
            self._build_stage(self._model_fn())
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------ records
    def schedule_name(self) -> str:
        return "naive"

    def in_flight_bound(self) -> int:
        return self.microbatches

    def bubble(self) -> dict:
        """Measured bubble of this rank: idle time / step time, per step and averaged.

        Step time is the span of the step's recorded intervals on this rank
        (data loading to optimizer); asynchronous transfers are left out (they
        overlap). The first ``warmup`` steps are left out of the average.
        """
        steps: dict[int, list] = {}
        for s in self.rec.spans:
            if s.step >= 0 and not s.args.get("async"):
                steps.setdefault(s.step, []).append(s)
        by_step = {}
        for step, spans in sorted(steps.items()):
            length = max(s.t1 for s in spans) - min(s.t0 for s in spans)
            idle = sum(s.seconds for s in spans if s.category == "idle")
            by_step[step] = {"idle_s": idle, "step_s": length, "bubble": idle / length if length > 0 else 0.0}
        warmup = int(self.ctx.option("warmup", 1) or 0)
        measured = list(by_step)[warmup:] or list(by_step)
        mean = (lambda key: sum(by_step[s][key] for s in measured) / len(measured)) if measured else None
        return {"bubble": mean("bubble") if mean else None,
                "idle_s": mean("idle_s") if mean else None,
                "step_s": mean("step_s") if mean else None,
                "bubble_by_step": {str(s): round(v["bubble"], 6) for s, v in by_step.items()}}

    def extra_summary(self) -> dict:
        world, m = self.ctx.world, self.microbatches
        a, b = self.ranges[self.ctx.rank]
        share = None
        if self.unit_times:
            share = sum(self.unit_times[a:b]) / sum(self.unit_times)
        return {
            "stage": self.ctx.rank,
            "units": [a, b],
            "unit_labels": self.unit_labels[a:b],
            "stage_parameters": sum(p.numel() for p in self.stage.parameters()),
            "partition": self.partition_method,
            "ranges": [list(r) for r in self.ranges],
            "time_share": share,
            "schedule": self.schedule_name(),
            "microbatches": m,
            **self.bubble(),
            "bubble_theory": (world - 1) / (m + world - 1),
            "peak_microbatches_alive": self.stage.peak_alive,
            "peak_activation_bytes": self.stage.peak_bytes,
            "in_flight_bound": self.in_flight_bound(),
        }


class ModelParallel(StagedStrategy):
    name = "model"

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        super().validate(cfg, world)
        if cfg.microbatches != 1:
            raise UsageError("strategy 'model' runs each batch whole; for microbatches use "
                             f"'pipeline --microbatches {cfg.microbatches}'")

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        self.check_input(x)
        stage, rank, n = self.stage, self.ctx.rank, len(y)
        stage.train()

        # forward: activations flow from stage 0 to the last stage
        h = x if self.first else self.receive("recv_act", (n,) + stage.in_shape, rank - 1)
        loss = None
        with self.rec.span("compute", "forward", mb=0):
            out = stage.forward(0, h)
            if self.last:
                with self.ctx.autocast():
                    loss = F.cross_entropy(out, y)
        if not self.last:
            self.comm.send(out.detach().float().contiguous(), rank + 1, name="send_act")

        # backward: gradients flow back from the loss to stage 0
        grad = None if self.last else self.receive("recv_grad", (n,) + stage.out_shape, rank + 1)
        with self.rec.span("compute", "backward", mb=0):
            grad_input = stage.backward(0, grad_output=grad, loss=loss)
        if not self.first:
            self.comm.send(grad_input.contiguous(), rank - 1, name="send_grad")

        self.optimizer_step(self.optimizer)
        return StepResult(loss.item() if loss is not None else None, n)
