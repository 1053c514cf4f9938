"""``pipeline``: model parallelism fed ``M`` microbatches (CS1390 Part 4), alone or under data parallelism.

The model's flat unit list is cut into ``P`` contiguous stages
(``--partition``, see :mod:`paralab.strategies.pipeline.partition`); pipeline rank ``k`` holds
stage ``k`` (a :class:`~.stage.Stage`). Each step the batch is cut into
``--microbatches M`` microbatches and a schedule (``--schedule``) orders, on
every stage, the forwards, backwards, sends and receives of all of them:

- ``gpipe``: all forwards, then all backwards;
- ``1f1b``: after ``P - 1 - k`` warm-up forwards (at most ``M``), stage ``k``
  alternates one forward and one backward;
- ``zb-h1``: 1F1B with each backward split into its input-gradient part and
  its weight-gradient part, the latter held back to fill the drain;
- ``zb-h2``: the same split with up to ``2P - 1`` microbatches alive per
  stage, so that no stage waits once it has started;
- ``interleaved-1f1b --virtual-stages V``: the model cut into ``P·V`` stages,
  rank ``k`` holding stages ``k, k+P, ...`` (``M`` a multiple of ``P``).

Schedules are data (``schedules.py``); one executor runs them
(``executor.py``). Each microbatch's loss is weighted by ``1/M`` (``M`` must
divide the batch), so the gradients are those of the batch's mean loss.
Each of a rank's stages has its own data-parallel flavour (``replicas.py``)
over its ``dp`` group (``dp = workers / P``; 1 for ``paralab train
pipeline``), whose ``last_backward()`` wraps the action that completes that
stage's gradients (its last backward, or its last weight-gradient part).
After the executor has run every microbatch, the flavour averages the
stage's gradients over its replicas, steps the optimizer and broadcasts dp
rank 0's BatchNorm statistics (``first-replica``); within a replica each BN
layer sees the microbatches one after another (``sequential``).

Why, with each schedule's bubble and memory: docs/pipelines.md
(composition: docs/strategies.md#composed-data--tensor--pipeline-parallelism-on-a-mesh)
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...errors import UsageError
from ...kinds import StageRecord
from ...training import step as steps
from ...mesh import MeshShape
from ...options import option
from .partition import (boundary_shapes, measure_unit_times, parse_spec, partition_model, ranges_from_counts,
                          sample_batch, trains, unit_label)
from ..base import StepResult, Strategy, moe_record, split_microbatches
from ..data_parallel import flavour_of
from ..portable import Portable, trainable
from ..replicas import Replicas
from .executor import Executor
from .schedules import SCHEDULES, TORCH_ONLY, VIRTUAL, build_schedule, is_own, layout_problem, placement_for
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
    schedule: str = option("gpipe", "pipeline (or --pp), torch-pipeline: the order of forwards and backwards "
                                    "(zbv, dualpipev: torch-pipeline only); or your own, PATH.py[:FUNCTION] "
                                    "(pipeline; docs/own-strategy.md)", choices=SCHEDULES + TORCH_ONLY,
                           also=is_own)
    virtual_stages: int = option(1, "pipeline (or --pp), interleaved-1f1b: stages per rank (rank r holds "
                                    "stages r, r+p, ...; the model is cut into pp x this)", minimum=1, identity=True)


class Pipeline(Strategy):
    name = "pipeline"
    equal_microbatches = True  # validate() refuses a shard its microbatches do not divide
    options = (PipelineOptions,)
    moe = True  # stage.py carries the load-balancing loss on each unit's output
    clips = True
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
        self.virtual = self.planned_virtual_stages()
        self.placement = self.planned_placement()  # stage -> pipeline rank
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

    def planned_virtual_stages(self) -> int:
        return self.ctx.options.virtual_stages if self.schedule in VIRTUAL else 1

    def planned_placement(self) -> tuple[int, ...]:
        return placement_for(self.schedule, self.pp.world, self.virtual)

    @classmethod
    def stages_per_rank(cls, cfg) -> int:
        return cfg.virtual_stages if cfg.schedule in VIRTUAL else 1

    @classmethod
    def schedule_problem(cls, cfg, ranks: int) -> str | None:
        """Why ``cfg``'s schedule cannot run on ``ranks`` pipeline ranks, or None."""
        return layout_problem(cfg.schedule, ranks, cfg.microbatches, cfg.virtual_stages)

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        stages = world // cfg.tp if world % cfg.tp == 0 else 0
        if cfg.pp not in (1, stages) or stages == 0:
            raise UsageError(f"strategy {cls.name!r} is pure pipeline parallelism over all {world} workers"
                             f"{f' (with --tp {cfg.tp}: workers / tp stages)' if cfg.tp > 1 else ''}; for data x "
                             f"pipeline parallelism name the data-parallel flavour instead, e.g. "
                             f"'paralab train ddp --workers {world} --pp {cfg.pp}'")
        return MeshShape(pp=stages, tp=cfg.tp)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        """Checks for any pipelined run, pure or under a data-parallel flavour (``--pp``)."""
        from ...models import build_model, model_shape
        stages = cfg.pp if cfg.pp > 1 else world // cfg.tp
        if cfg.accumulate != 1:
            raise UsageError("--accumulate does not apply to a pipeline, which splits a batch "
                             "with --microbatches (strategy pipeline, or --pp)")
        model = build_model(cfg.model, width=cfg.width, norm=cfg.norm, **model_shape(cfg))
        units = len(model)
        problem = cls.schedule_problem(cfg, stages)
        if problem:
            raise UsageError(problem)
        per_rank = cls.stages_per_rank(cfg)
        if per_rank > 1 and stages * per_rank > units:
            raise UsageError(f"--schedule {cfg.schedule} with {per_rank} stages per rank cuts the model into "
                             f"{stages} x {per_rank} = {stages * per_rank} stages, but it has only {units} units; "
                             "lower --virtual-stages or the stages")
        counts = parse_spec(cfg.partition, stages * per_rank, units)
        trained = trains(model)  # a rank with one stage must have something to train
        if per_rank == 1 and sum(trained) < stages:
            raise UsageError(f"{cfg.model} has {sum(trained)} units with parameters, fewer than the {stages} "
                             "pipeline stages: a rank would have nothing to train; use fewer stages")
        if isinstance(counts, list) and per_rank == 1:
            for k, (a, b) in enumerate(ranges_from_counts(counts)):
                if not any(trained[a:b]):
                    held = ", ".join(unit_label(u) for u in model[a:b])
                    raise UsageError(f"--partition {cfg.partition} leaves stage {k} ({held}) without parameters: "
                                     "its rank would have nothing to train; move a boundary so it holds a layer")
        shard = cfg.global_batch() // (world // (stages * cfg.tp))
        if shard % cfg.microbatches:
            raise UsageError(f"--microbatches {cfg.microbatches} does not divide the batch of {shard}"
                             f"{' per data-parallel replica' if world > stages else ''}; pick a divisor so "
                             "every microbatch has the same size")

    # ------------------------------------------------------------ set-up
    def _agree_on_partition(self, model: nn.Module):
        """Rank 0 cuts the model (timing differs between processes) and every rank takes its cut."""
        ctx, stages = self.ctx, len(self.placement)
        answer = None
        if ctx.rank == 0:
            method = parse_spec(self.partition_method, stages, len(model))
            times = None
            if method == "balanced":
                batch = (ctx.batch_size or 32) // self.dp_size // self.microbatches
                sample = sample_batch(max(1, min(batch, 32)), device=ctx.device, model=model, dtype=ctx.dtype)
                times = measure_unit_times(model.to(ctx.device), sample)
                model.cpu()
            ranges = partition_model(model, stages, self.partition_method, unit_times=times)
            answer = ([tuple(r) for r in ranges], times)
        ranges, times = self.comm.broadcast_object(answer, src=0)  # the whole world takes rank 0's cut
        return [tuple(r) for r in ranges], times

    def _build_stage(self, model: nn.Module) -> None:
        """This rank's stages (one; ``v`` under interleaved-1f1b), each wrapped in the data-parallel
        flavour over the dp group (one flavour object per stage: each stage's gradients are complete,
        and synchronised, at its own last backward)."""
        last = len(self.ranges) - 1
        self.stages, self.flavours = {}, {}
        for s in (s for s, r in enumerate(self.placement) if r == self.pp.rank):
            a, b = self.ranges[s]
            stage = Stage(self.ctx.shard({i: model[i] for i in range(a, b)}), first=s == 0, last=s == last,
                          in_shape=self.ctx.activation_shape(a, self.unit_shapes[a]),
                          out_shape=self.ctx.activation_shape(b, self.unit_shapes[b]), ctx=self.ctx)
            self.stages[s] = stage
            if len(self.placement) > len(set(self.placement)) and not stage.parameters():
                continue  # one of several stages on this rank, with nothing to train (a pooling unit)
            self.flavours[s] = self._replicas_cls(stage.units, self._optim_fn, self.dp_comm, self.ctx)
            self.flavours[s].broadcast_parameters()
        # the rank's first stage and its flavour (its only ones unless several stages per rank)
        self.stage, self.dp = self.stages[min(self.stages)], self.flavours[min(self.flavours)]

    @property
    def optimizer(self):
        return self.dp.optimizer

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return len(self.ranges) - 1 in self.stages

    def check_input(self, x: torch.Tensor) -> None:
        expected = tuple(self.ctx.activation_shape(0, self.unit_shapes[0]))  # under --cp: this rank's tokens
        if tuple(x.shape[1:]) != expected:
            raise RuntimeError(f"{self.name}: inputs of shape {tuple(x.shape[1:])} per sample, but the stage "
                               f"boundaries were sized for {expected}")

    # ------------------------------------------------------------ the step
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        self.check_input(x)
        for stage in self.stages.values():
            stage.train()
        chunks = split_microbatches(x, y, self.microbatches)
        steps.split([len(c[1]) for c in chunks])  # where each microbatch's rows sit (dropout, documents)
        # an epoch's last batch can hold fewer samples than microbatches: plan the
        # schedule for the chunks there are (every stage sees the same batch size)
        actions = build_schedule(self.schedule, self.pp.world, len(chunks), self.virtual)[self.pp.rank]
        self.flavours_do("start")
        loss = self.executor.run(self.stages, actions, chunks,
                                 last_backward=lambda s: self.flavours[s].last_backward() if s in self.flavours
                                 else nullcontext())
        self.flavours_do("finish")
        self.clip_gradients()  # over every stage: one all-reduce over the whole world
        self.flavours_do("step", "sync_buffers")
        # the loss recorded is the cross-entropy; a mixture of experts' aux loss is in the gradients (stage.py)
        return StepResult(loss, len(y), moe=moe_record(nn.ModuleList(st.units for st in self.stages.values())))

    def held_gradients(self):
        """Every stage of this rank's: each stage's parameters are held by its dp replicas only."""
        return [held for s in sorted(self.flavours)
                for held in self.flavours[s].held_gradients(
                    self.plain_keys(dict(zip(self.stages[s].indices, self.stages[s].units))), self.copies)]

    def flavours_do(self, *phases: str) -> None:
        """Each phase of the flavour contract (``replicas.py``) on every stage's flavour, in stage order,
        one phase for all of them before the next."""
        for phase in phases:
            for s in sorted(self.flavours):
                getattr(self.flavours[s], phase)()

    # ------------------------------------------------------------ the rest of the contract
    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        """Collective over the pipeline: its ranks call it with the same batch; the last stage's
        rank returns logits. Every rank walks the stages in order, so each blocking send meets
        the receive of the rank holding the next stage."""
        self.check_input(x)
        for s in sorted(self.stages):
            if s in self.flavours:
                self.flavours[s].sync_buffers(after_step=False)
            self.stages[s].train(False)
        h, last = x, len(self.ranges) - 1
        for s in sorted(self.stages):
            stage = self.stages[s]
            if s > 0 and self.placement[s - 1] != self.pp.rank:
                h = torch.empty((len(x),) + stage.in_shape, device=self.ctx.device, dtype=self.ctx.dtype)
                self.pp.recv(h, self.placement[s - 1], name="recv_act")
            h = stage.infer(h).to(self.ctx.dtype)
            if s < last and self.placement[s + 1] != self.pp.rank:
                self.pp.send(h.contiguous(), self.placement[s + 1], name="send_act")
        return h if self.last else None

    def _stage_tensors(self) -> dict[str, torch.Tensor]:
        """Every stage of this rank's tensors under the plain model's keys."""
        out: dict[str, torch.Tensor] = {}
        for s in sorted(self.stages):
            out.update(self.stages[s].state_dict())
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gathers every stage's tensors (plain model keys) from its pipeline."""
        for s in sorted(self.flavours):
            self.flavours[s].sync_buffers(after_step=False)
        mine = {k: v.detach().cpu().clone() for k, v in self._stage_tensors().items()}
        if self.ctx.mesh.shape.ep > 1:  # --ep: each rank of a stage's ep group holds some of its experts
            mine = {k: v for part in self.ctx.mesh.comm("ep").all_gather_objects(mine) for k, v in part.items()}
        whole: dict[str, torch.Tensor] = {}
        for part in self.pp.all_gather_objects(mine):
            whole.update(part)
        return whole

    def state_dict(self) -> dict:
        state = {"ranges": [list(r) for r in self.ranges], "stage": self._stage_tensors()}
        if len(self.stages) == 1:
            return state | self.dp.state_dict()
        return state | {"flavours": [self.flavours[s].state_dict() for s in sorted(self.flavours)]}

    def load_state_dict(self, state: dict) -> None:
        ranges = [tuple(r) for r in state["ranges"]]
        if ranges != self.ranges:  # a balanced cut is re-measured at start: keep the checkpoint's
            self.ranges = ranges
            self._build_stage(self._model_fn())
        for s in sorted(self.stages):
            self.stages[s].load_state_dict(state["stage"])
        if len(self.stages) == 1:
            self.dp.load_state_dict(state)
        else:
            for s, flavour_state in zip(sorted(self.flavours), state["flavours"]):
                self.flavours[s].load_state_dict(flavour_state)

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

    @classmethod
    def portable(cls, states, model):
        """Offline: the tensors as :meth:`consolidate`; the optimizer state stage by stage, from the
        flavour states of the stage's dp replicas in dp order (the ranks whose files hold the same
        units, in rank order: the mesh puts dp inside pp; under --ep each holds some of their experts).
        A rank's stages are those whose units' keys its file holds; with several, its flavours are
        those of its stages with parameters, in stage order."""
        tensors = cls.consolidate(states, model)
        ranges = [tuple(r) for r in states[0]["ranges"]]
        replicas: dict[tuple, list[dict]] = {}
        for state in states:
            replicas.setdefault(tuple(sorted({int(k.split(".", 1)[0]) for k in state["stage"]})), []).append(state)
        optimizer: dict[str, dict] = {}
        for units_held, group in replicas.items():
            units_of = {s: {i: model[i] for i in range(a, b)} for s, (a, b) in enumerate(ranges)}
            held = [s for s, units in units_of.items() if trainable(units) and any(i in units_held for i in units)]
            for k, s in enumerate(held):
                flavour_states = [g if "flavours" not in g else g["flavours"][k] for g in group]
                optimizer |= flavour_of(flavour_states[0]).optimizer_portable(flavour_states, units_of[s])
        return Portable(tensors, optimizer)

    def load_portable(self, portable):
        """Each of this rank's stages' tensors and its flavour's part of their optimizer state."""
        state = {"ranges": [list(r) for r in self.ranges],
                 "stage": {k: portable.tensors[k] for st in self.stages.values() for k in st.state_dict()}}
        flavours = [self.flavours[s].state_from_portable(portable, dict(zip(self.stages[s].indices,
                                                                            self.stages[s].units)))
                    for s in sorted(self.flavours)]
        self.load_state_dict(state | (flavours[0] if len(self.stages) == 1 else {"flavours": flavours}))

    # ------------------------------------------------------------ records
    def unexercised(self) -> list[str]:
        notes = [n for s in sorted(self.flavours) for n in self.flavours[s].unexercised()]
        return list(dict.fromkeys(notes))

    def extra_summary(self) -> dict:
        """What only this stage knows. Its bubble and microbatches alive are derived from the
        spans, beside their theory (``analysis/timeline.py``, ``run/records.py``). Under
        interleaved-1f1b ``units`` is the rank's first stage's; ``held_stages`` and
        ``held_units`` list all of them."""
        held = sorted(self.stages)
        a, b = self.ranges[held[0]]
        share = None
        if self.unit_times:
            share = sum(sum(self.unit_times[i:j]) for i, j in (self.ranges[s] for s in held)) / sum(self.unit_times)
        record = StageRecord(
            stage=self.pp.rank, stages=self.pp.world, microbatches=self.microbatches, schedule=self.schedule,
            dp_replica=self.dp_comm.rank, units=[a, b], unit_labels=[l for s in held for l in
                                                                     self.unit_labels[slice(*self.ranges[s])]],
            stage_parameters=sum(p.numel() for st in self.stages.values() for p in st.parameters()),
            partition=self.partition_method, ranges=[list(r) for r in self.ranges], time_share=share,
            peak_activation_bytes=sum(st.peak_bytes for st in self.stages.values()),
            data_parallel={"flavour": self.dp.flavour, "replicas": self.dp_size, **self.dp.summary()},
        ).to_dict()
        if self.virtual > 1:
            record |= {"virtual_stages": self.virtual, "held_stages": held,
                       "held_units": [list(self.ranges[s]) for s in held]}
        return record
