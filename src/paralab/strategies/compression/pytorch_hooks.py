"""torch-ddp: PyTorch's own ``ddp_comm_hooks`` for ``--compress``, around torch-ddp's timed mean hook.
"""
from __future__ import annotations

import torch

from ...kinds import UNCOUNTED_COMM


def pytorch_comm_hook(options, replicas, mean_hook):
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``: the hook ``--compress``
    names, PyTorch's own ``ddp_comm_hooks`` around torch-ddp's ``mean_hook`` where it can be.

    - none: ``mean_hook`` (divides the bucket by N, all-reduces it through ``comm.py``);
    - fp16: ``fp16_compress_wrapper(mean_hook)``: PyTorch casts the bucket, ``mean_hook``
      divides and all-reduces it (the same as its ``fp16_compress_hook``, with the bytes counted);
    - bf16: :func:`bf16_mean_hook`, ours, which casts, divides and all-reduces the same way
      (PyTorch refuses its bf16 hook and wrapper on anything but NCCL/XCCL, by the hook's name);
    - powersgd: ``powerSGD_hook`` with a ``PowerSGDState`` (rank ``--powersgd-rank``,
      ``start_powerSGD_iter = --powersgd-start-iter``, error feedback and warm start on; on gloo
      one bucket at a time, see :func:`one_bucket_at_a_time`). Its all-reduces are PyTorch's own
      calls, outside ``comm.py``: not in the run's spans, its bytes not counted
      (:func:`pytorch_hook_details` says so); our ``ddp --compress powersgd`` records them.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if options.compress == "fp16":
        return replicas, default_hooks.fp16_compress_wrapper(mean_hook)
    if options.compress == "bf16":
        return replicas, bf16_mean_hook
    if options.compress == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=replicas.comm.group,
                                            matrix_approximation_rank=options.powersgd_rank,
                                            start_powerSGD_iter=options.powersgd_start_iter,
                                            use_error_feedback=True, warm_start=True)
        hook = powerSGD_hook.powerSGD_hook
        if torch.distributed.get_backend(replicas.comm.group) == "gloo":
            hook = one_bucket_at_a_time(hook)
        return state, hook
    return replicas, mean_hook


def pytorch_hook_details(method: str) -> dict:
    """What torch-ddp's per-rank details say of the hook for ``--compress method``: where its bytes
    go unrecorded."""
    if method != "powersgd":
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
