"""The learning rate of each step.

``--lr-schedule constant`` (the default), the large-batch recipe of Goyal et al. (2017):

- ``--lr-scaling linear``: the target rate is ``lr * global_batch / 256``
  (the linear scaling rule, with 256 as the reference batch).
- ``--warmup-epochs E``: ramp linearly from ``lr`` to the target over the
  first E epochs (gradual warm-up), then hold it.
With neither option the rate is ``lr`` throughout.

``--lr-schedule cosine``, the language-model recipe (nanoGPT, torchtitan,
Megatron): a linear warm-up from 0 over the first W = E x steps-per-epoch
steps (step s at ``target * min(1, (s + 1) / W)``), then half a cosine from the
target down to ``--min-lr``::

    lr(s) = min_lr + (target - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2

for the run's T steps: the first step after warm-up is at the target, the
last just above the floor (the step after it would be at the floor). The
rate of a step depends on T, so a cosine run resumes only to finish the
steps it was started with (``run/checkpoint.py`` keeps the schedule in a
checkpoint's identity).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

REFERENCE_BATCH = 256


def target_lr(lr: float, scaling: str, global_batch: int) -> float:
    return lr * global_batch / REFERENCE_BATCH if scaling == "linear" else lr


def lr_at(step: int, *, lr: float, scaling: str, global_batch: int, warmup_epochs: float,
          steps_per_epoch: int, schedule: str = "constant", min_lr: float = 0.0, total_steps: int = 0) -> float:
    target = target_lr(lr, scaling, global_batch)
    warmup_steps = warmup_epochs * steps_per_epoch
    if schedule == "cosine":
        if step < warmup_steps:
            return target * min(1.0, (step + 1) / warmup_steps)  # a fractional W: its last step at most the target
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return min_lr + (target - min_lr) * (1 + math.cos(math.pi * progress)) / 2
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return lr + (target - lr) * step / warmup_steps


@dataclass(frozen=True)
class LRSchedule:
    """A run's schedule, as its options and data fix it: ``schedule(step)`` is step ``step``'s rate
    (:func:`lr_at`). The fields are what ``check/reference.py`` rebuilds the same schedule from with torch's
    own schedulers, so the reference shares none of this code with the run."""
    lr: float
    scaling: str
    global_batch: int
    warmup_epochs: float
    steps_per_epoch: int
    kind: str = "constant"      # --lr-schedule
    min_lr: float = 0.0
    total_steps: int = 0

    @property
    def warmup_steps(self) -> float:
        return self.warmup_epochs * self.steps_per_epoch

    def __call__(self, step: int) -> float:
        return lr_at(step, lr=self.lr, scaling=self.scaling, global_batch=self.global_batch,
                     warmup_epochs=self.warmup_epochs, steps_per_epoch=self.steps_per_epoch, schedule=self.kind,
                     min_lr=self.min_lr, total_steps=self.total_steps)


def set_lr(optimizers, value: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = value
