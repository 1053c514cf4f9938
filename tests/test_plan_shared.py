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
    as the ideal simulator's, transfers and unequal stages included."""
    rng = random.Random(0)
    stages = p * v
    F = [rng.uniform(1, 3) for _ in range(stages)]
    B = [2 * f + rng.uniform(0, 1) for f in F]
    sched = build_schedule(name, p, m, v)
    for transfer in (0.0, 0.7):
        ideal = _end(simulate(sched, F, B, transfer))
        end, busy = simulate_shared(sched, F, B, [0.0] * stages, [0.0] * stages, transfer, 1.0)
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
