"""The planner's pipeline on workers that share cores (analysis/plan/shared_cores.py)."""
from __future__ import annotations

import random

import pytest

from paralab.analysis.plan.shared_cores import simulate_shared
from paralab.strategies.pipeline.schedules import build_schedule
from paralab.strategies.pipeline.simulate import simulate


def _end(timeline) -> float:
    return max(x.t1 for row in timeline for x in row)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1),
                                        ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 4, 1)])
def test_without_crowding_it_is_the_ideal_machine(name, p, m, v):
    """A crowding of 1 never slows a rank down (k of n computing: 1 / max(1, k / n) = 1): the same step
    as the ideal simulator's, transfers (with and without their senders' links queueing them) and unequal
    stages included."""
    rng = random.Random(0)
    stages = p * v
    F = [rng.uniform(1, 3) for _ in range(stages)]
    B = [2 * f + rng.uniform(0, 1) for f in F]
    sched = build_schedule(name, p, m, v)
    for transfer, wire in ((0.0, 0.0), (0.7, 0.0), (0.7, 0.6)):
        ideal = _end(simulate(sched, F, B, transfer, wire_time=wire))
        end, busy = simulate_shared(sched, F, B, [0.0] * stages, [0.0] * stages, transfer, 1.0, wire=wire)
        assert end == pytest.approx(ideal, rel=1e-9)
        assert max(busy) == pytest.approx(max(sum(F[s] + B[s] for s in range(stages) if s % p == r) * m
                                              for r in range(p)), rel=1e-9)


def test_a_rank_alone_runs_at_the_speed_of_one_alone():
    """One microbatch through 2 stages: one rank computes at a time, so each unit takes its all-at-once
    time divided by the crowding (here 2 workers on 1 core: crowding 2)."""
    sched = build_schedule("gpipe", 2, 1, 1)
    F, B = [1.0, 2.0], [2.0, 4.0]
    end, busy = simulate_shared(sched, F, B, [0.0, 0.0], [0.0, 0.0], 0.0, 2.0)
    assert end == pytest.approx(sum(F + B) / 2)
    assert busy == pytest.approx([1.5, 3.0])


def test_ranks_computing_together_share_the_cores_and_fixed_parts_do_not():
    """Two workers on one core (crowding 2) take two microbatches through 2 stages: the core is never idle,
    so the step is the work at the speed of one alone (6 s), where the ideal machine's step at the
    all-at-once times is 9 s; a fixed part (a collective) holds its rank but leaves the core to the other."""
    sched = build_schedule("gpipe", 2, 2, 1)
    F, B = [1.0, 1.0], [2.0, 2.0]
    quick, busy = simulate_shared(sched, F, B, [0.0, 0.0], [0.0, 0.0], 0.0, 2.0)
    assert quick == pytest.approx(6.0) and _end(simulate(sched, F, B, 0.0)) == pytest.approx(9.0)
    slow, _ = simulate_shared(sched, F, B, [0.5, 0.5], [0.0, 0.0], 0.0, 2.0)
    assert quick < slow < quick + 4 * 0.5  # the fixed parts overlap the other rank's compute, in part


def test_each_send_and_receive_costs_its_rank_processor_time():
    """One microbatch through 2 stages with 0.1 s of processor per send and per receive (and 0.3 s on the
    wire): the step crosses 4 of them and 2 transfers in turn, F0 .1 | .3 | .1 F1 B1 .1 | .3 | .1 B0; that
    time is not computing. With 2 workers on 1 core, a send's processor time shares the core like compute."""
    sched = build_schedule("gpipe", 2, 1, 1)
    F, B = [1.0, 1.0], [2.0, 2.0]
    end, busy = simulate_shared(sched, F, B, [0.0, 0.0], [0.0, 0.0], 0.3, 1.0, host=0.1)
    assert end == pytest.approx(6.0 + 4 * 0.1 + 2 * 0.3) and busy == pytest.approx([3.0, 3.0])
    # two microbatches, crowding 2: rank 0 sends microbatch 0's activation (0.1 s of the core) while ...
    two, _ = simulate_shared(build_schedule("gpipe", 2, 2, 1), F, B, [0.0] * 2, [0.0] * 2, 0.0, 2.0, host=0.1)
    none, _ = simulate_shared(build_schedule("gpipe", 2, 2, 1), F, B, [0.0] * 2, [0.0] * 2, 0.0, 2.0)
    # ... the core is never idle either way, so the step grows by the 8 actions' processor time exactly
    assert two == pytest.approx(none + 8 * 0.1)


def test_the_planner_charges_the_same_host_time_with_and_without_shared_cores():
    """A pipeline's step on this machine: with a crowding of 1 (the shared-core replay) and of 0 (the ideal
    simulator, host time folded into each stage's forward and backward) the same; and the measured
    per-action time adds to the step, at least the critical path's sends and receives."""
    import dataclasses

    from paralab.analysis.plan import Setting, gpt_workload
    from paralab.analysis.plan.cluster import PRESETS
    from paralab.analysis.plan.layouts import Layout
    from paralab.analysis.plan.predict import predict
    work = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    lay = Layout(1, 1, 2, schedule="gpipe", microbatch=4, microbatches=1)
    base = dataclasses.replace(PRESETS["cpu"], collectives=None)
    host = dataclasses.replace(base, p2p_overhead_us=500.0)
    ideal, shared = (predict(work, lay, dataclasses.replace(host, crowding=c), Setting(4, "fp32", "sgd-momentum"))
                     for c in (0.0, 1.0))
    plain = predict(work, lay, base, Setting(4, "fp32", "sgd-momentum"))
    assert shared.step == pytest.approx(ideal.step, rel=1e-9)
    assert ideal.step == pytest.approx(plain.step + 4 * 500e-6, rel=1e-9)  # m = 1: all 4 on the critical path
