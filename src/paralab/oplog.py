"""Each rank's log of its last communication operations, in a small file another process can read.

``comm.py`` tells the log when an operation is entered (or launched, if
asynchronous), when the rank blocks waiting for it, and when it is done or
failed. The log is a fixed-size file (``HEADER`` then a ring of ``CAPACITY``
records) mapped into memory: an update is one ``struct.pack_into`` into the
mapping, no system call, and the page cache makes it visible to any process
that reads the file, even after this rank is stuck or killed.
``run/hangs.py`` reads every rank's file and says where they disagree.

A record: the rank's sequence number; the operation's number on its group
(every member counts the group's collectives alike; send/recv count per
channel ``src>dst``, which is how gloo pairs them); the op; the group's name
(``dp 1``) and key (its global ranks, or the channel); shape, dtype, bytes;
the peer (send/recv, global); state; enter and done times (wall clock).
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

MAGIC = b"PLOPLOG1"
CAPACITY = 256
HEADER = struct.Struct("<8s i i i i q d B 31x")     # magic, rank, world, pid, capacity, count, opened, closed
RECORD = struct.Struct("<q q d d q i B 3x 20s 24s 48s 40s 12s")
DONE_AT = struct.Struct("<d")                       # a record's t_done, at offset 24
STATE_AT = struct.Struct("<B")                      # a record's state, at offset 44
COUNT_AT = struct.Struct("<q")                      # the header's count, at offset 24

# states
ENTERED, IN_FLIGHT, WAITING, DONE, FAILED = 1, 2, 3, 4, 5
STATE_NAMES = {ENTERED: "entered", IN_FLIGHT: "in flight", WAITING: "waiting", DONE: "done", FAILED: "failed"}

_DTYPES: dict = {}


def members_key(ranks) -> str:
    """A group's global ranks, compactly: ``0-7``, ``1,3,5``."""
    ranks = list(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class NullLog:
    """No log (a single process, a unit test): every call does nothing but count."""
    count = 0

    def enter(self, op, name, key, nbytes, tensor=None, peer=-1, state=ENTERED) -> int:
        self.count += 1
        return -1

    def set_state(self, slot: int, state: int) -> None:
        pass

    def close(self, remove: bool = False) -> None:
        pass


class OpLog(NullLog):
    """This rank's log, in ``path`` (created, fixed size)."""

    def __init__(self, path, rank: int, world: int, capacity: int = CAPACITY):
        self.path, self.capacity = Path(path), capacity
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = HEADER.size + capacity * RECORD.size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        HEADER.pack_into(self.map, 0, MAGIC, rank, world, os.getpid(), capacity, 0, time.time(), 0)
        self.count = 0
        self.per_group: dict[str, int] = {}

    def enter(self, op: str, name: str, key: str, nbytes: int, tensor=None, peer: int = -1,
              state: int = ENTERED) -> int:
        """Record an operation starting; returns its slot (for :meth:`set_state`)."""
        number = self.per_group.get(key, 0) + 1
        self.per_group[key] = number
        shape, dtype = b"", b""
        if tensor is not None:
            shape = str(tuple(tensor.shape)).encode()[:40]
            dtype = _DTYPES.get(tensor.dtype)
            if dtype is None:
                dtype = _DTYPES[tensor.dtype] = str(tensor.dtype).removeprefix("torch.").encode()[:12]
        slot = HEADER.size + (self.count % self.capacity) * RECORD.size
        RECORD.pack_into(self.map, slot, self.count, number, time.time(), 0.0, nbytes, peer, state,
                         op.encode()[:20], name.encode()[:24], key.encode()[:48], shape, dtype)
        self.count += 1
        COUNT_AT.pack_into(self.map, 24, self.count)
        return slot

    def set_state(self, slot: int, state: int) -> None:
        STATE_AT.pack_into(self.map, slot + 44, state)
        if state in (DONE, FAILED):
            DONE_AT.pack_into(self.map, slot + 24, time.time())

    def close(self, remove: bool = False) -> None:
        """Mark the log closed (an orderly end); ``remove``: delete the file (a run that succeeded)."""
        self.map[40] = 1  # the header's closed flag
        self.map.close()
        if remove:
            self.path.unlink(missing_ok=True)


_active: NullLog = NullLog()


def open_log(path, rank: int, world: int) -> OpLog:
    """Start this process's log; every Comm made afterwards writes to it."""
    global _active
    _active = OpLog(path, rank, world)
    return _active


def active() -> NullLog:
    return _active


def close_log(remove: bool = False) -> None:
    global _active
    _active.close(remove)
    _active = NullLog()
