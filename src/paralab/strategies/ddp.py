"""``ddp``: our own DistributedDataParallel, with gradient buckets that overlap backward.

What happens, in order:

1. **Same start.** Rank 0 broadcasts its parameters and buffers, so every
   replica begins identical (each rank seeds the same way anyway; the
   broadcast makes it a guarantee rather than a coincidence).
2. **Buckets.** Parameters are grouped into buckets of about ``--bucket-mb``
   MiB, taken in *reverse registration order*: backward produces the last
   layer's gradients first, so the first bucket fills first. A bucket is
   closed as soon as it holds at least that size, the first one already at
   1 MiB so the first all-reduce starts early (both are PyTorch's rules; for
   VGG-11 they also leave a small last bucket, and the last bucket is the one
   whose communication nothing can hide: it is ready only when backward
   ends). Each bucket owns one flat buffer, and each of its parameters a
   slice of it: one collective per bucket instead of one per parameter, and
   big messages use the network far better than small ones.
3. **Hooks.** Every parameter carries a post-accumulate-grad hook. When
   autograd has written a parameter's gradient, the hook copies it, divided
   by N, into the parameter's slice. When a bucket's last gradient is in, its
   ``all_reduce`` is *launched asynchronously*, and backward carries on with
   the earlier layers while the bytes travel: communication hides under
   computation. Collectives pair up across ranks by the order they are
   issued, so buckets are launched strictly in bucket order on every rank (a
   bucket that is full early waits for its predecessors).
4. **End of backward.** A parameter that got no gradient this step (unused
   in the forward) never fires its hook; its bucket would wait forever, and
   the other ranks with it. So after backward every bucket not yet launched
   is completed with zeros for the missing gradients and launched: every
   rank issues the same collectives and nothing hangs. Then one wait for all
   that is in flight. Each bucket now holds the mean gradient, and each
   parameter's ``.grad`` becomes a view of its slice (no copy back).
5. **Optimizer.** Every rank takes the same step from the same bytes, so the
   replicas stay bit-identical.

``no_sync()`` switches the hooks off: gradients only accumulate locally. With
``--accumulate K`` the first K-1 microbatches run under it and the last
backward sends the accumulated gradients through the buckets: one all-reduce
per bucket per step, whatever K.

BatchNorm buffers follow the rule of every replicated strategy here: rank 0's
are authoritative and broadcast after each step.

Measurement: each bucket's all-reduce is recorded as an in-flight span
(launch to completion) and the wait after backward as an exposed ``wait``
span; :meth:`DDP.extra_summary` reports per step how much communication was
hidden under backward and how much was exposed after it. Exposed time also
holds any wait for a slower peer: the last bucket completes only when every
rank has finished its backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..recorder import union_length
from .base import ReplicatedStrategy, StepResult

MiB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MiB  # PyTorch's first bucket: start communicating as early as possible


@dataclass
class Bucket:
    index: int
    params: list[int]               # indices into DDP.params, in backward order
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


class DDP(ReplicatedStrategy):
    name = "ddp"

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.broadcast_parameters()  # 1. the same start everywhere
        self.bucket_mb = float(ctx.option("bucket_mb", 25.0) or 25.0)

        # 2. buckets over the trainable parameters, last registered first
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad][::-1]
        names, self.params = [n for n, _ in named], [p for _, p in named]
        self.buckets = [make_bucket(index, members, self.params, names) for index, members
                        in enumerate(assign_buckets(self.params, self.bucket_mb * MiB))]
        # per parameter: its bucket and its slice of the bucket's buffer
        self.slot: list[tuple[Bucket, torch.Tensor]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for i, view in zip(bucket.params, bucket.views):
                self.slot[i] = (bucket, view)

        # 3. one hook per parameter
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

        # per-step state
        self._syncing = False      # True only inside the backward that synchronises
        self._sync_enabled = True  # False inside no_sync()
        self._ready = [False] * len(self.params)
        self._next_bucket = 0      # the next bucket to launch (buckets launch in order)
        self._in_flight = []       # Pending all-reduces of this step
        self._backward_end: dict[int, float] = {}  # step -> when backward finished (measurement)

    # ------------------------------------------------------------------ hooks
    def _hook(self, i: int):
        def on_gradient_ready(param: torch.Tensor) -> None:
            if self._syncing and self._sync_enabled:
                self._gradient_ready(i, param)
        return on_gradient_ready

    @torch.no_grad()
    def _gradient_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, view = self.slot[i]
        torch.div(param.grad, self.ctx.world, out=view)  # copy in, already averaged
        self._ready[i] = True
        bucket.missing -= 1
        if bucket.missing == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].missing == 0:
            bucket = self.buckets[self._next_bucket]
            self._in_flight.append(self.comm.all_reduce(bucket.buffer, name=f"ddp_bucket{bucket.index}",
                                                        async_op=True))
            self._next_bucket += 1

    # ------------------------------------------------------------------ the step
    @contextmanager
    def no_sync(self):
        """Gradients accumulate locally; nothing is communicated until the context exits."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _start_sync(self) -> None:
        self._ready = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.missing = len(bucket.params)
        self._next_bucket = 0
        self._in_flight = []
        self._syncing = True

    @torch.no_grad()
    def _finish_sync(self) -> None:
        self._syncing = False
        self._backward_end[self.rec.step] = self.rec.now()
        # 4. buckets still waiting for a gradient that never came: fill with zeros, launch in order
        for bucket in self.buckets[self._next_bucket:]:
            for i, view in zip(bucket.params, bucket.views):
                if not self._ready[i]:
                    view.zero_()
                    self._ready[i] = True
            bucket.missing = 0
        self._launch_ready_buckets()
        for pending in self._in_flight:  # the one wait: whatever is still in flight is exposed time
            pending.wait()
        self._in_flight = []
        for p, (_, view) in zip(self.params, self.slot):
            p.grad = view  # the mean gradient, in place in the bucket

    def train_step(self, x, y) -> StepResult:
        self.model.train()
        self._start_sync()
        try:
            loss = self.forward_backward(self.model, x, y, before_last=self.no_sync)
        except BaseException:
            self._syncing = False
            raise
        self._finish_sync()
        self.optimizer_step(self.optimizer)
        self.broadcast_buffers()
        return StepResult(loss, len(y))

    # ------------------------------------------------------------------ measurement
    def extra_summary(self) -> dict:
        """Bucket layout, and per step the communication hidden under backward vs exposed after it."""
        in_flight: dict[int, list[tuple[float, float]]] = {}
        exposed: dict[int, float] = {}
        for s in self.rec.spans:
            if s.category != "comm" or s.step not in self._backward_end:
                continue
            if s.args.get("async") and s.name.startswith("ddp_bucket"):
                in_flight.setdefault(s.step, []).append((s.t0, s.t1))
            elif s.name.startswith("wait:ddp_bucket"):
                exposed[s.step] = exposed.get(s.step, 0.0) + s.seconds
        steps = []
        for step, end in sorted(self._backward_end.items()):
            spans = in_flight.get(step, [])
            steps.append({"step": step,
                          "comm_in_flight_s": union_length(spans),
                          "hidden_s": union_length([(a, min(b, end)) for a, b in spans if a < end]),
                          "exposed_s": exposed.get(step, 0.0)})
        warmup = int(self.ctx.option("warmup", 1) or 0)  # as summary.json: the first steps are warm-up
        measured = [s for s in steps if s["step"] >= steps[0]["step"] + warmup] if steps else []
        measured = measured or steps
        mean = {k: sum(s[k] for s in measured) / len(measured) if measured else None
                for k in ("comm_in_flight_s", "hidden_s", "exposed_s")}
        total = (mean["hidden_s"] or 0.0) + (mean["exposed_s"] or 0.0)
        return {
            "bucket_mb": self.bucket_mb,
            "buckets": [{"index": b.index, "MiB": round(b.nbytes / MiB, 3), "tensors": len(b.params),
                         "first": b.names[0], "last": b.names[-1]} for b in self.buckets],
            "overlap": {"note": "per-step means over the steps after warm-up; hidden: in flight before "
                                "backward ended; exposed: waited for after it (a slower peer included)",
                        **{f"mean_{k}": v for k, v in mean.items()},
                        "hidden_fraction": (mean["hidden_s"] / total) if total else None,
                        "steps": steps},
        }
