"""``pipeline``: model parallelism fed ``M`` microbatches (CS1390 Part 4), alone or under data parallelism.

The model's flat unit list is cut into ``P`` contiguous stages
(``--partition``, see :mod:`paralab.partition`); pipeline rank ``k`` holds
stage ``k`` (a :class:`~.stage.Stage`). Each step the batch is cut into
``--microbatches M`` microbatches and a schedule (``--schedule``) orders, on
every stage, the forwards, backwards, sends and receives of all of them:

- ``gpipe``: all forwards, then all backwards; every stage holds the
  activations of all ``M`` microbatches at once;
- ``1f1b``: after ``P - 1 - k`` warm-up forwards, stage ``k`` alternates one
  forward and one backward, so at most ``P - k`` microbatches are alive.
  ``M < P`` is handled (the warm-up shrinks to ``M``), not refused.

Both have the bubble ``(P - 1) / (M + P - 1)`` with equal stage times.
Schedules are data (``schedules.py``); one executor runs them
(``executor.py``). Each microbatch's loss is weighted by its share of the
batch (``1/M``), so the accumulated gradients are those of the batch's mean
loss; ``M`` must divide the batch.

Composition (the mesh, ``paralab.mesh``): ``paralab train pipeline`` is pure
pipeline parallelism over all the workers. ``paralab train ddp --pp P`` (or
``gather-scatter``, ``allreduce``, ``torch-ddp``, ``fsdp --zero-stage 1``) is
data x pipeline parallelism: ``dp = workers / P`` replicas of the whole
pipeline, each fed its own shard of the global batch. The model is staged
first; then each stage is wrapped in the named data-parallel flavour
(``replicas.py``) over its ``dp`` group, the ranks that hold the same stage.
After the executor has run every microbatch, the flavour makes the stage's
gradients the mean over its replicas (once per step: only the last
microbatch's backward may launch communication), steps the optimizer and
broadcasts dp rank 0's BatchNorm statistics.

BatchNorm: each BN layer lives on one stage and sees a replica's
microbatches one after another, as one process would (``bn_rule =
"sequential"``); with ``dp > 1`` the first replica's statistics win
(``first-replica``), which the ``--check`` reference replays.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ...errors import UsageError
from ...kinds import StageRecord
from ...mesh import MeshShape
from ...options import option
from ...partition import (boundary_shapes, measure_unit_times, parse_spec, partition_model, sample_batch,
                          split_costs, unit_label)
from ..base import StepResult, Strategy, split_microbatches
from ..replicas import Replicas
from .executor import Executor
from .schedules import SCHEDULES, build_schedule
from .stage import Stage


@dataclass
class PartitionOptions:
    """model parallelism: where the model is cut into stages"""
    partition: str = option("balanced", "model/pipeline (or --pp): how the units are cut into stages: balanced "
                                        "(measured time) | params | counts such as 2,3,8", identity=True)


@dataclass
class PipelineOptions(PartitionOptions):
    """pipelines (pipeline, model, or --pp): stages, microbatches, schedule"""
    microbatches: int = option(1, "pipeline (or --pp): microbatches per step", minimum=1, identity=True)
    schedule: str = option("gpipe", "pipeline (or --pp): the order of forwards and backwards",
                           choices=SCHEDULES)


class Pipeline(Strategy):
    name = "pipeline"
    options = (PipelineOptions,)
    #: the pure form hands every rank the whole global batch; composed, each dp replica its shard
    data_parallel = False

    def __init__(self, ctx, model_fn, optim_fn, replicas_cls: type[Replicas] = Replicas):
        super().__init__(ctx, model_fn, optim_fn)
        self.pp, self.dp_comm = ctx.mesh.comm("pp"), ctx.mesh.comm("dp")
        self.dp_size = self.dp_comm.world
        self.replicated = self.dp_size > 1  # a stage's replicas must stay identical
        self.bn_rule = "first-replica" if self.dp_size > 1 else "sequential"
        self.microbatches = self.planned_microbatches()
        self.schedule = self.planned_schedule()
        self._model_fn, self._optim_fn, self._replicas_cls = model_fn, optim_fn, replicas_cls
        model = model_fn()
        self.unit_labels = [unit_label(u) for u in model]
        self.unit_shapes = boundary_shapes(model)  # per-sample shape entering each unit, then the output
        self.partition_method = ctx.options.partition
        self.ranges, self.unit_times = self._agree_on_partition(model)
        self._build_stage(model)
        self.executor = Executor(self.pp, self.rec, ctx.device, ctx.autocast, ctx.dtype)

    # ------------------------------------------------------------ declarations
    def planned_microbatches(self) -> int:
        return self.ctx.options.microbatches

    def planned_schedule(self) -> str:
        return self.ctx.options.schedule

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        if cfg.pp not in (1, world):
            raise UsageError(f"strategy {cls.name!r} is pure pipeline parallelism over all {world} workers; "
                             f"for data x pipeline parallelism name the data-parallel flavour instead, e.g. "
                             f"'paralab train ddp --workers {world} --pp {cfg.pp}'")
        return MeshShape(pp=world)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        """Checks for any pipelined run, pure or under a data-parallel flavour (``--pp``)."""
        from ...models import build_model, model_shape
        stages = cfg.pp if cfg.pp > 1 else world
        if cfg.accumulate != 1:
            raise UsageError(f"--accumulate does not apply to a pipeline, which splits a batch "
                             f"with --microbatches (strategy pipeline, or --pp)")
        units = len(build_model(cfg.model, width=cfg.width, norm=cfg.norm, **model_shape(cfg)))
        parse_spec(cfg.partition, stages, units)
        shard = cfg.global_batch() // (world // stages)
        if shard % cfg.microbatches:
            raise UsageError(f"--microbatches {cfg.microbatches} does not divide the batch of {shard}"
                             f"{' per data-parallel replica' if world > stages else ''}; pick a divisor so "
                             "every microbatch has the same size")

    # ------------------------------------------------------------ set-up
    def _agree_on_partition(self, model: nn.Module):
        """Rank 0 cuts the model (timing differs between processes) and every rank takes its cut."""
        ctx, stages = self.ctx, self.pp.world
        answer = None
        if ctx.rank == 0:
            method = parse_spec(self.partition_method, stages, len(model))
            times = None
            if method == "balanced":
                batch = (ctx.batch_size or 32) // self.dp_size // self.microbatches
                sample = sample_batch(max(1, min(batch, 32)), device=ctx.device, model=model, dtype=ctx.dtype)
                times = measure_unit_times(model.to(ctx.device), sample)
                model.cpu()
                ranges = split_costs(times, stages)
            else:
                ranges = partition_model(model, stages, self.partition_method)
            answer = ([tuple(r) for r in ranges], times)
        ranges, times = self.comm.broadcast_object(answer, src=0)  # the whole world takes rank 0's cut
        return [tuple(r) for r in ranges], times

    def _build_stage(self, model: nn.Module) -> None:
        k, stages = self.pp.rank, self.pp.world
        a, b = self.ranges[k]
        self.stage = Stage({i: model[i] for i in range(a, b)}, first=k == 0, last=k == stages - 1,
                           in_shape=self.unit_shapes[a], out_shape=self.unit_shapes[b], ctx=self.ctx)
        self.dp = self._replicas_cls(self.stage.units, self._optim_fn, self.dp_comm, self.ctx)
        self.dp.broadcast_parameters()

    @property
    def optimizer(self):
        return self.dp.optimizer

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

    # ------------------------------------------------------------ the step
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        self.check_input(x)
        self.stage.train()
        chunks = split_microbatches(x, y, self.microbatches)
        # an epoch's last batch can hold fewer samples than microbatches: plan the
        # schedule for the chunks there are (every stage sees the same batch size)
        actions = build_schedule(self.schedule, self.pp.world, len(chunks))[self.pp.rank]
        self.dp.start()
        loss = self.executor.run(self.stage, actions, chunks, last_backward=self.dp.last_backward)
        self.dp.finish()
        self.dp.step()
        self.dp.sync_buffers()
        return StepResult(loss, len(y))

    # ------------------------------------------------------------ the rest of the contract
    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        """Collective over the pipeline: its stages call it with the same batch; the last returns logits."""
        self.check_input(x)
        self.dp.sync_buffers(after_step=False)
        self.stage.train(False)
        k = self.pp.rank
        if self.first:
            h = x
        else:
            h = torch.empty((len(x),) + self.stage.in_shape, device=self.ctx.device, dtype=self.ctx.dtype)
            self.pp.recv(h, k - 1, name="recv_act")
        out = self.stage.infer(h)
        if not self.last:
            self.pp.send(out.to(self.ctx.dtype).contiguous(), k + 1, name="send_act")
            return None
        return out.to(self.ctx.dtype)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gathers every stage's tensors (plain model keys) from its pipeline."""
        self.dp.sync_buffers(after_step=False)
        mine = {k: v.detach().cpu().clone() for k, v in self.stage.state_dict().items()}
        whole: dict[str, torch.Tensor] = {}
        for part in self.pp.all_gather_objects(mine):
            whole.update(part)
        return whole

    def state_dict(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges], "stage": self.stage.state_dict(),
                **self.dp.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        ranges = [tuple(r) for r in state["ranges"]]
        if ranges != self.ranges:  # a balanced cut is re-measured at start: keep the checkpoint's
            self.ranges = ranges
            self._build_stage(self._model_fn())
        self.stage.load_state_dict(state["stage"])
        self.dp.load_state_dict(state)

    @classmethod
    def consolidate(cls, states, model):
        """Offline: the union of the stages' tensors (plain keys), each from the first rank that holds
        its stage, which is its dp replica 0 (the mesh puts dp inside pp). Replicas are identical;
        every flavour keeps the stage's full parameters in ``stage`` (ZeRO-1 too: its shards are
        views of them) and synchronises BatchNorm statistics after every step."""
        tensors: dict = {}
        for state in states:
            for k, v in state["stage"].items():
                tensors.setdefault(k, v)
        return tensors

    # ------------------------------------------------------------ records
    def extra_summary(self) -> dict:
        """What only this stage knows. Its bubble and microbatches alive are derived from the
        spans, beside their theory (``analysis/timeline.py``, ``records.py``)."""
        a, b = self.ranges[self.pp.rank]
        share = None
        if self.unit_times:
            share = sum(self.unit_times[a:b]) / sum(self.unit_times)
        return StageRecord(
            stage=self.pp.rank, stages=self.pp.world, microbatches=self.microbatches, schedule=self.schedule,
            dp_replica=self.dp_comm.rank, units=[a, b], unit_labels=self.unit_labels[a:b],
            stage_parameters=sum(p.numel() for p in self.stage.parameters()), partition=self.partition_method,
            ranges=[list(r) for r in self.ranges], time_share=share, peak_activation_bytes=self.stage.peak_bytes,
            data_parallel={"flavour": self.dp.flavour, "replicas": self.dp_size, **self.dp.summary()},
        ).to_dict()
