"""Our ddp's bucket path: what a full gradient bucket sends (``make_compressor``).

``launch`` starts a bucket's communication through ``comm.py`` when the bucket fills,
``proceed`` runs any second round after backward (PowerSGD's Q), ``complete`` waits and
leaves the mean (or its estimate) in the bucket: none, a cast to fp16/bf16, or PowerSGD.
"""
from __future__ import annotations

import torch

from .lowrank import compressible, initial_q, matrix_shape, orthonormalize_
from .methods import WIRE_DTYPES


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
    complete; ``summary()`` for the rank's details; ``state_dict()``/``load_state_dict()`` what it carries from
    one step to the next (a checkpoint holds it). This one sends the bucket as it is and carries nothing."""
    name = "none"

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        pass

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

    def __init__(self, rank: int, start_iter: int, world: int, scale=None):
        self.rank, self.start_iter, self.world = rank, start_iter, world
        # fp16: the loss scale the bucket's gradients carry now; the error is kept unscaled (so a change of scale
        # leaves it right), multiplied in as M is made and divided out as it is kept
        self.scale = scale or (lambda: 1.0)
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

    def state_dict(self) -> dict:
        """The steps taken (it compresses from ``start_iter`` on) and each compressed tensor's Q and error,
        keyed ``"bucket.tensor"``: without them a resumed run would send uncompressed again and start its
        error feedback and warm start afresh."""
        return {"steps": self.steps, "q": {f"{b}.{i}": t.clone() for (b, i), t in self.q.items()},
                "error": {f"{b}.{i}": t.clone() for (b, i), t in self.error.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        def keyed(tensors: dict) -> dict:
            return {tuple(int(x) for x in k.split(".")): t.to(device).clone() for k, t in tensors.items()}
        self.steps, self.q, self.error = int(state["steps"]), keyed(state["q"]), keyed(state["error"])


class _PowerSGDBucket(InFlight):
    """One bucket through PowerSGD's two all-reduces."""

    def __init__(self, method: PowerSGD, comm, key: int, views: list[torch.Tensor], label: str):
        self.method, self.comm, self.label = method, comm, label
        r, n_ranks = method.rank, method.world
        self.scale = method.scale()
        self.plain = [v for v in views if not compressible(v.shape, r)]
        # each M, P and Q is a tensor of its own, not a view into a bucket: a CPU's matrix-vector products round
        # by where a row starts in memory, and a view starts anywhere in its bucket (the check's reference, which
        # multiplies tensors of its own, then rounds as this does)
        self.matrices, self.targets, self.keys = [], [], []
        for i, v in enumerate(views):
            if compressible(v.shape, r):
                k = (key, i)
                if k not in method.q:
                    method.q[k] = initial_q(v.shape, r, v.dtype).to(v.device)
                    method.error[k] = torch.zeros_like(v)
                m = torch.add(v, method.error[k], alpha=self.scale)     # M = G/N + e
                self.matrices.append(m.view(matrix_shape(v.shape)))
                self.targets.append(v)
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
            self.p.append(orthonormalize_(self.first[offset:offset + size].view(m.shape[0], -1).clone()))
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
        for m, v, p, k, size in zip(self.matrices, self.targets, self.p, self.keys, self.q_sizes):
            q = self.second[offset:offset + size].view(m.shape[1], -1).clone()
            offset += size
            approx = p @ q.t()
            self.method.error[k].copy_((m - approx / self.n_ranks).view_as(self.method.error[k]) / self.scale)
            #                                                                                   e = M - PQ^T/N
            self.method.q[k] = q                                                                # warm start
            v.copy_(approx.view_as(v))                                                          # the mean's estimate


def make_compressor(options, world: int, scale=None):
    """The bucket compressor that ``--compress`` names (``options``: a strategy's ``ctx.options``; ``scale()``:
    the loss scale the gradients carry, under fp16)."""
    if options.compress in WIRE_DTYPES:
        return CastCompression(options.compress)
    if options.compress == "powersgd":
        return PowerSGD(options.powersgd_rank, options.powersgd_start_iter, world, scale)
    return NoCompression()
