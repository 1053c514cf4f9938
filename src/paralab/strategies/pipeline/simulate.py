"""Reading and checking a schedule without a model.

- :func:`in_flight` / :func:`peak_in_flight`: how many (stage, microbatch)
  pairs keep their activations alive along one rank's list: the memory a
  schedule costs, which ``schedules.py``'s formulas predict;
- :func:`check_local`: one rank's list on its own is complete and puts every
  action after what it depends on;
- :func:`simulate`: all ranks' lists run together on an ideal clock (given
  times per stage, sends that never block, receives that wait for their
  message on the first-in-first-out channel between two ranks): it raises if
  a receive would take the wrong message, if the ranks deadlock or if a
  message is never received, and otherwise returns the ideal timeline
  (:class:`Timed` actions), whose idle share :func:`simulated_bubble` gives.

The tests check every built schedule with these; ``analysis/pipeline.py``
replays a run's schedule on its measured stage times with :func:`simulate`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .actions import Action, Kind, Schedule, ScheduleError, as_schedule, message_of


def in_flight(actions: list[Action]) -> list[int]:
    """(Stage, microbatch) pairs whose activations are alive after each action: from the forward to
    the compute that completes the weight gradients (``B``, or ``W`` when the backward is split)."""
    alive, trace = 0, []
    for a in actions:
        if a.kind is Kind.FORWARD:
            alive += 1
        elif a.kind.completes_weights:
            alive -= 1
        trace.append(alive)
    return trace


def peak_in_flight(actions: list[Action]) -> int:
    return max(in_flight(actions), default=0)


def check_local(actions: list[Action], rank: int, world: int, microbatches: int,
                placement: tuple[int, ...] | None = None) -> None:
    """One rank's list on its own: complete, and every action after what it depends on.

    For every stage it holds and every microbatch: one ``F``, then either one
    ``B`` or one ``I`` followed by one ``W``; the receives it needs before
    them; the sends after the compute that produces them.
    """
    placement = tuple(range(world)) if placement is None else tuple(placement)
    last = len(placement) - 1
    held = [s for s, r in enumerate(placement) if r == rank]
    done: set[tuple[Kind, int, int]] = set()
    for a in actions:
        s = rank if a.stage is None else a.stage
        if s not in held:
            raise ScheduleError(f"rank {rank}: {a.label()} runs on stage {s}, which rank {rank} does not hold")
        if not 0 <= a.microbatch < microbatches:
            raise ScheduleError(f"rank {rank}: {a.label()} names microbatch {a.microbatch} of {microbatches}")
        if (a.kind, s, a.microbatch) in done:
            raise ScheduleError(f"rank {rank}: {a.label()} appears twice")
        remote = {Kind.SEND_ACT: s + 1, Kind.RECV_GRAD: s + 1, Kind.RECV_ACT: s - 1, Kind.SEND_GRAD: s - 1}
        if a.kind in remote:
            other = remote[a.kind]
            if not 0 <= other <= last:
                raise ScheduleError(f"rank {rank}: {a.label()} talks to a rank outside the pipeline")
            if placement[other] == rank or a.peer != placement[other]:
                raise ScheduleError(f"rank {rank}: {a.label()} should have peer {placement[other]}"
                                    + (" (a stage on this rank: no transfer)" if placement[other] == rank else ""))
        elif a.peer is not None:
            raise ScheduleError(f"rank {rank}: {a.label()} is compute and names a peer")
        mb = a.microbatch
        local_prev = s > 0 and placement[s - 1] == rank
        local_next = s < last and placement[s + 1] == rank
        grad_in = [] if s == last else (
            [(Kind.BACKWARD, s + 1, mb), (Kind.BACKWARD_INPUT, s + 1, mb)] if local_next
            else [(Kind.RECV_GRAD, s, mb)])
        needs: list[list[tuple[Kind, int, int]]] = {  # each inner list: one of them must be done
            Kind.FORWARD: [] if s == 0 else [[(Kind.FORWARD, s - 1, mb)] if local_prev else [(Kind.RECV_ACT, s, mb)]],
            Kind.SEND_ACT: [[(Kind.FORWARD, s, mb)]],
            Kind.BACKWARD: [[(Kind.FORWARD, s, mb)]] + ([grad_in] if grad_in else []),
            Kind.BACKWARD_INPUT: [[(Kind.FORWARD, s, mb)]] + ([grad_in] if grad_in else []),
            Kind.BACKWARD_WEIGHT: [[(Kind.BACKWARD_INPUT, s, mb)]],
            Kind.SEND_GRAD: [[(Kind.BACKWARD, s, mb), (Kind.BACKWARD_INPUT, s, mb)]],
        }.get(a.kind, [])
        for options in needs:
            if not any(n in done for n in options):
                k, st, m = options[0]
                raise ScheduleError(f"rank {rank}: {a.label()} comes before {k.short} of microbatch {m} "
                                    f"on stage {st}")
        if a.kind is Kind.BACKWARD and (Kind.BACKWARD_INPUT, s, mb) in done or \
                a.kind is Kind.BACKWARD_INPUT and (Kind.BACKWARD, s, mb) in done:
            raise ScheduleError(f"rank {rank}: microbatch {mb} on stage {s} has both a whole and a split backward")
        done.add((a.kind, s, a.microbatch))
    want = set()
    for s in held:
        split = any((Kind.BACKWARD_INPUT, s, m) in done for m in range(microbatches))
        kinds = [Kind.FORWARD] + ([Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT] if split else [Kind.BACKWARD])
        if s > 0 and placement[s - 1] != rank:
            kinds += [Kind.RECV_ACT, Kind.SEND_GRAD]
        if s < last and placement[s + 1] != rank:
            kinds += [Kind.SEND_ACT, Kind.RECV_GRAD]
        want |= {(k, s, m) for k in kinds for m in range(microbatches)}
    if done != want:
        show = lambda items: sorted(f"{k.short}{m}s{s}" for k, s, m in items)[:4]  # noqa: E731
        raise ScheduleError(f"rank {rank}: missing {show(want - done)} extra {show(done - want)}")


@dataclass
class Timed:
    """One action placed on an ideal clock (``simulate``); recv waits are its idle time."""
    rank: int
    action: Action
    t0: float
    t1: float


COMPUTE, SEND, RECEIVE = "compute", "send", "receive"  # what an action is (simulate's loop reads only this)
COMPUTES = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


def _steps(given, sched: Schedule) -> list[list[tuple]]:
    """Each rank's actions as ``(COMPUTE, kind index in COMPUTES, stage)`` or ``(SEND | RECEIVE, peer,
    message)``, read once per schedule: the loop comes back to a blocked receive many times, and the planner
    simulates one schedule of tens of thousands of actions at many stage times (a schedule is not changed once
    simulated)."""
    steps = getattr(given, "__dict__", {}).get("_steps")  # kept on the Schedule given (the planner's are cached)
    if steps is None:
        steps = [[(COMPUTE, COMPUTES.index(a.kind), a.stage) if a.kind.is_compute else
                  (SEND if a.kind.is_send else RECEIVE, a.peer, message_of(a)) for a in acts]
                 for acts in sched]
        if isinstance(given, Schedule):
            object.__setattr__(given, "_steps", steps)
    return steps


def simulate(schedule: Schedule | list[list[Action]], forward_time: float | list[float] = 1.0,
             backward_time: float | list[float] = 2.0, comm_time: float = 0.0,
             input_time: float | list[float] | None = None,
             weight_time: float | list[float] | None = None, check: bool = True,
             wire_time: float = 0.0) -> list[list[Timed]]:
    """Run the lists on an ideal machine and return every action's start and end.

    Times may be one number or one per stage (``B`` whole; ``I`` and ``W``
    default to half of it each). Sends take no time on the sender and arrive
    ``comm_time`` later; a receive waits (idle) until its message is there.
    ``wire_time`` (of ``comm_time``) is how long a message holds its sender's
    link: one a rank sends while its link still carries an earlier one
    leaves after it (a link moves one message at a time).
    Raises ScheduleError if a list is inconsistent, if a receive would take
    a message meant for another stage or microbatch (the channel between two
    ranks is first-in-first-out), if some rank can never proceed (deadlock)
    or if a message is never received. The result draws the ideal timeline
    of a schedule. ``check=False`` skips :func:`check_local` on each list (a
    caller replaying a registry builder's schedule many times: the planner).
    """
    return _play(schedule, forward_time, backward_time, comm_time, input_time, weight_time, check, wire_time,
                 record=True)[0]


def finish_times(schedule: Schedule | list[list[Action]], forward_time: float | list[float] = 1.0,
                 backward_time: float | list[float] = 2.0, comm_time: float = 0.0,
                 input_time: float | list[float] | None = None,
                 weight_time: float | list[float] | None = None, check: bool = True,
                 wire_time: float = 0.0) -> list[float]:
    """When each rank finishes, as :func:`simulate` plays the lists (the same arguments, the same errors),
    without keeping a timeline: the planner asks for the makespan of thousands of actions many times."""
    return _play(schedule, forward_time, backward_time, comm_time, input_time, weight_time, check, wire_time,
                 record=False)[1]


def _play(schedule, forward_time, backward_time, comm_time, input_time, weight_time, check, wire_time,
          record: bool) -> tuple[list[list[Timed]], list[float]]:
    """:func:`simulate`'s loop: (the timeline, kept where ``record``; each rank's clock at its end)."""
    sched = as_schedule(schedule)
    world, stages = sched.ranks, sched.stages
    for rank, acts in enumerate(sched if check else ()):
        check_local(acts, rank, world, sched.microbatches, sched.placement)

    def per_stage(t, default):
        t = default if t is None else t
        return list(t) if isinstance(t, (list, tuple)) else [float(t)] * stages

    bwd = per_stage(backward_time, None)
    cost = [per_stage(forward_time, None), bwd, per_stage(input_time, [b / 2 for b in bwd]),  # as COMPUTES
            per_stage(weight_time, [b / 2 for b in bwd])]
    steps = _steps(schedule, sched)
    clock = [0.0] * world
    pos = [0] * world
    channels: dict[tuple[int, int], deque] = {}
    link_free = [0.0] * world  # when each rank's outgoing link has sent what it was given
    timeline: list[list[Timed]] = [[] for _ in range(world)]
    while True:
        progressed = False
        for rank in range(world):
            mine, n = steps[rank], len(steps[rank])
            while pos[rank] < n:
                what, arg, sent = mine[pos[rank]]
                t = clock[rank]
                if what is COMPUTE:  # arg: the kind, sent: the stage
                    clock[rank] = t + cost[arg][sent]
                elif what is SEND:
                    leaves = max(t, link_free[rank])
                    link_free[rank] = leaves + wire_time
                    channels.setdefault((rank, arg), deque()).append((sent, leaves + comm_time))
                else:
                    queue = channels.get((arg, rank))
                    if not queue:
                        break  # blocked: the message has not been sent yet
                    message, ready = queue.popleft()
                    if message != sent:
                        a = sched[rank][pos[rank]]
                        raise ScheduleError(f"rank {rank}: {a.label()} would receive {message[0]} of microbatch "
                                            f"{message[2]} for stage {message[1]} (sends and receives on "
                                            f"{a.peer}->{rank} are out of order)")
                    clock[rank] = max(t, ready)
                if record:
                    timeline[rank].append(Timed(rank, sched[rank][pos[rank]], t, clock[rank]))
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(sched[r]) for r in range(world)):
            break
        if not progressed:
            stuck = [f"rank {r} at {sched[r][pos[r]].label()}" for r in range(world) if pos[r] < len(sched[r])]
            raise ScheduleError("deadlock: " + ", ".join(stuck))
    left = {k: list(q) for k, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages never received: {left}")
    return timeline, clock


def simulated_bubble(timeline: list[list[Timed]]) -> list[float]:
    """Per rank: 1 - compute time / makespan of the simulated step."""
    end = max((t.t1 for row in timeline for t in row), default=0.0)
    if end <= 0:
        return [0.0 for _ in timeline]
    return [1 - sum(t.t1 - t.t0 for t in row if t.action.is_compute) / end for row in timeline]
