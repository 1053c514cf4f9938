"""Pipeline schedules checked as data, without running a model."""
from __future__ import annotations

import pytest

from paralab.analysis.cost import bubble_fraction, in_flight as in_flight_theory, schedule_bubble
from paralab.strategies.pipeline.actions import Action, Kind, ScheduleError
from paralab.strategies.pipeline.schedules import build_schedule, layout_problem
from paralab.strategies.pipeline.simulate import check_local, in_flight, peak_in_flight, simulate, simulated_bubble

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
    r0.remove(Action("send_act", 0, 1, 0))
    r0.insert(r0.index(Action("backward", 0, None, 0)), Action("send_act", 0, 1, 0))
    schedule[0] = r0
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule)


def test_simulation_catches_missing_and_misdirected_actions():
    schedule = build_schedule("1f1b", 3, 4)
    schedule[1] = [a for a in schedule[1] if a != Action("send_grad", 2, 0, 1)]
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


# ---------------------------------------------------------------- zero bubble and interleaved
SPLIT = ("zb-h1", "zb-h2")  # the schedules whose backward is split into I and W
NEW = ([(n, w, m, 1) for n in SPLIT for w in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]
       + [("interleaved-1f1b", w, m, v) for w in (1, 2, 3, 4) for v in (2, 3) for m in (w, 2 * w, 8) if m % w == 0])
NEW_IDS = [f"{n}-p{w}-m{m}-v{v}" for n, w, m, v in NEW]


def compute_order(schedule, rank):
    return [(a.kind, a.stage, a.microbatch) for a in schedule[rank] if a.is_compute]


@pytest.mark.parametrize("name,world,mbs,v", NEW, ids=NEW_IDS)
def test_every_microbatch_f_then_b_then_w_on_every_stage(name, world, mbs, v):
    schedule = build_schedule(name, world, mbs, v)
    assert schedule.stages == world * v
    for rank in range(world):
        order = compute_order(schedule, rank)
        assert sorted(schedule.held(rank)) == [rank + c * world for c in range(v)]
        for s in schedule.held(rank):
            for mb in range(mbs):
                f = order.index((Kind.FORWARD, s, mb))
                if name in SPLIT:
                    i, w = order.index((Kind.BACKWARD_INPUT, s, mb)), order.index((Kind.BACKWARD_WEIGHT, s, mb))
                    assert f < i < w
                    assert (Kind.BACKWARD, s, mb) not in order
                else:
                    assert f < order.index((Kind.BACKWARD, s, mb))
        check_local(schedule[rank], rank, world, mbs, schedule.placement)


@pytest.mark.parametrize("name,world,mbs,v", NEW, ids=NEW_IDS)
def test_new_schedules_pair_up_without_deadlock(name, world, mbs, v):
    schedule = build_schedule(name, world, mbs, v)
    # between any two ranks, the k-th send meets the k-th receive: same kind, stage pair, microbatch
    for src in range(world):
        for dst in range(world):
            sent = [(a.kind.channel, a.stage + (1 if a.kind is Kind.SEND_ACT else -1), a.microbatch)
                    for a in schedule[src] if a.kind.is_send and a.peer == dst]
            got = [(a.kind.channel, a.stage, a.microbatch) for a in schedule[dst] if a.kind.is_recv and a.peer == src]
            assert sent == got
    timeline = simulate(schedule, [1.0 / v] * world * v, [2.0 / v] * world * v)
    assert [len(row) for row in timeline] == [len(a) for a in schedule]


@pytest.mark.parametrize("name,world,mbs,v", NEW, ids=NEW_IDS)
def test_new_schedules_peak_in_flight_matches_the_formula(name, world, mbs, v):
    schedule = build_schedule(name, world, mbs, v)
    peaks = [peak_in_flight(actions) for actions in schedule]
    assert peaks == in_flight_theory(name, world, mbs, v)
    for actions in schedule:
        assert min(in_flight(actions)) >= 0 and in_flight(actions)[-1] == 0
    if name == "zb-h1":  # the memory of 1F1B's busiest stage, on every stage
        assert max(peaks) == max(peak_in_flight(a) for a in build_schedule("1f1b", world, mbs))


@pytest.mark.parametrize("name,world,mbs,v", NEW, ids=NEW_IDS)
def test_new_schedules_ideal_bubble_matches_the_papers(name, world, mbs, v):
    """T_F = 1, T_B = 2 (T_I = T_W = 1) per whole stage; a virtual stage takes 1/v of it."""
    bubbles = simulated_bubble(simulate(build_schedule(name, world, mbs, v), [1.0 / v] * world * v,
                                        [2.0 / v] * world * v))
    formula = schedule_bubble(name, world, mbs, v).parts["fraction"]
    if name in SPLIT and mbs < world:  # the formula holds for m >= p; fewer microbatches idle more
        assert all(formula < b < bubble_fraction(world, mbs).parts["fraction"] or world == 1 for b in bubbles)
    else:
        assert bubbles == pytest.approx([formula] * world)
    if world > 1:  # both beat 1F1B's (p-1)/(m+p-1)
        assert max(bubbles) < bubble_fraction(world, mbs).parts["fraction"]


def test_zb_h2_runs_more_forwards_ahead_and_puts_w_off():
    got = [" ".join(str(a) for a in build_schedule("zb-h2", 3, 4)[r] if a.is_compute) for r in range(3)]
    assert got == ["F0 F1 F2 F3 I0 W0 I1 W1 I2 W2 I3 W3",
                   "F0 F1 F2 I0 F3 I1 W0 I2 W1 I3 W2 W3",
                   "F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3"]
    assert [peak_in_flight(a) for a in build_schedule("zb-h2", 4, 8)] == [7, 7, 7, 7]  # 2p - 1: 1F1B's 4 on stage 0


@pytest.mark.parametrize("world,mbs", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 12)])
def test_zb_h2_idles_only_the_fill_where_zb_h1_idles_more(world, mbs):
    """With I dearer than W (T_F = 1, T_I = 1.2 or 1, T_W = 0.8 or 0.5) ZB-H2's step is the last stage's
    work plus the fill, (p-1) T_F, the least any schedule can take; ZB-H1's is longer. And over a spread
    of times ZB-H2 is never slower than ZB-H1 (its order is built for equal times, so away from them it
    may idle more than the fill)."""
    def makespan(name, t_i, t_w, t_f=1.0):
        timeline = simulate(build_schedule(name, world, mbs), forward_time=t_f, backward_time=t_i + t_w,
                            input_time=t_i, weight_time=t_w)
        return max(t.t1 for row in timeline for t in row)

    for t_i, t_w in ((1.2, 0.8), (1.0, 0.5)):
        work = mbs * (1.0 + t_i + t_w)
        assert makespan("zb-h2", t_i, t_w) == pytest.approx(work + (world - 1) * 1.0)
        assert makespan("zb-h1", t_i, t_w) > makespan("zb-h2", t_i, t_w) + 0.1
    for t_i in (0.5, 1.0, 2.0, 3.0):
        for t_w in (0.25, 1.0, 2.0):
            assert makespan("zb-h2", t_i, t_w) <= makespan("zb-h1", t_i, t_w) + 1e-9


def test_zb_h1_holds_back_w_on_later_stages():
    got = [" ".join(str(a) for a in build_schedule("zb-h1", 3, 4)[r] if a.is_compute) for r in range(3)]
    assert got == ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
                   "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
                   "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"]
    # the weight gradients of each stage are complete only at its last W, which is where a
    # data-parallel flavour's last_backward() goes (executor.py)
    for actions in build_schedule("zb-h1", 3, 4):
        last = [a for a in actions if a.kind.completes_weights][-1]
        assert last.kind is Kind.BACKWARD_WEIGHT and last.microbatch == 3


def test_interleaved_order_megatron():
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    got = [" ".join(a.label() for a in schedule[r] if a.is_compute) for r in range(2)]
    assert got == ["F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 B1s0 B2s2 B3s2 B2s0 B3s0",
                   "F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 F3s1 B1s1 F2s3 B2s3 F3s3 B3s3 B2s1 B3s1"]
    # stage 3 hands its gradient to stage 2 on another rank; stages 1 -> 2 cross too; 0 -> 1 as well
    assert Action(Kind.SEND_ACT, 0, 0, 1) in schedule[1] and Action(Kind.RECV_ACT, 0, 1, 2) in schedule[0]


def test_local_handoff_needs_no_transfer():
    # a one-rank interleaved pipeline: every stage on rank 0, tensors handed over in memory
    schedule = build_schedule("interleaved-1f1b", 1, 2, 3)
    assert not [a for a in schedule[0] if not a.is_compute]
    simulate(schedule)
    bad = list(schedule[0]) + [Action(Kind.SEND_ACT, 0, 0, 0)]
    with pytest.raises(ScheduleError, match="no transfer"):
        check_local(bad, 0, 1, 2, schedule.placement)


def test_w_before_i_is_refused():
    schedule = build_schedule("zb-h1", 2, 2)
    row = list(schedule[1])
    i0, w0 = row.index(Action(Kind.BACKWARD_INPUT, 0, None, 1)), row.index(Action(Kind.BACKWARD_WEIGHT, 0, None, 1))
    row[i0], row[w0] = row[w0], row[i0]
    with pytest.raises(ScheduleError, match="before I of microbatch 0"):
        check_local(row, 1, 2, 2)


@pytest.mark.parametrize("args,message", [
    (("interleaved-1f1b", 2, 4, 1), "--virtual-stages 2 or more"),
    (("interleaved-1f1b", 3, 4, 2), "must be a multiple of the 3 pipeline stages"),
    (("zb-h1", 2, 4, 2), "applies to interleaved-1f1b only"),
    (("dualpipe", 2, 4, 1), "unknown schedule"),
])
def test_impossible_layouts_say_why(args, message):
    assert message in layout_problem(*args)
    if "multiple" not in message:  # m not a multiple of p is refused before start (Pipeline.validate);
        with pytest.raises(ValueError, match=message):  # build_schedule meets it only for a short batch
            build_schedule(args[0], args[1], args[2], args[3])


def test_interleaved_short_batch_runs_gpipe_over_the_layout():
    # an epoch's short last batch may hold fewer microbatches than a multiple of p
    schedule = build_schedule("interleaved-1f1b", 2, 3, 2)
    simulate(schedule)
    assert [peak_in_flight(a) for a in schedule] == [6, 6]


# ---------------------------------------------------------------- calc bubble --schedule
def test_calc_bubble_per_schedule(capsys):
    from paralab.cli import main
    assert main(["calc", "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble = (4-1) / (3x8+4-1) = 3/27" in out and "11.11 %" in out and "Qi et al., ICLR 2024" in out
    assert "alive(k) = min(4, 8) = 4" in out
    assert main(["calc", "bubble", "--schedule", "zb-h2", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "ZB-H2" in out and "bubble = (4-1) / (3x8+4-1) = 3/27" in out and "alive(k) = min(2x4-1, 8) = 7" in out
    assert main(["calc", "bubble", "--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "8",
                 "--virtual-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "bubble = (4-1) / (2x8+4-1) = 3/19" in out and "Narayanan et al., SC 2021" in out
    assert "min(2(4-1-0) + (2-1)x4 + 1, 2x8) = 11" in out
    assert main(["calc", "bubble", "--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "6"]) == 2
    assert "must be a multiple of the 4 pipeline stages" in capsys.readouterr().err


def test_a_senders_link_carries_one_message_at_a_time():
    """GPipe, 2 ranks, 3 microbatches of 0.1 s forwards, each message 1 s (all of it on the wire): rank 0
    sends at 0.1, 0.2 and 0.3, but its link moves one at a time, so they arrive at 1.1, 2.1 and 3.1, not
    1.1, 1.2 and 1.3. With no wire time (a latency) they all travel at once."""
    sched = build_schedule("gpipe", 2, 3)

    def forwards_of_rank_1(**kw):
        timeline = simulate(sched, 0.1, 0.2, 1.0, **kw)
        return [round(x.t0, 9) for x in timeline[1] if x.action.kind is Kind.FORWARD]

    assert forwards_of_rank_1() == [1.1, 1.2, 1.3]
    assert forwards_of_rank_1(wire_time=1.0) == [1.1, 2.1, 3.1]
    assert forwards_of_rank_1(wire_time=0.05) == [1.1, 1.2, 1.3]  # a link faster than the forwards: no queue
