"""``pipeline``: model parallelism fed ``M`` microbatches (CS1390 Part 4).

The stages are those of ``model`` (same partition, same per-unit backward
with ``torch.autograd.grad``); the batch is cut into ``--microbatches M``
equal microbatches and a schedule (``--schedule``) orders, on every stage,
the forwards, backwards, sends and receives of all of them:

- ``gpipe``: all forwards, then all backwards; every stage holds the
  activations of all ``M`` microbatches at once;
- ``1f1b``: after ``W - 1 - k`` warm-up forwards, stage ``k`` alternates one
  forward and one backward, so at most ``W - k`` microbatches are alive.
  ``M < W`` is handled (the warm-up shrinks to ``M``), not refused.

Both have the bubble ``(W - 1) / (M + W - 1)`` with equal stage times.
Schedules are data (``schedules.py``); one executor runs them
(``executor.py``). Each microbatch's loss is weighted by its share of the
batch (``1/M``), so the accumulated gradients are those of the batch's mean
loss; ``M`` must divide the batch. BatchNorm layers see the microbatches one
after another, and the ``--check`` reference replays exactly that.
"""
from __future__ import annotations

import torch

from ...errors import UsageError
from ..base import StepResult, split_microbatches
from ..model_parallel import StagedStrategy
from .executor import Executor
from .schedules import SCHEDULES, build_schedule


class Pipeline(StagedStrategy):
    name = "pipeline"

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.schedule = str(ctx.option("schedule", "gpipe"))
        self.actions = build_schedule(self.schedule, ctx.world, self.microbatches)[ctx.rank]
        self.executor = Executor(self.comm, self.rec, ctx.device, ctx.autocast)

    def planned_microbatches(self) -> int:
        return int(self.ctx.option("microbatches", 1) or 1)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        super().validate(cfg, world)
        if cfg.schedule not in SCHEDULES:
            raise UsageError(f"--schedule must be one of {', '.join(SCHEDULES)} (got {cfg.schedule!r})")
        batch = cfg.global_batch(cls)
        if batch % cfg.microbatches:
            raise UsageError(f"--microbatches {cfg.microbatches} does not divide the batch of {batch}; "
                             "pick a divisor so every microbatch has the same size")

    def schedule_name(self) -> str:
        return self.schedule

    def in_flight_bound(self) -> int:
        if self.schedule == "1f1b":
            return min(self.microbatches, self.ctx.world - self.ctx.rank)
        return self.microbatches

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        self.check_input(x)
        self.stage.train()
        chunks = split_microbatches(x, y, self.microbatches)
        actions = self.actions
        if len(chunks) < self.microbatches:
            # an epoch's last batch can hold fewer samples than microbatches: plan the
            # schedule for the chunks there are (every stage sees the same batch size)
            actions = build_schedule(self.schedule, self.ctx.world, len(chunks))[self.ctx.rank]
        loss = self.executor.run(self.stage, actions, chunks)
        self.optimizer_step(self.optimizer)
        return StepResult(loss, len(y))
