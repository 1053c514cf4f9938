"""Partitioning a model into contiguous stages: the cut, the refusals, the boundary tensors, the command."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from paralab.cli import main
from paralab.errors import UsageError
from paralab.models import build_model
from paralab.strategies.pipeline.partition import (analyze_partition, boundary_shapes, measure_unit_times, parse_spec,
                               partition_model, sample_batch, split_costs)


def brute_force_max(costs, parts):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_split_costs_minimises_the_slowest_stage():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random()]) for _ in range(n)]
        ranges = split_costs(costs, parts)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
        assert max(sum(costs[a:b]) for a, b in ranges) == pytest.approx(brute_force_max(costs, parts))


def test_split_costs_gives_every_stage_a_unit_that_trains():
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(2, 9)
        flags = [rng.random() < 0.6 for _ in range(n)]
        parts = rng.randint(1, max(1, sum(flags)))
        costs = [rng.random() for _ in range(n)]
        ranges = split_costs(costs, parts, flags)
        assert len(ranges) == parts and ranges[-1][1] == n
        if sum(flags) >= parts:
            assert all(any(flags[a:b]) for a, b in ranges)
    # the cut on costs alone would put the slow pooling unit in a stage of its own
    costs, flags = [5.0, 4.0, 1.0, 1.0, 1.0], [True, False, True, True, True]
    assert split_costs(costs, 3) == [(0, 1), (1, 2), (2, 5)]
    assert split_costs(costs, 3, flags) == [(0, 1), (1, 3), (3, 5)]
    # fewer units train than there are stages: the flags are set aside
    assert split_costs([1.0, 1.0, 1.0], 3, [True, False, False]) == [(0, 1), (1, 2), (2, 3)]


def test_a_slow_pooling_unit_never_becomes_a_stage():
    """On some CPUs a maxpool at full resolution times above the small convolutions beside it; the
    balanced cut of VGG-11 over 4 stages then isolated it, and its rank failed with an empty optimizer."""
    model = build_model("vgg11", width=0.125)
    held = [sum(p.numel() for p in unit.parameters()) for unit in model]
    times = [0.3, 0.25, 0.2, 0.1, 0.2, 0.2, 0.02, 0.1, 0.1, 0.01, 0.05, 0.05, 0.01, 0.01]
    alone = [split_costs(times, stages) for stages in (2, 3, 4, 6, 9)]  # on the times alone:
    assert not all(sum(held[a:b]) for ranges in alone for a, b in ranges)  # some stage holds pooling only
    for method in ("balanced", "params"):
        for stages in (2, 3, 4, 6, 9):
            ranges = partition_model(model, stages, method, unit_times=times)
            assert all(sum(held[a:b]) for a, b in ranges), (method, stages, ranges)


def test_methods():
    model = build_model("vgg11", width=0.125)
    assert len(model) == 14
    assert partition_model(model, 3, "2,3,9") == [(0, 2), (2, 5), (5, 14)]
    by_params = partition_model(model, 2, "params")
    counts = [sum(p.numel() for i in range(a, b) for p in model[i].parameters()) for a, b in by_params]
    assert by_params[0][0] == 0 and by_params[-1][1] == 14
    assert max(counts) < sum(counts)  # both stages hold parameters
    # balanced on given unit times: the one expensive unit gets a stage of its own
    times = [1.0] * 14
    times[5] = 20.0  # conv 32->32
    ranges = partition_model(model, 3, "balanced", unit_times=times)
    assert (5, 6) in ranges
    # balanced on measured times: a valid contiguous cut
    measured = measure_unit_times(model, sample_batch(4), repeats=1)
    assert len(measured) == 14 and all(t >= 0 for t in measured)
    ranges = partition_model(model, 4, "balanced", sample_input=sample_batch(4))
    assert len(ranges) == 4 and ranges[-1][1] == 14


def test_measuring_leaves_the_model_untouched():
    model = build_model("vgg11", width=0.125)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_unit_times(model, sample_batch(4), repeats=1)
    boundary_shapes(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training


@pytest.mark.parametrize("spec,workers,message", [
    ("balanced", 15, "cannot split a model of 14 units over 15 stages"),
    ("2,3", 3, "gives 2 stage(s) but there are 3 workers"),
    ("2,3,4", 3, "adds up to 9 units; the model has 14"),
    ("0,7,7", 3, "at least one unit"),
    ("fast", 2, "--partition must be"),
])
def test_refusals(spec, workers, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(spec, workers, 14)


def test_boundaries_vgg11():
    model = build_model("vgg11", width=0.125)
    info = analyze_partition(model, [(0, 2), (2, 5), (5, 14)], batch=32, unit_times=[1.0] * 14)
    # after conv(3->8) and a pool: 8 channels at 16x16; after conv(8->16), pool, conv(16->32): 32 at 8x8
    b0, b1 = info.boundaries
    assert b0.activation_shape == (32, 8, 16, 16) and b0.activation_bytes == 32 * 8 * 16 * 16 * 4
    assert b1.activation_shape == (32, 32, 8, 8)
    assert b0.gradient_shape == b0.activation_shape and b0.gradient_bytes == b0.activation_bytes
    assert [s.time_share for s in info.stages] == pytest.approx([2 / 14, 3 / 14, 9 / 14])
    assert sum(s.parameters for s in info.stages) == sum(p.numel() for p in model.parameters())
    assert info.bytes_per_step == 2 * (b0.activation_bytes + b1.activation_bytes)


def test_partition_command(capsys):
    assert main(["partition", "--model", "vgg11", "--workers", "3", "--batch-size", "16", "--width", "0.125",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "stage" in out and "0 -> 1" in out and "1 -> 2" in out and "time %" in out
    assert main(["partition", "--workers", "2", "--batch-size", "8", "--width", "0.125", "--partition", "4,10",
                 "--repeats", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranges"] == [[0, 4], [4, 14]]
    assert data["boundaries"][0]["activation_shape"] == [8, 16, 8, 8]
    assert main(["partition", "--workers", "3", "--partition", "1,2"]) == 2
    assert "gives 2 stage(s)" in capsys.readouterr().err
