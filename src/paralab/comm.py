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

Every call is also written to this rank's op log (``oplog.py``: entered, in
flight, waiting, done or failed), which ``run/hangs.py`` reads to name the
rank a run is waiting for when ``--timeout`` fires.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import oplog, wire
from .kinds import ASYNC, UNSEEN
from .oplog import DONE, FAILED, IN_FLIGHT, WAITING
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
    slot: int = -1          # its record in the op log

    def wait(self, category: str = "comm", **args) -> None:
        """Block until done; ``category="idle"`` marks a wait for a peer with nothing else to do."""
        log = self.comm.log
        if self.done_at is None:
            log.set_state(self.slot, WAITING)
        try:
            with self.comm.recorder.span(category, f"wait:{self.name}", op=self.op, **args):
                self.work.wait()
        except BaseException:
            log.set_state(self.slot, FAILED)
            raise
        log.set_state(self.slot, DONE)
        if self.on_wait is not None and self.done_at is None:
            self.on_wait(None)


class Comm:
    """Collectives over one process group: the whole world, or one dimension of the mesh.

    ``rank`` and ``world`` are this process's place in the group and the
    group's size; every rank argument (``src``, ``dst``, a peer) is a rank
    *in the group*. ``ranks`` lists the group's members as global ranks (the
    identity for the world group), which is what torch.distributed is given.
    """

    def __init__(self, recorder: Recorder, rank: int, world: int, group=None, ranks: list[int] | None = None,
                 name: str = "world"):
        self.recorder, self.rank, self.world, self.group = recorder, rank, world, group
        self.ranks = list(ranks) if ranks is not None else list(range(world))
        self.name = name  # how the op log names the group (``dp 1``)
        self.log = oplog.active()
        self.key = oplog.members_key(self.ranks)  # the group's identity in the log: its global ranks
        self.native_reduce_scatter: bool | None = None  # decided on first use
        self._futureless: set[str] = set()  # kinds of asynchronous work this group's backend gives no future

    def _global(self, rank: int) -> int:
        return self.ranks[rank]

    # ------------------------------------------------------------ helpers
    def _enter(self, kind: str, size: int, args, kwargs, state: int = oplog.ENTERED) -> int:
        """Write the operation to the op log; send/recv are keyed by their channel ``src>dst``."""
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if kind == "send":
            peer = kwargs["dst"]
            key = f"{self.ranks[self.rank]}>{peer}"
        elif kind == "recv":
            peer = kwargs["src"]
            key = f"{peer}>{self.ranks[self.rank]}"
        else:
            peer, key = -1, self.key
        return self.log.enter(kind, self.name, key, size, tensor, peer, state)

    def _timed(self, name: str, kind: str, size: int, fn, *args, root: int | None = None, **kwargs):
        """``fn(*args, **kwargs)`` timed as a ``comm`` span; ``root``: the group rank a rooted collective
        (broadcast, gather, scatter) sends from or to, kept in the span (what it put on the wire depends on it)."""
        slot = self._enter(kind, size, args, kwargs)
        try:
            with self.recorder.span("comm", name, size, op=kind, **({} if root is None else {"root": root})):
                result = fn(*args, **kwargs)
        except BaseException:
            self.log.set_state(slot, FAILED)
            raise
        self.log.set_state(slot, DONE)
        return result

    def _logged(self, kind: str, fn, *args, **kwargs):
        """A structure's collective (no tensor of ours, no span): logged only; ``fn``'s result."""
        slot = self.log.enter(kind, self.name, self.key, 0)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self.log.set_state(slot, FAILED)
            raise
        self.log.set_state(slot, DONE)
        return result

    def _launch(self, name: str, kind: str, size: int, fn, *args, **kwargs) -> Pending:
        rec = self.recorder
        slot = self._enter(kind, size, args, kwargs, IN_FLIGHT)
        t0 = rec.mark()  # on CUDA an event on the stream, read after the step (recorder.py)
        work = fn(*args, async_op=True, **kwargs)
        pending = Pending(self, work, name, kind, size, t0, rec.step, slot=slot)
        log = self.log

        def finished(_fut, seen: bool = True):
            # runs on the backend's thread (on CUDA with the operation's stream current, so the mark is
            # its completion on the device): the span carries the step it was launched in, whatever
            # step the training thread has reached by now
            pending.done_at = rec.mark()
            log.set_state(slot, DONE)
            rec.add("comm", name, t0, pending.done_at, size, step=pending.step, op=kind,
                    **{ASYNC: True, **({} if seen else {UNSEEN: True})})
            return None

        if kind not in self._futureless:
            try:
                work.get_future().then(finished)
                return pending
            except RuntimeError:
                # gloo's point-to-point work has no future; the refusal is a C++ exception (tens of
                # microseconds), so each kind asks once
                self._futureless.add(kind)
        # no future: the operation may have finished long before; all that is known is that it had by the
        # time wait() returned, so the interval ends there and is marked so (not drawn or counted as overlap)
        pending.on_wait = lambda fut: finished(fut, seen=False)
        return pending

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, name: str = "all_reduce", async_op: bool = False):
        if async_op:
            return self._launch(name, "all_reduce", nbytes(t), dist.all_reduce, t, op=SUM, group=self.group)
        return self._timed(name, "all_reduce", nbytes(t), dist.all_reduce, t, op=SUM, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0, name: str = "broadcast"):
        return self._timed(name, "broadcast", nbytes(t), dist.broadcast, t, src=self._global(src),
                           group=self.group, root=src)

    def gather(self, t: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int = 0,
               name: str = "gather"):
        return self._timed(name, "gather", nbytes(t), dist.gather, t, gather_list=gather_list,
                           dst=self._global(dst), group=self.group, root=dst)

    def scatter(self, t: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int = 0,
                name: str = "scatter"):
        return self._timed(name, "scatter", nbytes(t), dist.scatter, t, scatter_list=scatter_list,
                           src=self._global(src), group=self.group, root=src)

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

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                          in_splits: list[int] | None = None, name: str = "all_to_all"):
        """Rows ``in_splits[r]`` of ``inp`` to rank ``r``; rank ``r``'s rows for us into ``out``, in rank order
        (``None``: equal splits). Bytes: what this rank sends (``inp``, its own part included)."""
        return self._timed(name, "all_to_all", nbytes(inp), dist.all_to_all_single, out, inp,
                           output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group)

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

    # ------------------------------------------------------------ structures (set-up, records, checks)
    # Dicts, lists, tuples, strings, numbers and tensors, written by wire.py (JSON and raw tensor bytes):
    # torch.distributed's own object collectives pickle, and unpickling what a peer sends can run any code.
    def _message_device(self) -> torch.device:
        """Where a message's bytes travel: NCCL moves CUDA tensors only, gloo CPU ones."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _message(self, obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8).to(self._message_device())

    @staticmethod
    def _read(t: torch.Tensor):
        return wire.decode(t.cpu().numpy().tobytes())

    def gather_objects(self, obj, dst: int = 0) -> list | None:
        """Every rank's ``obj`` on ``dst``, in rank order (None elsewhere): its size, then its bytes, sent to
        ``dst`` by each rank."""
        if self.world == 1:
            return [obj]

        def gather():
            if self.rank != dst:
                message = self._message(obj)
                dist.send(torch.tensor([message.numel()], device=message.device), self._global(dst), self.group)
                dist.send(message, self._global(dst), self.group)
                return None
            out, device = [], self._message_device()
            for r in range(self.world):
                if r == dst:
                    out.append(obj)
                    continue
                size = torch.zeros(1, dtype=torch.int64, device=device)
                dist.recv(size, self._global(r), self.group)
                message = torch.empty(int(size), dtype=torch.uint8, device=device)
                dist.recv(message, self._global(r), self.group)
                out.append(self._read(message))
            return out
        return self._logged("gather_object", gather)

    def all_gather_objects(self, obj) -> list:
        """Every rank's ``obj`` on every rank, in rank order: the sizes, then the bytes, each padded to the
        longest, in one all-gather."""
        if self.world == 1:
            return [obj]

        def all_gather():
            message = self._message(obj)
            sizes = torch.zeros(self.world, dtype=torch.int64, device=message.device)
            _all_gather_single(sizes, torch.tensor([message.numel()], device=message.device), group=self.group)
            longest = int(sizes.max())
            padded = torch.zeros(longest, dtype=torch.uint8, device=message.device)
            padded[:message.numel()] = message
            everyone = torch.empty(self.world * longest, dtype=torch.uint8, device=message.device)
            _all_gather_single(everyone, padded, group=self.group)
            return [self._read(everyone[r * longest:r * longest + int(n)]) for r, n in enumerate(sizes.tolist())]
        return self._logged("all_gather_object", all_gather)

    def broadcast_object(self, obj, src: int = 0):
        """``src``'s ``obj`` on every rank."""
        if self.world == 1:
            return obj

        def broadcast():
            device = self._message_device()
            message = self._message(obj) if self.rank == src else None
            size = torch.tensor([message.numel() if message is not None else 0], device=device)
            dist.broadcast(size, self._global(src), self.group)
            if message is None:
                message = torch.empty(int(size), dtype=torch.uint8, device=device)
            dist.broadcast(message, self._global(src), self.group)
            return obj if self.rank == src else self._read(message)
        return self._logged("broadcast_object", broadcast)
