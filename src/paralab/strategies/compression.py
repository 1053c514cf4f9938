"""Gradient compression for ``ddp``'s buckets: fp16, bf16 and PowerSGD, written from primitives.

``--compress fp16|bf16|powersgd`` changes what a bucket sends. Every method
receives the bucket after the hooks copied in this rank's gradient divided
by N (so the sum over ranks is the mean), sends less than the bucket's own
bytes through ``comm.py`` (which records the bytes that really crossed), and
leaves the mean's estimate in the bucket.

- **fp16 / bf16**: the bucket is cast to the narrow type, all-reduced in
  it (half the bytes), and cast back. The sum itself runs in the narrow
  type inside gloo.
- **PowerSGD** (Vogels, Karimireddy & Jaggi, NeurIPS 2019), rank r: each
  gradient tensor with a matrix shape (n rows = its first dimension, m
  columns = the rest) worth compressing, ``n*m > 2 r (n+m)`` (PyTorch's
  ``min_compression_rate`` 2), is sent as two thin matrices instead of n*m
  numbers:

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
  overlapping backward like an uncompressed bucket; all-reduce 2 needs
  the summed P, so it runs after backward (launched for every bucket, then
  waited for), where its time is exposed. Error feedback is kept for the
  compressed tensors only (PyTorch keeps it for the whole bucket; for a
  tensor sent exactly the errors of the ranks sum to zero and do not change
  the mean).

:class:`ReferenceCompression` applies the same arithmetic to every replica's
gradient in one process, for ``--check``: rank-order sums instead of gloo's,
which for 2 replicas is the same arithmetic exactly (a sum of two numbers
does not depend on the order) and for PowerSGD differs from it by rounding
only. An fp16/bf16 sum of more than 2 values depends on gloo's order in the
narrow type, which is not replayed: ``--check`` refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import option

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
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


# ---------------------------------------------------------------------------- in the bucket path
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


# ---------------------------------------------------------------------------- the reference
class ReferenceCompression:
    """The same compression, applied in one process to every replica's gradients (``--check``).

    ``combine(per_replica)``: ``per_replica[r][i]`` is replica r's gradient of parameter i divided by
    N (its share of the loss); returns, per parameter, what every rank's bucket holds after the
    compressed exchange. State (PowerSGD's Q and each replica's error) is kept between steps.
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
