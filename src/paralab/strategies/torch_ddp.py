"""``torch-ddp`` (CS744 Task 3): PyTorch's own ``DistributedDataParallel``, the comparison.

The model is wrapped in ``torch.nn.parallel.DistributedDataParallel`` with
``bucket_cap_mb = --bucket-mb``; everything else is PyTorch's default. DDP
broadcasts rank 0's parameters and buffers when it is built, buckets the
gradients (first bucket ~1 MiB, then ``bucket_cap_mb``, rebuilt after the
first step in the order gradients actually arrived) and all-reduces each
bucket from its C++ reducer as soon as it is ready, overlapping backward; the
reducer waits for them inside backward, so with it the exposed communication
is part of the ``backward`` span.

Gradient reduction goes through a communication hook that does what DDP's
built-in one does (divide the bucket by N, all-reduce it) but through
``comm.py``, so each bucket's all-reduce is timed and its bytes counted like
every other strategy's. ``--accumulate K`` runs K-1 microbatches under
``DDP.no_sync()``.

BatchNorm buffers: DDP broadcasts rank 0's buffers at the start of every
training forward, so rank 0's are authoritative, as in the other replicated
strategies; but after the last step each rank holds the statistics of its own
last forward. ``full_state_dict()`` and ``predict()`` therefore first
broadcast rank 0's buffers, as DDP's own next forward would, and then use the
wrapped module directly (every rank calls ``predict`` equally often, so the
broadcast pairs up).
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .base import ReplicatedStrategy, StepResult


def allreduce_mean_hook(strategy, bucket):
    """DDP communication hook: the bucket's mean over ranks, all-reduced through comm.py.

    Returns a ``Future[Tensor]`` (DDP checks the annotations; with postponed
    annotations they would be strings, so there are none).
    """
    buffer = bucket.buffer()
    buffer.div_(strategy.ctx.world)
    pending = strategy.comm.all_reduce(buffer, name=f"torch_ddp_bucket{bucket.index()}", async_op=True)
    return pending.work.get_future().then(lambda fut: fut.value()[0])


class TorchDDP(ReplicatedStrategy):
    name = "torch-ddp"

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)  # self.model: the plain module, self.optimizer over it
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids,
                                           bucket_cap_mb=float(ctx.option("bucket_mb", 25.0) or 25.0))
        self.ddp.register_comm_hook(self, allreduce_mean_hook)

    def train_step(self, x, y) -> StepResult:
        self.ddp.train()
        loss = self.forward_backward(self.ddp, x, y, before_last=self.ddp.no_sync)
        self.optimizer_step(self.optimizer)
        return StepResult(loss, len(y))

    # state_dict(), load_state_dict(): the base class's, on self.model (the wrapped module)

    def predict(self, x):
        self.broadcast_buffers()  # what DDP's next forward would do first
        return super().predict(x)

    def full_state_dict(self):
        self.broadcast_buffers()  # rank 0's BatchNorm statistics are the model's
        return super().full_state_dict()
