"""A pipeline's step where its workers share fewer cores than there are workers (``this-machine``).

On a cluster each worker has a device of its own. Here, 4 workers may share 2 cores: the calibration
measures a unit with every worker computing at once (``crowding``: how many times slower than one alone),
and that rate is right for layouts whose ranks compute in lockstep (data and tensor parallelism). A
pipeline's stages take turns: while one waits for its neighbour the others have the cores, so they compute
faster than the all-at-once rate (measured on 4 workers on 2 cores, ``dp1 pp4 1f1b``: about 1.8 ranks
computing at any moment, each stage's compute at about the speed of one alone).

:func:`simulate_shared` replays a schedule's action lists on a global clock, as
``strategies/pipeline/simulate.py`` does on an ideal machine, but the ranks computing at a moment share
the machine: with ``k`` of the ``n`` pipeline ranks computing, each progresses at
``1 / max(1, crowding x k / n)`` of its alone speed (each pipeline rank stands for its data- and
tensor-parallel peers, which compute at the same moments), so ``k = n`` gives the calibrated rate and a
rank alone the rate of one alone. Work is given in seconds at the all-at-once rate (what the planner
computes) and converted.

Each send and each receive also costs its rank ``host`` seconds of processor at its alone speed (the
executor's bookkeeping, posting the message, waking for it: measured by the calibration), shared like
compute: a send's message leaves when that work is done, a receive's work starts when its message is in.
A message holds its sender's link for ``wire`` seconds (of its ``transfer``), so messages a rank sends one
after another leave one after another.
"""
from __future__ import annotations

from collections import deque

from ...strategies.pipeline.actions import Kind, as_schedule
from ...strategies.pipeline.simulate import ScheduleError


def simulate_shared(schedule, forward: list[float], backward: list[float], fixed_f: list[float],
                    fixed_b: list[float], transfer: float, crowding: float,
                    input_time: list[float] | None = None, weight_time: list[float] | None = None,
                    host: float = 0.0, wire: float = 0.0) -> tuple[float, list[float]]:
    """(makespan, each rank's seconds computing) of ``schedule``: ``forward``/``backward`` per stage at the
    all-at-once rate (a split backward's ``input_time`` and ``weight_time`` likewise), ``fixed_f``/``fixed_b``
    per stage what does not use the cores (tensor parallelism's collectives), ``transfer`` a message's time,
    ``host`` a send's or a receive's processor time at alone speed (not counted as computing), ``wire`` how
    long a message holds its sender's link."""
    sched = as_schedule(schedule)
    world = sched.ranks
    inputs = input_time or [b / 2 for b in backward]
    weights = weight_time or [b / 2 for b in backward]
    work = {Kind.FORWARD: forward, Kind.BACKWARD: backward, Kind.BACKWARD_INPUT: inputs,
            Kind.BACKWARD_WEIGHT: weights}
    fixed = {Kind.FORWARD: fixed_f, Kind.BACKWARD: fixed_b, Kind.BACKWARD_INPUT: [f / 2 for f in fixed_b],
             Kind.BACKWARD_WEIGHT: [f / 2 for f in fixed_b]}
    t = 0.0
    pos = [0] * world
    left: list[float | None] = [None] * world    # alone-seconds left of the compute a rank is in
    then: list[float] = [0.0] * world            # its fixed part, after the compute
    wake = [0.0] * world                         # a rank waits until then (a message in flight, a fixed part)
    sending: list[int | None] = [None] * world   # the peer of the send whose host work is in progress
    computing = [False] * world                  # whether the work in progress is a compute (else host work)
    channels: dict[tuple[int, int], deque] = {}
    link_free = [0.0] * world                    # when each rank's outgoing link has sent what it was given
    busy = [0.0] * world

    def send(r: int, peer: int) -> None:
        leaves = max(t, link_free[r])
        link_free[r] = leaves + wire
        channels.setdefault((r, peer), deque()).append(leaves + transfer)

    def advance() -> None:
        """Every rank not computing goes through its sends and receives at time ``t``, as far as it can."""
        moved = True
        while moved:
            moved = False
            for r in range(world):
                while left[r] is None and pos[r] < len(sched[r]) and wake[r] <= t:
                    a = sched[r][pos[r]]
                    if a.kind.is_compute:
                        left[r], then[r], computing[r] = work[a.kind][a.stage] / crowding, fixed[a.kind][a.stage], True
                    elif a.kind.is_send:
                        if host:
                            left[r], then[r], computing[r], sending[r] = host, 0.0, False, a.peer
                        else:
                            send(r, a.peer)
                    else:
                        queue = channels.get((a.peer, r))
                        if not queue:
                            break
                        if queue[0] > t:
                            wake[r] = queue[0]
                            break
                        queue.popleft()
                        if host:
                            left[r], then[r], computing[r] = host, 0.0, False
                    pos[r] += 1
                    moved = True

    while True:
        advance()
        active = [r for r in range(world) if left[r] is not None]
        waiting = [wake[r] for r in range(world) if left[r] is None and wake[r] > t]
        if not active and not waiting:
            if all(pos[r] == len(sched[r]) for r in range(world)):
                return t, busy
            raise ScheduleError("deadlock: " + ", ".join(f"rank {r} at {sched[r][pos[r]].label()}"
                                                         for r in range(world) if pos[r] < len(sched[r])))
        speed = 1.0 / max(1.0, crowding * len(active) / world)
        dt = min([left[r] / speed for r in active] + [w - t for w in waiting])
        for r in active:
            left[r] -= dt * speed
            busy[r] += dt if computing[r] else 0.0
        t += dt
        for r in active:
            if left[r] <= 1e-12:
                left[r] = None
                wake[r] = t + then[r]
                if sending[r] is not None:
                    send(r, sending[r])
                    sending[r] = None
