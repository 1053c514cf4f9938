"""Name the rank a run is waiting for: read every rank's op log and say where they disagree.

Each rank of a multi-rank run writes its last communication operations to
``RUN/oplog/rank<R>.bin`` (``oplog.py``; a run that ends in order removes
them). When a run fails or ``--timeout`` fires, :func:`explain_hang` reads
them all (the launcher after the ranks ended; under torchrun or ``--rank``,
the rank that timed out, reading what the run directory holds) and
:func:`diagnose` says, first, the earliest operation the ranks called
differently (another op, shape or dtype at the same place in a group's
sequence), then for each rank blocked in an operation the peers that never
reached it and what each did instead: waiting elsewhere, computing since its
last operation ended, or ended (as the launcher saw it).

Operations are matched the way the backend matches them: collectives by
their number on their group (every member counts alike), sends and receives
by their number on their channel ``src>dst``. ``#N`` in a message is the
rank's own sequence number, as its log holds it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..oplog import (DONE, ENTERED, FAILED, HEADER, IN_FLIGHT, MAGIC, RECORD, STATE_NAMES,
                     WAITING, close_log)

MAX_LINES = 8  # a diagnosis stays short: the first disagreements are the ones that matter


@dataclass(frozen=True)
class Op:
    """One record of a rank's op log."""
    rank: int
    seq: int        # the rank's own count
    number: int     # its number on its group (collectives) or channel (send/recv)
    op: str
    group: str      # the group's name (``dp 1``)
    key: str        # the group's global ranks (``0-3``) or the channel (``2>3``)
    shape: str
    dtype: str
    nbytes: int
    peer: int
    state: int
    t_enter: float
    t_done: float

    @property
    def p2p(self) -> bool:
        return ">" in self.key

    def signature(self) -> tuple:
        """What every party to the operation must agree on (a send and its receive: shape and dtype)."""
        return (self.shape, self.dtype) if self.p2p else (self.op, self.shape, self.dtype)

    def describe(self) -> str:
        where = (f"to rank {self.peer}" if self.op == "send" else f"from rank {self.peer}") if self.p2p \
            else f"on group {self.group}"
        what = ", ".join(x for x in (human_bytes(self.nbytes) if self.shape else "", self.shape, self.dtype) if x)
        return f"{self.op} #{self.seq} {where}" + (f" ({what})" if what else "")


@dataclass
class RankLog:
    rank: int
    world: int
    pid: int
    count: int          # operations written in all (the ring keeps the last ``capacity``)
    capacity: int
    closed: bool
    ops: list[Op]       # oldest first

    def on(self, key: str) -> list[Op]:
        return [o for o in self.ops if o.key == key]

    def blocked(self) -> Op | None:
        """The operation this rank is blocked in (or failed in), if any."""
        blocking = [o for o in self.ops if o.state in (ENTERED, WAITING)]
        if blocking:
            return blocking[-1]
        failed = [o for o in self.ops if o.state == FAILED]
        return failed[-1] if failed else None


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- files
def log_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "oplog" / f"rank{rank}.bin"


def remove_log(run_dir, created: bool) -> None:
    """An orderly end: this rank's log goes; so does the folder once empty (and the run directory, if
    this process created it and nothing else was written there: a torchrun rank's own default name)."""
    close_log(remove=True)
    for folder in [Path(run_dir) / "oplog"] + ([Path(run_dir)] if created else []):
        try:
            folder.rmdir()
        except OSError:
            pass


def read_log(path) -> RankLog | None:
    """One rank's log, or None if the file is not one (missing, truncated, another format)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) < HEADER.size or data[:8] != MAGIC:
        return None
    _, rank, world, pid, capacity, count, _opened, closed = HEADER.unpack_from(data, 0)
    if len(data) < HEADER.size + capacity * RECORD.size:
        return None
    ops = []
    for i in range(max(0, count - capacity), count):
        fields = RECORD.unpack_from(data, HEADER.size + (i % capacity) * RECORD.size)
        seq, number, t_enter, t_done, nbytes, peer, state, op, group, key, shape, dtype = fields
        if seq != i or state not in STATE_NAMES:
            continue  # being written when read
        text = [b.rstrip(b"\0").decode(errors="replace") for b in (op, group, key, shape, dtype)]
        ops.append(Op(rank, seq, number, text[0], text[1], text[2], text[3], text[4], nbytes, peer, state,
                      t_enter, t_done))
    return RankLog(rank, world, pid, count, capacity, bool(closed), ops)


def read_logs(run_dir) -> dict[int, RankLog]:
    found = {}
    for path in sorted((Path(run_dir) / "oplog").glob("rank*.bin")):
        log = read_log(path)
        if log is not None:
            found[log.rank] = log
    return found


def explain_hang(run_dir, ended: dict[int, str] | None = None, steps_done: dict[int, int] | None = None,
                 total: int | None = None) -> list[str]:
    """The diagnosis from the logs in ``run_dir`` as ``paralab:`` lines ([] if there is nothing to say).
    ``steps_done``: per rank that reported it, how many steps it had finished, so the diagnosis says where
    each was (``total``: the run's steps, after which a rank is past its last)."""
    lines = diagnose(read_logs(run_dir), ended)
    if not lines:
        return []
    where = [f"rank {r} " + (f"in step {d + 1}" if total is None or d < total else "after its last step")
             for r, d in sorted((steps_done or {}).items())]
    during = "; ".join(where) + "; " if where else ""
    return ["paralab: where the ranks disagree (" f"{during}their op logs, {Path(run_dir) / 'oplog'}):"] + \
        [f"paralab:   {line}" for line in lines]


def disagrees(lines: list[str]) -> bool:
    """Whether :func:`explain_hang`'s lines found ranks calling different operations at one place."""
    return any(line.startswith("paralab:   they disagree: ") for line in lines)


# ---------------------------------------------------------------------------- the diagnosis
def members(key: str) -> list[int]:
    """``0-3`` -> [0, 1, 2, 3]; ``1,3`` -> [1, 3] (``oplog.members_key`` backwards)."""
    if "-" in key:
        first, last = key.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(r) for r in key.split(",") if r]


def diagnose(logs: dict[int, RankLog], ended: dict[int, str] | None = None, now: float | None = None) -> list[str]:
    """What the logs say, in sentences: the first mismatch, then who each blocked rank waits for.

    ``ended``: how the ranks that ended on their own ended (the launcher's words), so a rank that
    died is not said to be computing.
    """
    ended, now = ended or {}, time.time() if now is None else now
    lines = []
    mismatch = first_mismatch(logs)
    if mismatch:
        lines.append(mismatch)
    for rank in sorted(logs):
        op = logs[rank].blocked()
        if op is None:
            continue
        verb = "was waiting" if op.state == FAILED else "is waiting"
        head = f"rank {rank} {verb} in {op.describe()}"
        absent = [(p, why) for p, why in missing_peers(logs, op) if why]
        if not absent:
            if not mismatch and all(p in logs for p in parties(op)):
                lines.append(f"{head}; every other party reached it too (a backend or network problem, "
                             "or a mismatch the logs cannot see)")
            continue
        lines.append(f"{head}; " + "; ".join(f"rank {p} {why}" + whereabouts(logs.get(p), ended.get(p), now)
                                             for p, why in absent))
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES] + [f"... and {len(lines) - MAX_LINES} more"]
    return lines


def parties(op: Op) -> list[int]:
    """The other ranks the operation needs."""
    if op.p2p:
        return [op.peer]
    return [m for m in members(op.key) if m != op.rank]


def missing_peers(logs: dict[int, RankLog], op: Op) -> list[tuple[int, str]]:
    """Each party and, if it did not reach ``op``, why we think so ('' when it did)."""
    found = []
    for peer in parties(op):
        log = logs.get(peer)
        if log is None:
            found.append((peer, "left no op log"))
            continue
        mine = log.on(op.key)
        if op.p2p:  # the peer's half of the channel: its receives for my sends, its sends for my receives
            mine = [o for o in mine if o.op != op.op]
        reached = max((o.number for o in mine), default=0)
        if reached >= op.number:
            found.append((peer, ""))
        elif not mine and log.count > log.capacity:
            found.append((peer, f"has no op on this {'channel' if op.p2p else 'group'} among its last "
                                f"{log.capacity}"))
        else:
            verb = {"send": "never received it", "recv": "never sent it"}.get(op.op, "never reached it")
            found.append((peer, verb))
    return found


def whereabouts(log: RankLog | None, ended: str | None, now: float) -> str:
    """Where a rank that did not come is: blocked elsewhere, computing, or ended."""
    if log is None or not log.ops:
        return f" (it ended: {ended})" if ended else ""
    blocked = log.blocked()
    if blocked is not None:
        text = f": it {'was' if blocked.state == FAILED else 'is'} waiting in {blocked.describe()}"
    else:
        last = log.ops[-1]
        since = max(o.t_done for o in log.ops if o.state == DONE) if any(o.state == DONE for o in log.ops) else 0
        text = f": its last op was {last.describe()}"
        if last.state == IN_FLIGHT:
            text += " (in flight)"
        elif not ended and since:
            text += f", done {now - since:.1f} s ago, and it has been computing since"
    return text + (f"; then it ended: {ended}" if ended else "")


def first_mismatch(logs: dict[int, RankLog]) -> str | None:
    """The earliest place where the parties to one operation called it differently."""
    by_place: dict[tuple[str, int], list[Op]] = {}
    for log in logs.values():
        for o in log.ops:
            by_place.setdefault((o.key, o.number), []).append(o)
    worst = None
    for ops in by_place.values():
        if len({o.signature() for o in ops}) > 1:
            first = min(o.seq for o in ops)
            if worst is None or first < worst[0]:
                worst = (first, ops)
    if worst is None:
        return None
    ops = sorted(worst[1], key=lambda o: o.rank)
    seen: dict[tuple, list[Op]] = {}
    for o in ops:
        seen.setdefault(o.signature(), []).append(o)
    parts = []
    for same in seen.values():
        o = same[0]
        who = "rank" if len(same) == 1 else "ranks"
        ranks = ", ".join(str(x.rank) for x in same)
        parts.append(f"{who} {ranks} called {o.describe()}")
    text = "they disagree: " + "; ".join(parts) + " (the same place in the " \
        f"{'channel' if ops[0].p2p else 'group'}'s sequence)"
    return text
