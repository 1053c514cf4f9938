"""Pipeline schedules as data: one ordered list of actions per rank.

A schedule says, for every rank (stage) of a ``W``-stage pipeline fed ``M``
microbatches, what to do and in which order: run the forward or backward of a
microbatch, send or receive an activation (forward direction) or a gradient
(backward direction). One executor (``executor.py``) runs any such list, so
adding a schedule is adding a function here; the tests check the lists
without running a model (:func:`check_schedule`, :func:`simulate`).

Channels: a message from rank ``a`` to rank ``b`` of one kind (activation or
gradient) travels on its own first-in-first-out channel, so the k-th send on
a channel meets the k-th receive. Sends never block (the executor posts them
with ``isend`` and waits for them at the end of the step); a receive blocks
until its message has arrived.

Schedules:

- ``gpipe`` (GPipe): every forward, then every backward (microbatches in
  order). Stage ``k`` keeps all ``M`` microbatches' activations alive.
- ``1f1b`` (PipeDream-flush, one-forward-one-backward): stage ``k`` first
  runs ``W - 1 - k`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. The bubble is the same as
  GPipe's, ``(W - 1) / (M + W - 1)`` with equal stage times, but at most
  ``W - k`` microbatches are alive on stage ``k``. With ``M < W`` the warm-up
  is cut to ``M`` forwards (every microbatch is in flight at once, as in
  GPipe): handled, not refused.

``M = 1`` with either schedule is naive model parallelism.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does. A ``str`` enum: each kind compares equal to its name in records."""
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)

    @property
    def channel(self) -> str | None:
        """Which channel a transfer travels on: "act" (forward direction) or "grad"."""
        return {Kind.SEND_ACT: "act", Kind.RECV_ACT: "act", Kind.SEND_GRAD: "grad", Kind.RECV_GRAD: "grad"}.get(self)

    @property
    def short(self) -> str:
        return {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.SEND_ACT: "sA", Kind.RECV_ACT: "rA",
                Kind.SEND_GRAD: "sG", Kind.RECV_GRAD: "rG"}[self]


KINDS = tuple(Kind)
SCHEDULES = ("gpipe", "1f1b")


class ScheduleError(Exception):
    """An action list that is inconsistent, mismatched or would deadlock."""


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    peer: int | None = None  # the other stage of a send/recv (its pipeline rank); None for compute

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))  # also accepts the kind's name

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    def __str__(self) -> str:
        return f"{self.kind.short}{self.microbatch}" + ("" if self.peer is None else f"@{self.peer}")


def _forward(rank: int, world: int, mb: int) -> list[Action]:
    acts = []
    if rank > 0:
        acts.append(Action(Kind.RECV_ACT, mb, rank - 1))
    acts.append(Action(Kind.FORWARD, mb))
    if rank < world - 1:
        acts.append(Action(Kind.SEND_ACT, mb, rank + 1))
    return acts


def _backward(rank: int, world: int, mb: int) -> list[Action]:
    acts = []
    if rank < world - 1:
        acts.append(Action(Kind.RECV_GRAD, mb, rank + 1))
    acts.append(Action(Kind.BACKWARD, mb))
    if rank > 0:
        acts.append(Action(Kind.SEND_GRAD, mb, rank - 1))
    return acts


def gpipe(world: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every stage."""
    out = []
    for rank in range(world):
        acts: list[Action] = []
        for mb in range(microbatches):
            acts += _forward(rank, world, mb)
        for mb in range(microbatches):
            acts += _backward(rank, world, mb)
        out.append(acts)
    return out


def one_f_one_b(world: int, microbatches: int) -> list[list[Action]]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    out = []
    for rank in range(world):
        warmup = min(world - 1 - rank, microbatches)
        acts: list[Action] = []
        for mb in range(warmup):
            acts += _forward(rank, world, mb)
        for j in range(microbatches - warmup):
            acts += _forward(rank, world, warmup + j)
            acts += _backward(rank, world, j)
        for mb in range(microbatches - warmup, microbatches):
            acts += _backward(rank, world, mb)
        out.append(acts)
    return out


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, workers: int, microbatches: int) -> list[list[Action]]:
    """Every rank's ordered action list for schedule ``name``."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(BUILDERS)}")
    if workers < 1 or microbatches < 1:
        raise ValueError("workers and microbatches must be positive")
    return BUILDERS[name](workers, microbatches)


def in_flight(actions: list[Action]) -> list[int]:
    """Microbatches whose activations are alive (forward done, backward not yet) after each action."""
    alive, trace = 0, []
    for a in actions:
        if a.kind is Kind.FORWARD:
            alive += 1
        elif a.kind is Kind.BACKWARD:
            alive -= 1
        trace.append(alive)
    return trace


def peak_in_flight(actions: list[Action]) -> int:
    return max(in_flight(actions), default=0)


def check_local(actions: list[Action], rank: int, world: int, microbatches: int) -> None:
    """One rank's list on its own: complete, and every action after what it depends on."""
    done: set[tuple[Kind, int]] = set()
    for a in actions:
        if not 0 <= a.microbatch < microbatches:
            raise ScheduleError(f"rank {rank}: {a} names microbatch {a.microbatch} of {microbatches}")
        if (a.kind, a.microbatch) in done:
            raise ScheduleError(f"rank {rank}: {a} appears twice")
        expected_peer = {Kind.SEND_ACT: rank + 1, Kind.RECV_GRAD: rank + 1,
                         Kind.RECV_ACT: rank - 1, Kind.SEND_GRAD: rank - 1}.get(a.kind)
        if a.peer != expected_peer:
            raise ScheduleError(f"rank {rank}: {a} should have peer {expected_peer}")
        if expected_peer is not None and not 0 <= expected_peer < world:
            raise ScheduleError(f"rank {rank}: {a} talks to a rank outside the pipeline")
        mb = a.microbatch
        needs = {Kind.FORWARD: [(Kind.RECV_ACT, mb)] if rank > 0 else [],
                 Kind.SEND_ACT: [(Kind.FORWARD, mb)],
                 Kind.BACKWARD: [(Kind.FORWARD, mb)] + ([(Kind.RECV_GRAD, mb)] if rank < world - 1 else []),
                 Kind.SEND_GRAD: [(Kind.BACKWARD, mb)]}.get(a.kind, [])
        for need in needs:
            if need not in done:
                raise ScheduleError(f"rank {rank}: {a} comes before {need[0]} of microbatch {need[1]}")
        done.add((a.kind, a.microbatch))
    kinds = [Kind.FORWARD, Kind.BACKWARD]
    if rank > 0:
        kinds += [Kind.RECV_ACT, Kind.SEND_GRAD]
    if rank < world - 1:
        kinds += [Kind.SEND_ACT, Kind.RECV_GRAD]
    want = {(k, m) for k in kinds for m in range(microbatches)}
    if done != want:
        show = lambda pairs: sorted(f"{k.short}{m}" for k, m in pairs)[:4]  # noqa: E731
        raise ScheduleError(f"rank {rank}: missing {show(want - done)} extra {show(done - want)}")


@dataclass
class Timed:
    """One action placed on an ideal clock (``simulate``); recv waits are its idle time."""
    rank: int
    action: Action
    t0: float
    t1: float


def simulate(schedule: list[list[Action]], forward_time: float | list[float] = 1.0,
             backward_time: float | list[float] = 2.0, comm_time: float = 0.0) -> list[list[Timed]]:
    """Run the lists on an ideal machine and return every action's start and end.

    Times may be one number or one per stage. Sends take no time on the sender
    and arrive ``comm_time`` later; a receive waits (idle) until its message
    is there. Raises ScheduleError if a list is inconsistent, if a receive
    would take a message for another microbatch, if some rank can never
    proceed (deadlock) or if a message is never received. The result draws
    the ideal timeline of a schedule.
    """
    world = len(schedule)
    microbatches = sum(a.kind is Kind.FORWARD for a in schedule[0]) if schedule else 0
    for rank, acts in enumerate(schedule):
        check_local(acts, rank, world, microbatches)

    def per_stage(t):
        return list(t) if isinstance(t, (list, tuple)) else [float(t)] * world

    fwd, bwd = per_stage(forward_time), per_stage(backward_time)
    clock = [0.0] * world
    pos = [0] * world
    channels: dict[tuple[int, int, str], deque] = {}
    timeline: list[list[Timed]] = [[] for _ in range(world)]
    while True:
        progressed = False
        for rank in range(world):
            while pos[rank] < len(schedule[rank]):
                a = schedule[rank][pos[rank]]
                t = clock[rank]
                if a.kind.is_compute:
                    clock[rank] = t + (fwd if a.kind is Kind.FORWARD else bwd)[rank]
                elif a.kind.is_send:
                    channels.setdefault((rank, a.peer, a.kind.channel), deque()).append((a.microbatch,
                                                                                        t + comm_time))
                else:
                    queue = channels.get((a.peer, rank, a.kind.channel))
                    if not queue:
                        break  # blocked: the message has not been sent yet
                    mb, ready = queue.popleft()
                    if mb != a.microbatch:
                        raise ScheduleError(f"rank {rank}: {a} would receive microbatch {mb} "
                                            f"(sends and receives on {a.peer}->{rank} are out of order)")
                    clock[rank] = max(t, ready)
                timeline[rank].append(Timed(rank, a, t, clock[rank]))
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(schedule[r]) for r in range(world)):
            break
        if not progressed:
            stuck = [f"rank {r} at {schedule[r][pos[r]]}" for r in range(world) if pos[r] < len(schedule[r])]
            raise ScheduleError("deadlock: " + ", ".join(stuck))
    left = {k: list(q) for k, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages never received: {left}")
    return timeline


def simulated_bubble(timeline: list[list[Timed]]) -> list[float]:
    """Per rank: 1 - compute time / makespan of the simulated step."""
    end = max((t.t1 for row in timeline for t in row), default=0.0)
    if end <= 0:
        return [0.0 for _ in timeline]
    return [1 - sum(t.t1 - t.t0 for t in row if t.action.is_compute) / end for row in timeline]
