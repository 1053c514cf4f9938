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

KINDS = ("forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad")
SCHEDULES = ("gpipe", "1f1b")


class ScheduleError(Exception):
    """An action list that is inconsistent, mismatched or would deadlock."""


@dataclass(frozen=True)
class Action:
    kind: str              # one of KINDS
    microbatch: int
    peer: int | None = None  # the other rank of a send/recv; None for compute

    @property
    def is_compute(self) -> bool:
        return self.kind in ("forward", "backward")

    def __str__(self) -> str:
        short = {"forward": "F", "backward": "B", "send_act": "sA", "recv_act": "rA",
                 "send_grad": "sG", "recv_grad": "rG"}[self.kind]
        return f"{short}{self.microbatch}" + ("" if self.peer is None else f"@{self.peer}")


def _forward(rank: int, world: int, mb: int) -> list[Action]:
    acts = []
    if rank > 0:
        acts.append(Action("recv_act", mb, rank - 1))
    acts.append(Action("forward", mb))
    if rank < world - 1:
        acts.append(Action("send_act", mb, rank + 1))
    return acts


def _backward(rank: int, world: int, mb: int) -> list[Action]:
    acts = []
    if rank < world - 1:
        acts.append(Action("recv_grad", mb, rank + 1))
    acts.append(Action("backward", mb))
    if rank > 0:
        acts.append(Action("send_grad", mb, rank - 1))
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
        if a.kind == "forward":
            alive += 1
        elif a.kind == "backward":
            alive -= 1
        trace.append(alive)
    return trace


def peak_in_flight(actions: list[Action]) -> int:
    return max(in_flight(actions), default=0)


def theoretical_bubble(workers: int, microbatches: int) -> float:
    """GPipe's bubble fraction (W - 1) / (M + W - 1), equal stage times, free communication."""
    return (workers - 1) / (microbatches + workers - 1)


def check_local(actions: list[Action], rank: int, world: int, microbatches: int) -> None:
    """One rank's list on its own: complete, and every action after what it depends on."""
    done: set[tuple[str, int]] = set()
    for a in actions:
        if a.kind not in KINDS:
            raise ScheduleError(f"rank {rank}: unknown action kind {a.kind!r}")
        if not 0 <= a.microbatch < microbatches:
            raise ScheduleError(f"rank {rank}: {a} names microbatch {a.microbatch} of {microbatches}")
        if (a.kind, a.microbatch) in done:
            raise ScheduleError(f"rank {rank}: {a} appears twice")
        expected_peer = {"send_act": rank + 1, "recv_grad": rank + 1,
                         "recv_act": rank - 1, "send_grad": rank - 1}.get(a.kind)
        if a.peer != expected_peer:
            raise ScheduleError(f"rank {rank}: {a} should have peer {expected_peer}")
        if expected_peer is not None and not 0 <= expected_peer < world:
            raise ScheduleError(f"rank {rank}: {a} talks to a rank outside the pipeline")
        needs = {"forward": [("recv_act", a.microbatch)] if rank > 0 else [],
                 "send_act": [("forward", a.microbatch)],
                 "backward": [("forward", a.microbatch)] + ([("recv_grad", a.microbatch)]
                                                           if rank < world - 1 else []),
                 "send_grad": [("backward", a.microbatch)]}.get(a.kind, [])
        for need in needs:
            if need not in done:
                raise ScheduleError(f"rank {rank}: {a} comes before {need[0]} of microbatch {need[1]}")
        done.add((a.kind, a.microbatch))
    want = {("forward", m) for m in range(microbatches)} | {("backward", m) for m in range(microbatches)}
    if rank > 0:
        want |= {("recv_act", m) for m in range(microbatches)} | {("send_grad", m) for m in range(microbatches)}
    if rank < world - 1:
        want |= {("send_act", m) for m in range(microbatches)} | {("recv_grad", m) for m in range(microbatches)}
    if done != want:
        missing = sorted(want - done)
        extra = sorted(done - want)
        raise ScheduleError(f"rank {rank}: missing {missing[:4]} extra {extra[:4]}")


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
    microbatches = sum(a.kind == "forward" for a in schedule[0]) if schedule else 0
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
                if a.kind in ("forward", "backward"):
                    clock[rank] = t + (fwd if a.kind == "forward" else bwd)[rank]
                elif a.kind.startswith("send"):
                    channels.setdefault((rank, a.peer, a.kind[5:]), deque()).append((a.microbatch, t + comm_time))
                else:
                    queue = channels.get((a.peer, rank, a.kind[5:]))
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
