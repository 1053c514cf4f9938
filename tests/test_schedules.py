"""Pipeline schedules checked as data, without running a model."""
from __future__ import annotations

import pytest

from paralab.analysis.cost import bubble_fraction
from paralab.strategies.pipeline.schedules import (Action, ScheduleError, build_schedule, check_local, in_flight,
                                                   peak_in_flight, simulate, simulated_bubble)

CASES = [(name, w, m) for name in ("gpipe", "1f1b") for w in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name,world,mbs", CASES)
def test_forward_precedes_backward_on_every_stage(name, world, mbs):
    for rank, actions in enumerate(build_schedule(name, world, mbs)):
        kinds = [(a.kind, a.microbatch) for a in actions]
        for mb in range(mbs):
            assert kinds.count(("forward", mb)) == 1 and kinds.count(("backward", mb)) == 1
            assert kinds.index(("forward", mb)) < kinds.index(("backward", mb))
        check_local(actions, rank, world, mbs)


@pytest.mark.parametrize("name,world,mbs", CASES)
def test_sends_and_receives_pair_up_without_deadlock(name, world, mbs):
    schedule = build_schedule(name, world, mbs)
    # every send has exactly one receive on the neighbour, in the same microbatch order
    for rank, actions in enumerate(schedule):
        for send, recv, peer in (("send_act", "recv_act", rank + 1), ("send_grad", "recv_grad", rank - 1)):
            sent = [a.microbatch for a in actions if a.kind == send]
            if not 0 <= peer < world:
                assert not sent
                continue
            got = [a.microbatch for a in schedule[peer] if a.kind == recv and a.peer == rank]
            assert sent == got
    timeline = simulate(schedule)  # raises on a deadlock, a mismatch or an unreceived message
    assert [len(row) for row in timeline] == [len(a) for a in schedule]


@pytest.mark.parametrize("world,mbs", [(w, m) for w in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)])
def test_memory_bound_1f1b_vs_gpipe(world, mbs):
    for rank, actions in enumerate(build_schedule("1f1b", world, mbs)):
        assert peak_in_flight(actions) <= world - rank
        assert peak_in_flight(actions) == min(mbs, world - rank)
        assert min(in_flight(actions)) >= 0 and in_flight(actions)[-1] == 0
    for actions in build_schedule("gpipe", world, mbs):
        assert peak_in_flight(actions) == mbs


@pytest.mark.parametrize("name,world,mbs", CASES)
def test_ideal_bubble_matches_theory(name, world, mbs):
    bubbles = simulated_bubble(simulate(build_schedule(name, world, mbs), forward_time=1.0, backward_time=2.0))
    assert bubbles == pytest.approx([bubble_fraction(world, mbs).parts["fraction"]] * world)


def test_simulation_catches_out_of_order_messages():
    schedule = build_schedule("gpipe", 2, 2)
    # stage 0 sends microbatch 1's activation before microbatch 0's: locally fine, but stage 1's
    # first receive would get the wrong microbatch
    fwd = [Action("forward", 0), Action("forward", 1), Action("send_act", 1, 1), Action("send_act", 0, 1)]
    schedule[0] = fwd + [a for a in schedule[0] if a.kind not in ("forward", "send_act")]
    check_local(schedule[0], 0, 2, 2)
    with pytest.raises(ScheduleError, match="out of order"):
        simulate(schedule)


def test_simulation_catches_deadlock():
    schedule = build_schedule("gpipe", 2, 1)
    # stage 0 waits for the gradient before sending the activation the gradient depends on
    r0 = schedule[0]
    r0.remove(Action("send_act", 0, 1))
    r0.insert(r0.index(Action("backward", 0)), Action("send_act", 0, 1))
    schedule[0] = r0
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule)


def test_simulation_catches_missing_and_misdirected_actions():
    schedule = build_schedule("1f1b", 3, 4)
    schedule[1] = [a for a in schedule[1] if a != Action("send_grad", 2, 0)]
    with pytest.raises(ScheduleError, match="missing"):
        simulate(schedule)
    schedule = build_schedule("1f1b", 3, 4)
    schedule[2] = [Action(a.kind, a.microbatch, 0) if a.kind == "recv_act" else a for a in schedule[2]]
    with pytest.raises(ScheduleError, match="peer"):
        simulate(schedule)


def test_one_f_one_b_order_on_a_middle_stage():
    got = " ".join(str(a) for a in build_schedule("1f1b", 3, 4)[1])
    assert got == ("rA0@0 F0 sA0@2 rA1@0 F1 sA1@2 rG0@2 B0 sG0@0 rA2@0 F2 sA2@2 rG1@2 B1 sG1@0 "
                   "rA3@0 F3 sA3@2 rG2@2 B2 sG2@0 rG3@2 B3 sG3@0")


def test_unknown_schedule_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("interleaved", 2, 4)
