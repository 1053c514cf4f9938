"""Learning-rate schedule for large batches (Goyal et al., 2017).

- ``--lr-scaling linear``: the target rate is ``lr * global_batch / 256``
  (the linear scaling rule, with 256 as the reference batch).
- ``--warmup-epochs E``: ramp linearly from ``lr`` to the target over the
  first E epochs (gradual warm-up), then hold it.
With neither option the rate is ``lr`` throughout.
"""
from __future__ import annotations

REFERENCE_BATCH = 256


def target_lr(lr: float, scaling: str, global_batch: int) -> float:
    return lr * global_batch / REFERENCE_BATCH if scaling == "linear" else lr


def lr_at(step: int, *, lr: float, scaling: str, global_batch: int, warmup_epochs: float,
          steps_per_epoch: int) -> float:
    target = target_lr(lr, scaling, global_batch)
    warmup_steps = warmup_epochs * steps_per_epoch
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return lr + (target - lr) * step / warmup_steps


def set_lr(optimizers, value: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = value
