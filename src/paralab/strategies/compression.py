"""Gradient compression, ``--compress fp16|bf16|powersgd``: the one module that knows it.

``--compress`` changes what a gradient bucket sends. Every method receives
the bucket after this rank's gradient, divided by N, was copied in (so the
sum over ranks is the mean), sends fewer bytes than the bucket's own, and
leaves the mean's estimate in the bucket.

- **fp16 / bf16**: the bucket is cast to the narrow type, all-reduced in it
  (half the bytes) and cast back; the sum itself runs in the narrow type.
- **powersgd**: low-rank compression with error feedback (:class:`PowerSGD`).

Who asks what:

- ``RunConfig.validate``: :func:`validate` (which strategies take
  ``--compress``: those that declare :class:`CompressOptions`; what cannot
  resume); ``ddp`` and ``torch-ddp``'s own ``validate``:
  :func:`validate_buckets`, :func:`validate_pytorch_hooks`;
- ``ddp`` (from primitives): :func:`make_compressor`, whose ``launch`` sends a
  bucket through ``comm.py`` (which records the bytes that really crossed);
- ``torch-ddp``: :func:`pytorch_comm_hook` (PyTorch's own ``ddp_comm_hooks``)
  and :func:`pytorch_hook_details`;
- ``--check``: :func:`reference_for`, the same arithmetic in one process;
- records and ``paralab compare``: :func:`run_label` (from a run's config
  dict), :func:`parse_variants` and the constants beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..kinds import UNCOUNTED_COMM
from ..options import option

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: methods whose state between steps is not in a checkpoint (PowerSGD's error feedback and Q)
NOT_RESUMABLE = ("powersgd",)
MIN_COMPRESSION_RATE = 2  # PowerSGD: compress a tensor only where it sends at most half its numbers
Q_SEED = 0                # PowerSGD: the initial Q's seed (with the tensor's shape)


@dataclass
class CompressOptions:
    """ddp and torch-ddp: gradient compression"""
    compress: str = option("none", "ddp and torch-ddp: compress what each gradient bucket sends",
                           choices=COMPRESSIONS, identity=True)
    powersgd_rank: int = option(1, "--compress powersgd: rank r of the low-rank approximation", minimum=1,
                                identity=True)
    powersgd_start_iter: int = option(10, "--compress powersgd: steps all-reduced uncompressed before PowerSGD "
                                      "starts (PyTorch's start_powerSGD_iter)", minimum=0, identity=True)


# ---------------------------------------------------------------------------- configuration
def accepts(strategy_cls) -> bool:
    """Whether a strategy compresses its gradients: it declares :class:`CompressOptions`."""
    return CompressOptions in getattr(strategy_cls, "options", ())


def validate(cfg, strategy_cls) -> None:
    """``RunConfig.validate``'s part: ``--compress`` only where ``strategy_cls`` takes it, and
    never with ``--resume`` where the method's state is not in the checkpoint."""
    if cfg.compress == "none":
        return
    if not accepts(strategy_cls):
        raise UsageError(f"--compress {cfg.compress}: only {_accepting_names()} compress their gradient "
                         f"buckets; {cfg.strategy} sends them uncompressed: drop --compress")
    if cfg.resume and cfg.compress in NOT_RESUMABLE:
        raise UsageError("--compress powersgd --resume: PowerSGD's error feedback and warm-start matrices "
                         "are not in the checkpoint, so a resumed run would not continue the same "
                         "arithmetic; start the run again instead")


def _accepting_names() -> str:
    from . import get_strategy, strategy_names
    names = [n for n in strategy_names() if accepts(get_strategy(n))]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def validate_buckets(cfg, dp_replicas) -> None:
    """``ddp``'s part (``dp_replicas()``: its data-parallel replicas): ``--check`` of an fp16/bf16
    sum only where the reference replays its order."""
    if cfg.check and cfg.compress in WIRE_DTYPES and dp_replicas() > 2:
        raise UsageError(f"--compress {cfg.compress} --check: the all-reduce sums {cfg.compress} numbers in "
                         f"{cfg.compress}, in gloo's ring order, which the reference does not replay beyond 2 "
                         "replicas (a sum of two is the same in any order); check with 2 data-parallel "
                         "workers, or drop --check")


def validate_pytorch_hooks(cfg) -> None:
    """``torch-ddp``'s part: what PyTorch's hooks need, and no ``--check`` (not replayed)."""
    if cfg.compress == "powersgd" and cfg.powersgd_start_iter < 2:
        raise UsageError("torch-ddp --compress powersgd: PyTorch's PowerSGD hook needs "
                         "--powersgd-start-iter of at least 2 (DDP rebuilds its buckets after the first step)")
    if cfg.compress != "none" and cfg.check:
        raise UsageError(f"torch-ddp --compress {cfg.compress} --check: compression changes the arithmetic and "
                         "the reference replays only our ddp's (PyTorch's hooks divide after casting, and its "
                         "PowerSGD differs in detail): check `paralab train ddp --compress "
                         f"{cfg.compress} --check`, or drop --check")


# ---------------------------------------------------------------------------- records and compare
def run_label(config: dict) -> str | None:
    """A run's gradient compression from its config (``compress``, ``powersgd_rank``) for labels:
    ``fp16``, ``bf16``, ``powersgd r2``; None where the gradients are sent as they are."""
    method = config.get("compress") if isinstance(config, dict) else None
    if method in (None, "none"):
        return None
    return f"{method} r{config.get('powersgd_rank') or 1}" if method == "powersgd" else method


#: train options a compare variant sets per run (--train-args may not)
VARIANT_FIELDS = ("compress", "powersgd_rank")
VARIANT_SPELLINGS = "none, fp16, bf16, powersgd (rank 1), powersgd-rN (rank N, e.g. powersgd-r4)"
#: compare --compress powersgd: steps all-reduced uncompressed first (the fewest PyTorch's own PowerSGD
#: hook accepts), counted as warm-up so a run's s/iter and bytes are PowerSGD's steps only
POWERSGD_START = 2


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``--compress LIST`` -> [(variant, the RunConfig fields it sets)] in the given order, each variant
    once: ``none`` -> {}, ``fp16`` -> {compress: fp16}, ``powersgd`` and ``powersgd-r1`` -> powersgd-r1
    with {compress: powersgd, powersgd_rank: 1}."""
    out: dict[str, dict] = {}
    for word in (w.strip().lower() for w in str(text).split(",")):
        if not word:
            continue
        method, dash_r, rank = word.partition("-r")
        if method == "powersgd" and (not dash_r or rank.isdigit() and int(rank) >= 1):
            r = int(rank) if dash_r else 1
            out.setdefault(f"powersgd-r{r}", {"compress": "powersgd", "powersgd_rank": r})
        elif word in COMPRESSIONS:
            out.setdefault(word, {"compress": word} if word != "none" else {})
        else:
            raise UsageError(f"--compress: {word!r} is not a compression; use a comma-separated list of "
                             f"{VARIANT_SPELLINGS}")
    if not out:
        raise UsageError(f"--compress needs at least one of {VARIANT_SPELLINGS}")
    return list(out.items())


# ---------------------------------------------------------------------------- shared arithmetic
def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    n = shape[0] if len(shape) else 1
    return n, max(1, int(torch.Size(shape).numel()) // max(n, 1))


def compressible(shape: torch.Size, rank: int) -> bool:
    """PowerSGD sends this tensor as P and Q: it is a matrix and that saves at least half its numbers."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return n * m >= MIN_COMPRESSION_RATE * rank * (n + m)


def initial_q(shape: torch.Size, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The first Q (m x r) of a tensor: the same on every rank and in the reference."""
    n, m = matrix_shape(shape)
    gen = torch.Generator().manual_seed(Q_SEED * 1_000_003 + n * 7919 + m)
    return torch.randn(m, rank, generator=gen, dtype=torch.float64).to(dtype)


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (n x r), in place."""
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(torch.linalg.vector_norm(col).clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p


# ---------------------------------------------------------------------------- ddp's bucket path
class InFlight:
    """One bucket's communication under way: ``proceed()`` after backward launches any second round,
    ``complete()`` waits and leaves the mean (or its estimate) in the bucket."""

    def __init__(self, pendings, then=None):
        self.pendings, self.then = list(pendings), then

    def proceed(self) -> None:
        pass

    def complete(self) -> None:
        for pending in self.pendings:
            pending.wait()
        if self.then is not None:
            self.then()


class NoCompression:
    """What ``ddp`` asks of a compressor: ``launch`` a full bucket (``key``: its index, ``views``: its
    tensors' slices of ``buffer``) and get an :class:`InFlight`; ``end_step()`` after every bucket is
    complete; ``summary()`` for the rank's details. This one sends the bucket as it is."""
    name = "none"

    def launch(self, comm, key: int, buffer: torch.Tensor, views: list[torch.Tensor], label: str) -> InFlight:
        return InFlight([comm.all_reduce(buffer, name=label, async_op=True)])

    def end_step(self) -> None:
        pass

    def summary(self) -> dict:
        return {"compress": self.name}


class CastCompression(NoCompression):
    """fp16 / bf16: all-reduce the bucket in a narrow type."""

    def __init__(self, name: str):
        self.name, self.wire = name, WIRE_DTYPES[name]

    def launch(self, comm, key, buffer, views, label) -> InFlight:
        narrow = buffer.to(self.wire)
        return InFlight([comm.all_reduce(narrow, name=f"{label}_{self.name}", async_op=True)],
                        then=lambda: buffer.copy_(narrow))


class PowerSGD(NoCompression):
    """PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019), rank r.

    Each gradient tensor with a matrix shape (n rows = its first dimension, m
    columns = the rest) worth compressing, ``n*m > 2 r (n+m)`` (PyTorch's
    ``min_compression_rate`` 2), is sent as two thin matrices instead of n*m
    numbers::

        M  = G/N + e                  this rank's share, plus what earlier steps failed to send (error feedback)
        P  = sum over ranks of M Q    all-reduce 1: n x r (with the uncompressed tensors alongside)
        P  = orthonormal columns of P (Gram-Schmidt)
        Q  = sum over ranks of M^T P  all-reduce 2: m x r
        mean ~ P Q^T;  e = M - P Q^T / N;  Q is kept for the next step (warm start)

    The other tensors (biases, BatchNorm, thin matrices) are all-reduced as
    they are. For the first ``--powersgd-start-iter`` steps every bucket is
    all-reduced uncompressed (PyTorch's ``start_powerSGD_iter``: the early
    steps are the most sensitive to a poor gradient), with no error kept.
    Q starts from a normal draw seeded by the tensor's shape, the same on
    every rank. All-reduce 1 of a bucket is launched when the bucket fills,
    overlapping backward like an uncompressed bucket; all-reduce 2 needs the
    summed P, so it runs after backward (launched for every bucket, then
    waited for), where its time is exposed. Error feedback is kept for the
    compressed tensors only (PyTorch keeps it for the whole bucket; for a
    tensor sent exactly the errors of the ranks sum to zero and do not change
    the mean).
    """
    name = "powersgd"

    def __init__(self, rank: int, start_iter: int, world: int):
        self.rank, self.start_iter, self.world = rank, start_iter, world
        self.steps = 0                                   # synchronised steps so far
        self.q: dict[tuple[int, int], torch.Tensor] = {}       # (bucket, tensor) -> Q, kept between steps
        self.error: dict[tuple[int, int], torch.Tensor] = {}   # (bucket, tensor) -> e
        self.sending = {"uncompressed": 0, "p": 0, "q": 0}     # elements sent in this step
        self.sent: dict = {}                                    # ... and in the last one finished

    def end_step(self) -> None:
        self.steps += 1
        self.sent = dict(self.sending)
        self.sending = {key: 0 for key in self.sending}

    def launch(self, comm, key, buffer, views, label) -> InFlight:
        if self.steps < self.start_iter:  # the uncompressed first phase
            return InFlight([comm.all_reduce(buffer, name=label, async_op=True)])
        return _PowerSGDBucket(self, comm, key, views, label)

    def summary(self) -> dict:
        return {"compress": self.name, "powersgd_rank": self.rank, "powersgd_start_iter": self.start_iter,
                "elements_sent_last_step": dict(self.sent)}


class _PowerSGDBucket(InFlight):
    """One bucket through PowerSGD's two all-reduces."""

    def __init__(self, method: PowerSGD, comm, key: int, views: list[torch.Tensor], label: str):
        self.method, self.comm, self.label = method, comm, label
        r, n_ranks = method.rank, method.world
        self.plain = [v for v in views if not compressible(v.shape, r)]
        self.matrices, self.keys = [], []
        for i, v in enumerate(views):
            if compressible(v.shape, r):
                k = (key, i)
                if k not in method.q:
                    method.q[k] = initial_q(v.shape, r, v.dtype)
                    method.error[k] = torch.zeros_like(v)
                v.add_(method.error[k])                              # M = G/N + e
                self.matrices.append(v.view(matrix_shape(v.shape)))
                self.keys.append(k)
        ps = [m @ method.q[k] for m, k in zip(self.matrices, self.keys)]
        self.p_sizes = [p.numel() for p in ps]
        self.first = torch.cat([v.reshape(-1) for v in self.plain] + [p.reshape(-1) for p in ps])
        self.n_ranks = n_ranks
        super().__init__([comm.all_reduce(self.first, name=f"{label}_powersgd_p", async_op=True)])
        self.p: list[torch.Tensor] | None = None   # the orthonormal P's, once round 1 is in
        self.second_round = None

    def proceed(self) -> None:
        for pending in self.pendings:
            pending.wait()
        offset = 0
        for v in self.plain:                                          # sent as they are: the mean
            v.copy_(self.first[offset:offset + v.numel()].view_as(v))
            offset += v.numel()
        self.p = []
        for m, size in zip(self.matrices, self.p_sizes):
            self.p.append(orthonormalize_(self.first[offset:offset + size].view(m.shape[0], -1)))
            offset += size
        qs = [m.t() @ p for m, p in zip(self.matrices, self.p)]
        self.q_sizes = [q.numel() for q in qs]
        self.second = torch.cat([q.reshape(-1) for q in qs]) if qs else None
        if self.second is not None:
            self.second_round = self.comm.all_reduce(self.second, name=f"{self.label}_powersgd_q", async_op=True)
        sent = self.method.sending
        sent["uncompressed"] += sum(v.numel() for v in self.plain)
        sent["p"] += sum(self.p_sizes)
        sent["q"] += sum(self.q_sizes)

    def complete(self) -> None:
        if self.p is None:
            self.proceed()
        if self.second_round is not None:
            self.second_round.wait()
        offset = 0
        for m, p, k, size in zip(self.matrices, self.p, self.keys, self.q_sizes):
            q = self.second[offset:offset + size].view(m.shape[1], -1)
            offset += size
            approx = p @ q.t()
            self.method.error[k].copy_((m - approx / self.n_ranks).view_as(self.method.error[k]))  # e = M - PQ^T/N
            self.method.q[k] = q.clone()                                                        # warm start
            m.copy_(approx)                                                                     # the mean's estimate


def make_compressor(options, world: int):
    """The bucket compressor that ``--compress`` names (``options``: a strategy's ``ctx.options``)."""
    if options.compress in WIRE_DTYPES:
        return CastCompression(options.compress)
    if options.compress == "powersgd":
        return PowerSGD(options.powersgd_rank, options.powersgd_start_iter, world)
    return NoCompression()



# ---------------------------------------------------------------------------- torch-ddp: PyTorch's hooks
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


# ---------------------------------------------------------------------------- the reference (--check)
def reference_for(options, replicas: int) -> ReferenceCompression | None:
    """The reference's compression for a run's ``options`` over ``replicas`` shards; None where the
    run sends its gradients as they are (the reference then averages exactly)."""
    if getattr(options, "compress", "none") == "none":
        return None
    return ReferenceCompression(options, replicas)


class ReferenceCompression:
    """The same compression, applied in one process to every replica's gradients (``--check``).

    ``combine(per_replica)``: ``per_replica[r][i]`` is replica r's gradient of parameter i divided by
    N (its share of the loss); returns, per parameter, what every rank's bucket holds after the
    compressed exchange. State (PowerSGD's Q and each replica's error) is kept between steps.

    Its sums run in rank order instead of gloo's, which for 2 replicas is the same arithmetic
    exactly (a sum of two numbers does not depend on the order) and for PowerSGD differs from it
    by rounding only. An fp16/bf16 sum of more than 2 values depends on gloo's order in the narrow
    type, which is not replayed: :func:`validate_buckets` refuses that ``--check``.
    """

    def __init__(self, options, replicas: int):
        self.options, self.n = options, replicas
        self.steps = 0
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[tuple[int, int], torch.Tensor] = {}

    def describe(self) -> str:
        o = self.options
        if o.compress in WIRE_DTYPES:
            return (f"--compress {o.compress}: each replica's gradient share rounded to {o.compress}, summed, "
                    f"the sum rounded to {o.compress}")
        return (f"--compress powersgd: rank {o.powersgd_rank} with error feedback and warm start after "
                f"{o.powersgd_start_iter} uncompressed step(s), the same low-rank arithmetic per tensor")

    def caveat(self) -> str:
        """What ``--check`` says before it compares: this is not plain training's arithmetic."""
        return (f"--compress {self.options.compress} changes the arithmetic (the gradients are not averaged "
                "exactly), so this is not a comparison with plain training: the reference applies the same "
                "compression")

    @torch.no_grad()
    def combine(self, per_replica: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        o, n = self.options, self.n
        out = []
        for i in range(len(per_replica[0])):
            grads = [per_replica[r][i] for r in range(n)]
            dtype = grads[0].dtype
            if o.compress in WIRE_DTYPES:
                wire = WIRE_DTYPES[o.compress]
                total = grads[0].to(wire).float()
                for g in grads[1:]:
                    total = total + g.to(wire).float()
                out.append(total.to(wire).to(dtype))
            elif o.compress == "powersgd" and self.steps >= o.powersgd_start_iter \
                    and compressible(grads[0].shape, o.powersgd_rank):
                out.append(self._powersgd(i, grads))
            else:
                total = grads[0].clone()
                for g in grads[1:]:
                    total += g
                out.append(total)
        self.steps += 1
        return out

    def _powersgd(self, i: int, grads: list[torch.Tensor]) -> torch.Tensor:
        rank, shape = self.options.powersgd_rank, grads[0].shape
        if i not in self.q:
            self.q[i] = initial_q(shape, rank, grads[0].dtype)
        ms = []
        for r, g in enumerate(grads):
            e = self.error.setdefault((r, i), torch.zeros_like(g))
            ms.append((g + e).view(matrix_shape(shape)))
        p = ms[0] @ self.q[i]
        for m in ms[1:]:
            p = p + m @ self.q[i]
        orthonormalize_(p)
        q = ms[0].t() @ p
        for m in ms[1:]:
            q = q + m.t() @ p
        approx = p @ q.t()
        for r, m in enumerate(ms):
            self.error[(r, i)] = (m - approx / self.n).view(shape)
        self.q[i] = q
        return approx.view(shape)
