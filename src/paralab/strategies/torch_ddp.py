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
``DDP.no_sync()``.

``--compress`` uses PyTorch's own ``ddp_comm_hooks``: fp16 and bf16 through
``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` around the hook above
(PyTorch casts the bucket, our hook divides and all-reduces it through
``comm.py``: the same as its ``fp16_compress_hook``, with the bytes
counted; PyTorch refuses its bf16 hook and wrapper on anything but
NCCL/XCCL, by the hook's name, so bf16 uses :func:`bf16_mean_hook`, ours,
which casts, divides and all-reduces the same way); PowerSGD through
``powerSGD_hook`` with a ``PowerSGDState``
(rank ``--powersgd-rank``, ``start_powerSGD_iter = --powersgd-start-iter``,
error feedback and warm start on; on gloo one bucket at a time, see
:func:`one_bucket_at_a_time`). PowerSGD's all-reduces are PyTorch's
own calls, so they are not in this run's ``comm`` spans (its bytes are
not counted, and each rank's details say so: ``kinds.UNCOUNTED_COMM``);
our ``ddp --compress powersgd`` records them.

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

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from ..kinds import UNCOUNTED_COMM
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
        register_hook(self.ddp, self, ctx.options)
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
        if self.compress != "powersgd":
            return {}
        return {UNCOUNTED_COMM: "PyTorch's powerSGD_hook all-reduces the gradients itself (its uncompressed "
                                "steps, P and Q), outside comm.py: those bytes are not in the records"}


def bf16_mean_hook(replicas, bucket):
    """DDP communication hook for ``--compress bf16``: the bucket cast to bfloat16, divided by N,
    all-reduced through comm.py, cast back into the bucket (what PyTorch's ``bf16_compress_hook`` does;
    PyTorch allows that one only on NCCL/XCCL)."""
    buffer = bucket.buffer()
    narrow = buffer.to(torch.bfloat16).div_(replicas.comm.world)
    pending = replicas.comm.all_reduce(narrow, name=f"torch_ddp_bucket{bucket.index()}_bf16", async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer
    return pending.work.get_future().then(decompress)


def one_bucket_at_a_time(hook):
    """``hook``, returning only once its bucket's exchange is complete (used on gloo).

    PyTorch's PowerSGD hook launches a bucket's second and third all-reduce (P, then Q) from
    callbacks of the one before, which gloo runs when that one completes: with several buckets
    in flight the ranks then launch their collectives in different orders, which gloo (matching
    them by order) fails on ("Received data size doesn't match expected size") or waits on for
    ever. DDP hands the buckets over in the same order on every rank, so finishing one before
    taking the next keeps the order; PowerSGD's communication then no longer overlaps backward.
    """
    def hook_in_order(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return hook_in_order


def register_hook(ddp, replicas, options) -> None:
    """The communication hook ``--compress`` names: PyTorch's own, around ours where it can be."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if options.compress == "fp16":
        ddp.register_comm_hook(replicas, default_hooks.fp16_compress_wrapper(allreduce_mean_hook))
    elif options.compress == "bf16":
        ddp.register_comm_hook(replicas, bf16_mean_hook)
    elif options.compress == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=replicas.comm.group,
                                            matrix_approximation_rank=options.powersgd_rank,
                                            start_powerSGD_iter=options.powersgd_start_iter,
                                            use_error_feedback=True, warm_start=True)
        hook = powerSGD_hook.powerSGD_hook
        if torch.distributed.get_backend(replicas.comm.group) == "gloo":
            hook = one_bucket_at_a_time(hook)
        ddp.register_comm_hook(state, hook)
    else:
        ddp.register_comm_hook(replicas, allreduce_mean_hook)


class TorchDDP(DataParallel):
    name = "torch-ddp"
    replicas_cls = TorchDDPReplicas
    options = (AccumulateOptions, BucketOptions, CompressOptions)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        super().validate(cfg, world)
        if cfg.compress == "powersgd" and cfg.powersgd_start_iter < 2:
            raise UsageError("torch-ddp --compress powersgd: PyTorch's PowerSGD hook needs "
                             "--powersgd-start-iter of at least 2 (DDP rebuilds its buckets after the first step)")
        if cfg.compress != "none" and cfg.check:
            raise UsageError(f"torch-ddp --compress {cfg.compress} --check: compression changes the arithmetic and "
                             "the reference replays only our ddp's (PyTorch's hooks divide after casting, and its "
                             "PowerSGD differs in detail): check `paralab train ddp --compress "
                             f"{cfg.compress} --check`, or drop --check")
