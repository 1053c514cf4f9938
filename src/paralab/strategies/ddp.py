"""``ddp``: our own DistributedDataParallel, with gradient buckets that overlap backward.

What happens, in order:

1. **Same start.** Rank 0 broadcasts its parameters and buffers, so every
   replica begins identical.
2. **Buckets.** Parameters are grouped into buckets of about ``--bucket-mb``
   MiB, taken in *reverse registration order* (backward produces the last
   layer's gradients first, so the first bucket fills first); a bucket is
   closed once it holds at least that size, the first one already at 1 MiB.
   Each bucket owns one flat buffer, and each of its parameters a slice of
   it: one collective per bucket instead of one per parameter.
3. **Hooks.** Every parameter carries a post-accumulate-grad hook that
   copies its gradient, divided by N, into its slice. When a bucket's last
   gradient is in, its ``all_reduce`` is *launched asynchronously* and
   backward carries on with the earlier layers while the bytes travel.
   Buckets are launched strictly in bucket order on every rank.
4. **End of backward.** Every bucket not yet launched (a parameter unused in
   the forward fires no hook) is completed with zeros for the missing
   gradients and launched; then one wait for all that is in flight. Each
   parameter's ``.grad`` becomes a view of its slice of the mean gradient.
5. **Optimizer.** Every rank takes the same step from the same bytes.

The hooks act only inside ``last_backward()``; before it gradients only
accumulate locally (PyTorch's ``no_sync``), so with ``--accumulate K``, and
per stage under ``--pp`` (``pipeline/executor.py``), the last microbatch
backward sends the accumulated gradients. BatchNorm buffers: rank 0's,
broadcast after each step. Each bucket's all-reduce is recorded as an
in-flight span, the wait after backward as an exposed ``wait`` span.

Why each rule, and how it compares with PyTorch's: docs/strategies.md#ddp-buckets-hooks-and-overlap
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..kinds import BUCKETS
from ..options import option
from . import compression
from .compression import CompressOptions
from .data_parallel import AccumulateOptions, DataParallel
from .replicas import Replicas

MiB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MiB  # PyTorch's first bucket: start communicating as early as possible


@dataclass
class BucketOptions:
    """ddp and torch-ddp: gradient buckets"""
    bucket_mb: float = option(25.0, "ddp and torch-ddp: gradient bucket size in MiB", minimum=0, above=True)


@dataclass
class Bucket:
    index: int
    params: list[int]               # indices into DDPReplicas.params, in backward order
    buffer: torch.Tensor            # flat: every parameter's gradient, one after the other
    views: list[torch.Tensor]       # per parameter, its slice of buffer, shaped like the parameter
    missing: int = 0                # gradients not yet copied in this step
    names: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def assign_buckets(tensors: list[torch.Tensor], cap_bytes: float,
                   first_cap_bytes: float = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group tensors (given in backward order) into buckets of about ``cap_bytes``.

    A bucket is closed once it holds at least its cap (PyTorch's rule), or where
    the dtype changes (one flat buffer holds one dtype). The first bucket's cap
    is ``min(first_cap_bytes, cap_bytes)``.
    """
    buckets, current, filled = [], [], 0
    for i, t in enumerate(tensors):
        if current and t.dtype != tensors[current[-1]].dtype:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += t.numel() * t.element_size()
        if filled >= (cap_bytes if buckets else min(first_cap_bytes, cap_bytes)):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def make_bucket(index: int, members: list[int], params: list[torch.Tensor], names: list[str]) -> Bucket:
    """One flat buffer for the bucket's gradients, and each parameter's slice of it."""
    buffer = torch.zeros(sum(params[i].numel() for i in members), dtype=params[members[0]].dtype,
                         device=params[members[0]].device)
    views, offset = [], 0
    for i in members:
        n = params[i].numel()
        views.append(buffer[offset:offset + n].view_as(params[i]))
        offset += n
    return Bucket(index, members, buffer, views, names=[names[i] for i in members])


class DDPReplicas(Replicas):
    flavour = "ddp"
    gradient_copy = True  # its buckets hold a flat copy of the gradients between steps (the memory model counts it)

    def __init__(self, module, optim_fn, comm, ctx):
        super().__init__(module, optim_fn, comm, ctx)
        self.bucket_mb = ctx.options.bucket_mb

        # 2. buckets over the trainable parameters, last registered first
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
        names, self.params = [n for n, _ in named], [p for _, p in named]
        self.buckets = [make_bucket(index, members, self.params, names) for index, members
                        in enumerate(assign_buckets(self.params, self.bucket_mb * MiB))]
        # per parameter: its bucket and its slice of the bucket's buffer
        self.slot: list[tuple[Bucket, torch.Tensor]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for i, view in zip(bucket.params, bucket.views):
                self.slot[i] = (bucket, view)

        # what a bucket sends: itself, or a compressed form of it (--compress, compression/buckets.py)
        self.compressor = compression.make_compressor(
            ctx.options, comm.world, scale=(lambda: ctx.loss_scale.scale) if ctx.loss_scale is not None else None)
        self._carried = None  # what the compressor carried when the step began, where a step may be skipped

        # 3. one hook per parameter
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

        # per-step state
        self._syncing = False      # True only inside the backward that synchronises (last_backward)
        self._ready = [False] * len(self.params)
        self._next_bucket = 0      # the next bucket to launch (buckets launch in order)
        self._in_flight = []       # Pending all-reduces of this step

    # ------------------------------------------------------------------ hooks
    def _hook(self, i: int):
        def on_gradient_ready(param: torch.Tensor) -> None:
            if self._syncing:
                self._gradient_ready(i, param)
        return on_gradient_ready

    @torch.no_grad()
    def _gradient_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, view = self.slot[i]
        torch.div(param.grad, self.comm.world, out=view)  # copy in, already averaged
        self._ready[i] = True
        bucket.missing -= 1
        if bucket.missing == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].missing == 0:
            bucket = self.buckets[self._next_bucket]
            self._in_flight.append(self.compressor.launch(self.comm, bucket.index, bucket.buffer, bucket.views,
                                                          f"ddp_bucket{bucket.index}"))
            self._next_bucket += 1

    # ------------------------------------------------------------------ the step
    def start(self) -> None:
        if self.ctx.loss_scale is not None or self.ctx.on_nonfinite:  # a step these skip leaves it as it was
            self._carried = self.compressor.state_dict() or None
        self._ready = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.missing = len(bucket.params)
        self._next_bucket = 0
        self._in_flight = []

    @contextmanager
    def last_backward(self):
        """The hooks copy gradients into buckets and launch them only here: before it (the
        other microbatches, ``no_sync``) gradients just accumulate locally."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    @torch.no_grad()
    def finish(self) -> None:
        # 4. buckets still waiting for a gradient that never came: fill with zeros, launch in order
        for bucket in self.buckets[self._next_bucket:]:
            for i, view in zip(bucket.params, bucket.views):
                if not self._ready[i]:
                    view.zero_()
                    self._ready[i] = True
            bucket.missing = 0
        self._launch_ready_buckets()
        for pending in self._in_flight:  # a second round, where the compressor has one
            pending.proceed()
        for pending in self._in_flight:  # the one wait: whatever is still in flight is exposed time
            pending.complete()
        self._in_flight = []
        self.compressor.end_step()
        for p, (_, view) in zip(self.params, self.slot):
            p.grad = view  # the mean gradient, in place in the bucket

    def step(self) -> None:
        super().step()
        if self.ctx.skipping and self._carried is not None:  # the skipped step's compression undone too
            self.compressor.load_state_dict(self._carried, self.ctx.device)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        carried = self.compressor.state_dict()  # PowerSGD's steps, Q and error feedback; nothing otherwise
        return {**super().state_dict(), **({"compressor": carried} if carried else {})}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "compressor" in state:
            self.compressor.load_state_dict(state["compressor"], self.ctx.device)

    # ------------------------------------------------------------------ records
    def unexercised(self) -> list[str]:
        if len(self.buckets) == 1 and self.comm.world > 1:
            return [f"ddp: every gradient fits one bucket of --bucket-mb {self.bucket_mb:g}, so bucket order and "
                    "the overlap of one bucket's all-reduce with the rest of backward are not exercised: a smaller "
                    "--bucket-mb (e.g. 0.05) makes several"]
        return []

    def summary(self) -> dict:
        """The bucket layout (the overlap it achieved is derived from the spans: analysis/timeline.py)."""
        return {
            "bucket_mb": self.bucket_mb,
            **self.compressor.summary(),
            BUCKETS: [{"index": b.index, "MiB": round(b.nbytes / MiB, 3), "tensors": len(b.params),
                       "first": b.names[0], "last": b.names[-1]} for b in self.buckets],
        }


class DDP(DataParallel):
    name = "ddp"
    replayed = True  # by the check's reference, op for op at 2 shards (Strategy.replayed)
    roles = ("scaling",)
    options = (AccumulateOptions, BucketOptions, CompressOptions)
    replicas_cls = DDPReplicas

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        super().validate(cfg, world)
        compression.validate_buckets(cfg, lambda: cls.mesh_shape(cfg, world).dp)
