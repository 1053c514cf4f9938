"""The only place collectives and point-to-point calls are made.

Every call is timed by the recorder as a ``comm`` span carrying the bytes it
moved and the kind of operation, so bandwidth and split time come for free.
Asynchronous calls return a :class:`Pending`: its in-flight interval (launch
to completion, taken from the work's future callback) is recorded as an
``async`` span, and the time a rank then blocks in ``wait()`` as an ordinary
``comm`` span named ``wait:<name>``; the difference is communication that was
hidden behind computation.

Calls made outside a training step (set-up, checks, gathering records) go
through the same functions; they land at step -1 and stay out of averages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .recorder import Recorder

SUM = dist.ReduceOp.SUM

# torch 2.13 renamed the tensor-in/tensor-out collectives; accept both spellings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Pending:
    """An asynchronous operation in flight."""
    comm: "Comm"
    work: object
    name: str
    op: str
    bytes: int
    t_launch: object  # a recorder mark: seconds, or a device event (recorder.Recorder.mark)
    step: int
    done_at: object = None
    on_wait: object = None  # records the interval at wait() where the work has no future (gloo send/recv)

    def wait(self, category: str = "comm", **args) -> None:
        """Block until done; ``category="idle"`` marks a wait for a peer with nothing else to do."""
        with self.comm.recorder.span(category, f"wait:{self.name}", op=self.op, **args):
            self.work.wait()
        if self.on_wait is not None and self.done_at is None:
            self.on_wait(None)


class Comm:
    """Collectives over one process group: the whole world, or one dimension of the mesh.

    ``rank`` and ``world`` are this process's place in the group and the
    group's size; every rank argument (``src``, ``dst``, a peer) is a rank
    *in the group*. ``ranks`` lists the group's members as global ranks (the
    identity for the world group), which is what torch.distributed is given.
    """

    def __init__(self, recorder: Recorder, rank: int, world: int, group=None, ranks: list[int] | None = None):
        self.recorder, self.rank, self.world, self.group = recorder, rank, world, group
        self.ranks = list(ranks) if ranks is not None else list(range(world))
        self.native_reduce_scatter: bool | None = None  # decided on first use
        self._futureless: set[str] = set()  # kinds of asynchronous work this group's backend gives no future

    def _global(self, rank: int) -> int:
        return self.ranks[rank]

    # ------------------------------------------------------------ helpers
    def _timed(self, name: str, kind: str, size: int, fn, *args, **kwargs):
        with self.recorder.span("comm", name, size, op=kind):
            return fn(*args, **kwargs)

    def _launch(self, name: str, kind: str, size: int, fn, *args, **kwargs) -> Pending:
        rec = self.recorder
        t0 = rec.mark()  # on CUDA an event on the stream, read after the step (recorder.py)
        work = fn(*args, async_op=True, **kwargs)
        pending = Pending(self, work, name, kind, size, t0, rec.step)

        def finished(_fut):
            # runs on the backend's thread (on CUDA with the operation's stream current, so the mark is
            # its completion on the device): the span carries the step it was launched in, whatever
            # step the training thread has reached by now
            pending.done_at = rec.mark()
            rec.add("comm", name, t0, pending.done_at, size, step=pending.step, op=kind, **{"async": True})
            return None

        if kind not in self._futureless:
            try:
                work.get_future().then(finished)
                return pending
            except RuntimeError:
                # gloo's point-to-point work has no future; the refusal is a C++ exception (tens of
                # microseconds), so each kind asks once
                self._futureless.add(kind)
        pending.on_wait = finished  # no future: the interval ends at wait()
        return pending

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, name: str = "all_reduce", async_op: bool = False):
        if async_op:
            return self._launch(name, "all_reduce", nbytes(t), dist.all_reduce, t, op=SUM, group=self.group)
        return self._timed(name, "all_reduce", nbytes(t), dist.all_reduce, t, op=SUM, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0, name: str = "broadcast"):
        return self._timed(name, "broadcast", nbytes(t), dist.broadcast, t, src=self._global(src),
                           group=self.group)

    def gather(self, t: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int = 0,
               name: str = "gather"):
        return self._timed(name, "gather", nbytes(t), dist.gather, t, gather_list=gather_list,
                           dst=self._global(dst), group=self.group)

    def scatter(self, t: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int = 0,
                name: str = "scatter"):
        return self._timed(name, "scatter", nbytes(t), dist.scatter, t, scatter_list=scatter_list,
                           src=self._global(src), group=self.group)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, name: str = "all_gather",
                        async_op: bool = False, group=None):
        """Every rank's ``shard`` concatenated into ``out`` (``group``: this Comm's unless given)."""
        group = self.group if group is None else group
        if async_op:
            return self._launch(name, "all_gather", nbytes(out), _all_gather_single, out, shard, group=group)
        return self._timed(name, "all_gather", nbytes(out), _all_gather_single, out, shard, group=group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, name: str = "reduce_scatter",
                       op=SUM, group=None) -> str:
        """Reduce ``full`` over ranks (a sum unless ``op`` says otherwise); keep this rank's slice in ``out``.

        Uses the backend's native reduce-scatter when it has one; otherwise an
        all-reduce followed by slicing. Returns which one ran.
        """
        group = self.group if group is None else group
        if self.native_reduce_scatter is not False:
            try:
                self._timed(name, "reduce_scatter", nbytes(full), _reduce_scatter_single, out, full,
                            op=op, group=group)
                self.native_reduce_scatter = True
                return "reduce_scatter"
            except (RuntimeError, NotImplementedError, ValueError):
                if self.native_reduce_scatter:
                    raise
                if op == SUM:  # only a plain sum says the backend has no reduce-scatter (not just not this op)
                    self.native_reduce_scatter = False
        self._timed(name, "all_reduce", nbytes(full), dist.all_reduce, full, op=op, group=group)
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        out.copy_(full.view(-1, out.numel())[rank].view_as(out))
        return "all_reduce+slice"

    def send(self, t: torch.Tensor, dst: int, name: str = "send"):
        return self._timed(name, "send", nbytes(t), dist.send, t, dst=self._global(dst), group=self.group)

    def recv(self, t: torch.Tensor, src: int, name: str = "recv"):
        return self._timed(name, "recv", nbytes(t), dist.recv, t, src=self._global(src), group=self.group)

    def isend(self, t: torch.Tensor, dst: int, name: str = "send") -> Pending:
        return self._launch(name, "send", nbytes(t), lambda *a, async_op, **k: dist.isend(*a, **k),
                            t, dst=self._global(dst), group=self.group)

    def irecv(self, t: torch.Tensor, src: int, name: str = "recv") -> Pending:
        return self._launch(name, "recv", nbytes(t), lambda *a, async_op, **k: dist.irecv(*a, **k),
                            t, src=self._global(src), group=self.group)

    def barrier(self, name: str = "barrier"):
        return self._timed(name, "barrier", 0, dist.barrier, group=self.group)

    # ------------------------------------------------------------ python objects (set-up, records)
    def gather_objects(self, obj, dst: int = 0) -> list | None:
        """Collect one picklable object per rank on ``dst`` (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out

    def all_gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]
