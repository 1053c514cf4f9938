"""``model``: naive model parallelism (CS1390 Part 2): a pipeline fed one microbatch.

The model's flat unit list is cut into ``W`` contiguous stages
(``--partition``, see :mod:`paralab.strategies.pipeline.partition`); rank ``k`` holds stage ``k``
only. One training step is the pipeline executor's with a single microbatch:

1. forward: stage 0 runs its units on the batch and sends the activation to
   stage 1; every later stage waits for the activation of the stage before
   it (its shape is known ahead from the partition), runs its units and sends
   on; the last stage computes the loss;
2. backward, in reverse: the last stage starts from the loss, every other
   stage waits for the gradient of its output; each stage runs one backward
   call through its units (one autograd graph per stage), accumulating the
   parameter gradients, and sends the gradient of its input to the stage
   before;
3. each stage steps its own optimizer on its own parameters.

Only one stage computes at a time; the others wait (``idle`` spans): that
waiting is the bubble, ``(W - 1) / W`` with equal stages, which ``pipeline``
shrinks with microbatches. Every rank is handed the whole global batch;
stages after the first ignore the images, the last uses the labels.
BatchNorm running statistics need no synchronisation: each BN layer lives on
exactly one stage and sees the batch once, as in one process.
"""
from __future__ import annotations

from ..errors import UsageError
from .pipeline import Pipeline
from .pipeline.strategy import PartitionOptions


class ModelParallel(Pipeline):
    name = "model"
    options = (PartitionOptions,)

    def planned_microbatches(self) -> int:
        return 1

    def planned_schedule(self) -> str:
        return "gpipe"  # with one microbatch every schedule is the same: forward through, back through

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        if cfg.microbatches != 1:
            raise UsageError("strategy 'model' runs each batch whole; for microbatches use "
                             f"'pipeline --microbatches {cfg.microbatches}'")
        super().validate(cfg, world)

    def extra_summary(self) -> dict:
        return super().extra_summary() | {"schedule": "naive"}  # one microbatch: no schedule to speak of
