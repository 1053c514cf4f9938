"""The planner's measured collectives (analysis/plan/collectives.py) and the step terms that use them."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from paralab.analysis.plan import Setting, gpt_workload
from paralab.analysis.plan.cluster import PRESETS, load_cluster
from paralab.analysis.plan.collectives import OPS, group_sizes, fitted, measure, sizes_for
from paralab.analysis.plan.layouts import Layout
from paralab.analysis.plan.predict import buckets_of, ddp_exposed, predict, replicated_sums
from paralab.errors import UsageError


def test_a_call_is_the_line_fitted_to_every_measured_size():
    line = [[1000, 1.0], [2000, 1.5], [4000, 2.5], [8000, 4.5]]  # 0.5 s + 1 s per 2000 bytes
    assert fitted(line, 3000) == pytest.approx(2.0) and fitted(line, 16000) == pytest.approx(8.5)
    assert fitted(line, 10) == 1.0                          # never under the fastest measured call
    # a tail at one size (its mean 3 s over the line) moves the fit there by less than it, and elsewhere too
    tail = [[1000, 1.0], [2000, 1.5], [4000, 5.5], [8000, 4.5]]
    assert 2.5 < fitted(tail, 4000) < 5.5 and fitted(tail, 1000) > 1.0
    assert fitted([[1000, 2.0]], 5000) == 2.0
    assert fitted([[1000, 2.0], [2000, 1.0]], 5000) == 1.5  # no negative bandwidth: the mean, at least the fastest


def test_cluster_uses_measured_calls_else_the_ring():
    base = PRESETS["a100-sxm"]
    link = base.link(2)
    ring = base.collective("all_reduce", 8e6, 4, link)
    gbps, lat = link
    assert ring == pytest.approx(2 * 3 / 4 * 8e6 / (gbps * 1e9 / 8) + 6 * lat)
    assert base.collective("all_gather", 8e6, 4, link) == pytest.approx(
        base.collective("reduce_scatter", 8e6, 4, link)) == pytest.approx(3 / 4 * 8e6 / (gbps * 1e9 / 8) + 3 * lat)
    assert base.collective("send", 8e6, 2, link) == pytest.approx(8e6 / (gbps * 1e9 / 8) + lat)
    assert base.collective("all_reduce", 8e6, 1, link) == 0.0
    measured = dataclasses.replace(base, collectives={"all_reduce": {"4": [[1e6, 0.01], [1e7, 0.05]]}})
    # three calls of 2 MB each: 3 x the fitted call (two points: the line through them)
    assert measured.collective("all_reduce", 6e6, 4, link, calls=3) == pytest.approx(3 * (0.01 + 0.04 / 9))
    not_measured = measured.collective("all_reduce", 6e6, 2, link)
    assert not_measured == base.collective("all_reduce", 6e6, 2, link)


def test_cluster_file_collectives_checked(tmp_path):
    fields = {k: v for k, v in dataclasses.asdict(PRESETS["a100-sxm"]).items() if k != "collectives"}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(fields | {"collectives": {"all_reduce": {"2": [[4096, 0.001], [65536, 0.002]]}}}))
    assert load_cluster(str(good)).collectives["all_reduce"]["2"][1] == [65536, 0.002]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(fields | {"collectives": {"all_reduce": {"2": [0.001, 1e-9]}}}))
    with pytest.raises(UsageError, match="collectives must map"):
        load_cluster(str(bad))


def _brute(sizes, seconds, backward):
    total, ready, end = sum(sizes), 0.0, 0.0
    for size, t in zip(sizes, seconds):
        ready += size
        end = max(end, backward * ready / total) + t
    return max(end - backward, 0.0)


def test_ddp_buckets_closed_form_equals_the_bucket_by_bucket_order():
    rng = random.Random(0)
    assert buckets_of(3.5e6) == [(1, 2 ** 20), (1, 3.5e6 - 2 ** 20)]
    for grad in (5e5, 3e6, 1.2e8, 7.7e8):
        runs = buckets_of(grad)
        assert sum(n * s for n, s in runs) == pytest.approx(grad)
        for backward in (1e-3, 0.05, 2.0):
            seconds = [rng.uniform(1e-3, 0.05) for _ in runs]
            sizes = [s for n, s in runs for _ in range(n)]
            each = [t for (n, _), t in zip(runs, seconds) for _ in range(n)]
            assert ddp_exposed(runs, seconds, backward) == pytest.approx(_brute(sizes, each, backward))
    # the last bucket launched cannot overlap anything: at least its own time is exposed
    assert ddp_exposed([(1, 1.0), (1, 3.0)], [0.01, 0.03], 10.0) == pytest.approx(0.03)


def test_sequence_parallel_pays_for_its_replicated_parameters():
    work = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    cluster = dataclasses.replace(PRESETS["a100-sxm"], collectives={
        "all_reduce_burst": {"2": [[4096, 0.001]]}})
    link = cluster.link(2)
    # 6 per block (two LayerNorms' weight and bias, two row-parallel biases) + the head's LayerNorm; the first
    # stage also sums its position table
    whole = replicated_sums(work, 0, len(work.units), cluster, 2, link, 4)
    assert whole == pytest.approx((6 * 4 + 2) * 0.001 + cluster.collective("all_reduce", 64 * 128 * 4, 2, link))
    assert replicated_sums(work, 1, 3, cluster, 2, link, 4) == pytest.approx(12 * 0.001)
    setting = Setting(16, "fp32", "sgd-momentum")
    sp = predict(work, Layout(1, 2, 1, sp=True, microbatch=16), cluster, setting)
    plain = predict(work, Layout(1, 2, 1, microbatch=16), cluster, setting)
    assert sp.tp_comm > plain.tp_comm


def test_zero_under_a_pipeline_waits_for_every_stage_reduce_scatter():
    work = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    cluster, setting = PRESETS["a100-sxm"], Setting(16, "fp32", "sgd-momentum")
    one = predict(work, Layout(2, 1, 2, zero=1, schedule="1f1b", microbatch=2, microbatches=4), cluster, setting)
    two = predict(work, Layout(2, 1, 2, zero=2, schedule="1f1b", microbatch=2, microbatches=4), cluster, setting)
    # ZeRO-1 reduce-scatters after the step's backward on each rank; ZeRO-2 inside the last backward, so the
    # drain also waits for the other stage's
    assert two.dp_comm > one.dp_comm


@pytest.mark.slow
def test_collectives_measured_between_chunks_of_compute():
    """Four processes on loopback: every group size, operation and size timed; what the cluster reads."""
    got = measure(4, 8.0, repeats=2)
    assert group_sizes(4) == [2, 4] and got["sizes"] == sizes_for(8.0) and len(got["sizes"]) == 4
    seen = {(r["op"], r["group"]) for r in got["rows"]}
    assert seen == {(op, g) for op in OPS for g in (2, 4)} | {
        ("all_reduce_burst", 2), ("all_reduce_burst", 4)}
    assert all(r["seconds"] > 0 for r in got["rows"])
    for by in got["points"].values():
        for pts in by.values():
            assert [b for b, _ in pts] == sorted(b for b, _ in pts)


def test_a_split_backward_walks_the_activation_gradients_twice():
    """paralab's W is autograd from each unit's output to its weights: it computes the activation gradients
    again, so a zero-bubble step computes F + 1.5 B per microbatch where 1F1B computes F + B."""
    work = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    cluster, setting = PRESETS["a100-sxm"], Setting(16, "fp32", "sgd-momentum")
    plain = predict(work, Layout(1, 1, 2, schedule="1f1b", microbatch=2, microbatches=8), cluster, setting)
    zb = predict(work, Layout(1, 1, 2, schedule="zb-h1", microbatch=2, microbatches=8), cluster, setting)
    assert zb.compute == pytest.approx(plain.compute * (1 + 2 * 1.5) / 3)


def test_context_parallel_messages_twice_under_a_split_backward():
    """Both passes of a zero-bubble backward walk back through the attention: its backward messages go twice
    (as calc cp counts them where a run's records show a split backward)."""
    work = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    cluster, setting = PRESETS["a100-sxm"], Setting(16, "fp32", "sgd-momentum")
    for method in ("ring", "all-to-all"):
        slow = dataclasses.replace(cluster, inter_gbps=0.01, intra_gbps=0.01)  # the messages outlast the attention
        one = predict(work, Layout(1, 1, 2, schedule="1f1b", microbatch=2, microbatches=4, cp=2, cp_method=method),
                      slow, setting)
        zb = predict(work, Layout(1, 1, 2, schedule="zb-h1", microbatch=2, microbatches=4, cp=2, cp_method=method),
                     slow, setting)
        forward, backward = (1, 3) if method == "ring" else (4, 4)  # messages per block and microbatch
        assert zb.cp_comm / one.cp_comm == pytest.approx((forward + 2 * backward) / (forward + backward), rel=0.02)
