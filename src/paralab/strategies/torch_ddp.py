"""``torch-ddp`` (CS744 Task 3): PyTorch's own ``DistributedDataParallel``, the comparison.

The module is wrapped in ``torch.nn.parallel.DistributedDataParallel`` over
the mesh's ``dp`` group with ``bucket_cap_mb = --bucket-mb``; everything else
is PyTorch's default. DDP broadcasts dp rank 0's parameters and buffers when
it is built, buckets the gradients (first bucket ~1 MiB, then
``bucket_cap_mb``, rebuilt after the first step in the order gradients
actually arrived) and all-reduces each bucket from its C++ reducer as soon as
it is ready, overlapping backward; the reducer waits for them inside
backward, so with it the exposed communication is part of the ``backward``
span.

Gradient reduction goes through a communication hook that does what DDP's
built-in one does (divide the bucket by N, all-reduce it) but through
``comm.py``, so each bucket's all-reduce is timed and its bytes counted like
every other strategy's. ``--accumulate K`` runs K-1 microbatches under
``DDP.no_sync()``. ``--compress`` registers instead the hook that
``compression.pytorch_comm_hook`` picks (PyTorch's own, around ours).

Pure data parallelism runs forward through the DDP wrapper, as users do:
its forward arms the reducer (and broadcasts rank 0's buffers). A pipeline
stage (``--pp``) runs its units itself, one microbatch at a time, so the
wrapper's forward is never called; instead, as ``torch.distributed.pipelining``
does, the reducer is armed by hand (``reducer.prepare_for_backward``) just
before the stage's last microbatch backward, and stays disarmed for the
others, whose gradients only accumulate.

BatchNorm buffers: DDP broadcasts rank 0's buffers at the start of every
training forward, so rank 0's are authoritative, as in the other replicated
strategies; but after the last step each rank holds the statistics of its own
last forward. Before the weights are read or used for evaluation they are
therefore broadcast, as DDP's own next forward would.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch.nn.parallel import DistributedDataParallel

from . import compression
from .compression import CompressOptions
from .data_parallel import AccumulateOptions, DataParallel
from .ddp import BucketOptions
from .replicas import Replicas


def allreduce_mean_hook(replicas, bucket):
    """DDP communication hook: the bucket's mean over ranks, all-reduced through comm.py.

    Returns a ``Future[Tensor]`` (DDP checks the annotations; with postponed
    annotations they would be strings, so there are none).
    """
    buffer = bucket.buffer()
    buffer.div_(replicas.comm.world)
    pending = replicas.comm.all_reduce(buffer, name=f"torch_ddp_bucket{bucket.index()}", async_op=True)
    return pending.work.get_future().then(lambda fut: fut.value()[0])


class TorchDDPReplicas(Replicas):
    flavour = "torch-ddp"

    def __init__(self, module, optim_fn, comm, ctx):
        super().__init__(module, optim_fn, comm, ctx)
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=comm.group,
                                           bucket_cap_mb=ctx.options.bucket_mb)
        self.ddp.register_comm_hook(*compression.pytorch_comm_hook(ctx.options, self, allreduce_mean_hook))
        self.compress = ctx.options.compress
        self.forward_arms_reducer = False  # True once the wrapper runs the forward (pure data parallelism)

    def broadcast_parameters(self) -> None:
        pass  # DDP did it when it was built

    def forward_module(self):
        self.forward_arms_reducer = True
        return self.ddp

    def accumulating(self):
        return self.ddp.no_sync()

    @contextmanager
    def last_backward(self):
        if not self.forward_arms_reducer:  # a pipeline stage: arm the reducer for this backward only
            self.ddp.reducer.prepare_for_backward([])
        yield

    def sync_buffers(self, after_step: bool = True) -> None:
        if after_step and self.forward_arms_reducer:
            return  # DDP's next forward broadcasts rank 0's buffers itself
        super().sync_buffers(after_step)

    def summary(self) -> dict:
        return compression.pytorch_hook_details(self.compress)


class TorchDDP(DataParallel):
    name = "torch-ddp"
    replayed = True  # by the check's reference, op for op at 2 shards (Strategy.replayed)
    replicas_cls = TorchDDPReplicas
    options = (AccumulateOptions, BucketOptions, CompressOptions)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        super().validate(cfg, world)
        compression.validate_pytorch_hooks(cfg)
