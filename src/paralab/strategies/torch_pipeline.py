"""``torch-pipeline``: PyTorch's ``torch.distributed.pipelining``, the comparison for ``pipeline``.

The model is cut exactly as ``pipeline`` cuts it (the same partitioner, the
same ranges, rank 0's cut broadcast), and each stage's units become one
``torch.distributed.pipelining.PipelineStage`` (an ``nn.Sequential`` over the
same unit modules, so weights, checkpoints, ``predict`` and ``--check`` are
``pipeline``'s). PyTorch's schedule classes order and run the work:

- ``gpipe``: ``ScheduleGPipe``; ``1f1b``: ``Schedule1F1B`` (one stage per rank);
- ``interleaved-1f1b``: ``ScheduleInterleaved1F1B``, ``--virtual-stages v``
  stages per rank placed as ours (rank ``r`` holds ``r, r+p, ...``);
- ``zbv``: ``ScheduleZBVZeroBubble`` and ``dualpipev``: ``ScheduleDualPipeV``,
  two stages per rank in a V (rank ``r`` holds stages ``r`` and ``2p-1-r``),
  the backward split into input and weight parts.

Shapes are given, not inferred: every stage gets example ``input_args`` and
``output_args`` of one microbatch (``requires_grad=True`` on the outputs and
on every later stage's input), so PyTorch runs no shape-inference forward. A
batch whose microbatches have another size gets stages and a schedule built
for that size. Each microbatch's loss is ``ctx.loss`` of its logits (the
cross-entropy; under fp16 loss-scaled, as every layout's), the gradients
scaled by ``1/m`` (``scale_grads``; under fp16 each microbatch's share of
the loss is scaled instead, ``_schedule_for``); BatchNorm sees each
stage's microbatches in order (``sequential``).

Records: each compute call of a stage (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``) is a ``compute`` span
named as ours (``forward``, ``backward``, ``backward_input``,
``backward_weight``, with ``mb`` and ``stage``). The time inside ``step()``
between them is an ``idle`` span ``torch-pipelining p2p+wait``. Pure
pipeline parallelism only (no ``--pp`` under a data-parallel flavour).

Why, and how it compares with our pipeline: docs/pipelines.md#pytorchs-schedules-torch-pipeline
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UsageError
from ..training import step as steps
from .base import StepResult, split_microbatches
from .pipeline.schedules import placement_for
from .pipeline.strategy import Pipeline, PipelineOptions

#: --schedule -> (PyTorch's class name, stages per rank: None = --virtual-stages, "V" = two in a V)
TORCH_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
                   "interleaved-1f1b": ("ScheduleInterleaved1F1B", None),
                   "zbv": ("ScheduleZBVZeroBubble", "V"), "dualpipev": ("ScheduleDualPipeV", "V")}
IDLE_NAME = "torch-pipelining p2p+wait"


def v_placement(ranks: int) -> tuple[int, ...]:
    """Stage -> rank for the V schedules: down the ranks, then back up (rank r holds r and 2p-1-r)."""
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))


class TorchPipeline(Pipeline):
    name = "torch-pipeline"
    moe = False  # PyTorch's schedules call their own loss function: no load-balancing loss there
    options = (PipelineOptions,)

    def __init__(self, ctx, model_fn, optim_fn, **kwargs):
        import torch.distributed.pipelining as pipelining
        self._pipelining = pipelining
        super().__init__(ctx, model_fn, optim_fn, **kwargs)
        self._built: dict[tuple[int, int], object] = {}  # (microbatch size, microbatches) -> schedule

    # ------------------------------------------------------------ declarations
    def planned_virtual_stages(self) -> int:
        return self.stages_per_rank(self.ctx.options)

    def planned_placement(self) -> tuple[int, ...]:
        if TORCH_SCHEDULES[self.schedule][1] == "V":
            return v_placement(self.pp.world)
        return placement_for(self.schedule, self.pp.world, self.virtual)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        if cfg.schedule not in TORCH_SCHEDULES:
            raise UsageError(f"torch-pipeline runs PyTorch's schedules: --schedule {' | '.join(TORCH_SCHEDULES)} "
                             f"(got {cfg.schedule!r}; zb-h1 and zb-h2 are ours: 'paralab train pipeline --schedule zb-h1')")
        per_rank = TORCH_SCHEDULES[cfg.schedule][1]
        if per_rank is None and cfg.virtual_stages < 2:
            raise UsageError(f"--schedule {cfg.schedule} holds several stages per rank: give --virtual-stages 2 "
                             "or more")
        if per_rank is not None and cfg.virtual_stages != 1:
            raise UsageError("--virtual-stages applies to interleaved-1f1b only"
                             f"{' (zbv and dualpipev hold two stages per rank, in a V)' if per_rank == 'V' else ''}")
        if cfg.schedule == "dualpipev" and cfg.microbatches < 2 * world:
            raise UsageError(f"PyTorch's dualpipev needs at least 2 x {world} = {2 * world} microbatches "
                             f"(got {cfg.microbatches})")
        super().validate(cfg, world)  # accumulate, the cut over all the stages, microbatches dividing the batch

    @classmethod
    def stages_per_rank(cls, cfg) -> int:
        per_rank = TORCH_SCHEDULES[cfg.schedule][1]
        return 2 if per_rank == "V" else cfg.virtual_stages if per_rank is None else 1

    @classmethod
    def schedule_problem(cls, cfg, ranks: int) -> str | None:
        if cfg.schedule == "interleaved-1f1b" and cfg.microbatches % ranks:
            return (f"PyTorch's interleaved-1f1b needs --microbatches a multiple of the {ranks} pipeline stages "
                    f"(got {cfg.microbatches})")
        return None

    # ------------------------------------------------------------ PyTorch's stages and schedule
    def _schedule_for(self, size: int, count: int):
        """PyTorch's stages and schedule for ``count`` microbatches of ``size`` samples (built once)."""
        key = (size, count)
        if key in self._built:
            return self._built[key]
        pipelining, ctx = self._pipelining, self.ctx
        last = len(self.ranges) - 1
        stages = []
        for s in sorted(self.stages):
            st = self.stages[s]
            example_in = torch.zeros((size,) + st.in_shape, device=ctx.device, dtype=ctx.dtype)
            if s > 0:
                example_in.requires_grad_(True)
            example_out = torch.zeros((size,) + st.out_shape, device=ctx.device, dtype=ctx.dtype,
                                      requires_grad=True)
            # under autocast a stage's last unit returns 16-bit activations, which PyTorch would send as the
            # float32 tensors its output_args promise: cast to them (paralab's own executor does the same)
            stage = pipelining.PipelineStage(nn.Sequential(*st.units, _Cast(ctx.dtype)), s, last + 1, ctx.device,
                                             input_args=(example_in,), output_args=(example_out,),
                                             group=self.pp.group)
            self._record_compute(stage, s)
            stages.append(stage)
        cls_name = TORCH_SCHEDULES[self.schedule][0]
        schedule_cls = getattr(pipelining, cls_name)
        # each microbatch's loss, the mean over it (the guard watches it); PyTorch divides the gradients by the
        # microbatches after backward. Under fp16 each microbatch's share of the loss is scaled instead, as the
        # reference and paralab's pipeline scale it: the whole loss at the loss scale would put the count times
        # the scale through float16 (overflowing where they do not)
        fp16 = ctx.loss_scale is not None
        loss_fn = (lambda out, y: ctx.loss(out, y, share=1 / count)) if fp16 else ctx.loss
        schedule = schedule_cls(stages[0] if len(stages) == 1 and cls_name in ("ScheduleGPipe", "Schedule1F1B")
                                else stages, count, loss_fn=loss_fn, scale_grads=not fp16)
        self._built[key] = schedule
        return schedule

    def _record_compute(self, stage, s: int) -> None:
        """A compute span around each of the stage's compute calls, named as ours."""
        rec = self.rec
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(chunk, *args, **kwargs):
            with rec.span("compute", "forward", mb=chunk, stage=s), steps.microbatch(chunk):
                return forward(chunk, *args, **kwargs)

        def backward_one_chunk(chunk, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            with rec.span("compute", "backward" if full else "backward_input", mb=chunk, stage=s):
                return backward(chunk, *args, **kwargs)

        def backward_weight_one_chunk(chunk, *args, **kwargs):
            with rec.span("compute", "backward_weight", mb=chunk, stage=s):
                return weight(chunk, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    # ------------------------------------------------------------ the step
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        self.check_input(x)
        for stage in self.stages.values():
            stage.train()
        chunks = split_microbatches(x, y, self.microbatches)
        steps.split([len(c[1]) for c in chunks])  # where each microbatch's rows sit (dropout, documents)
        sizes = {len(c[1]) for c in chunks}
        if len(sizes) != 1:
            raise RuntimeError(f"torch-pipeline needs equal microbatches (got sizes {sorted(sizes)})")
        schedule = self._schedule_for(sizes.pop(), len(chunks))
        self.flavours_do("start")
        losses: list[torch.Tensor] = []
        args = (x.to(self.ctx.device),) if self.first else ()
        target = y.to(self.ctx.device) if self.last else None
        t0, before = self.rec.now(), len(self.rec.spans)
        with self.ctx.autocast():
            schedule.step(*args, target=target, losses=losses if self.last else None, return_outputs=False)
        self._record_gaps(t0, self.rec.now(), self.rec.spans[before:])
        self.flavours_do("finish")
        self.clip_gradients()  # the flavours hold the stages' gradients as under paralab's pipeline
        self.flavours_do("step", "sync_buffers")
        loss = float(sum(float(v.detach()) for v in losses) / len(losses)) if self.last and losses else None
        return StepResult(loss, len(y))

    def _record_gaps(self, t0: float, t1: float, spans) -> None:
        """Idle spans for the time inside ``step()`` outside this rank's compute calls."""
        busy = sorted((s.t0, s.t1) for s in spans if s.category == "compute")
        at = t0
        for a, b in busy + [(t1, t1)]:
            if a > at:
                self.rec.add("idle", IDLE_NAME, at, a)
            at = max(at, b)

    def extra_summary(self) -> dict:
        record = super().extra_summary()
        record["torch_schedule"] = TORCH_SCHEDULES[self.schedule][0]
        if TORCH_SCHEDULES[self.schedule][1] == "V":
            record |= {"virtual_stages": 2, "held_stages": sorted(self.stages),
                       "held_units": [list(self.ranges[s]) for s in sorted(self.stages)]}
        return record


class _Cast(nn.Module):
    """The output cast to ``dtype`` (the activations between stages, whatever autocast computed them in);
    no parameters, so the stage's parameter names stay its units'."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)
