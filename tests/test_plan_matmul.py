"""A matmul ramp measured on the device (a cluster file's ``matmul``, as ``bench/matmul.py`` prints it): the
planner times a gpt's weight matmuls at the fraction of the peak their size reached, the rest at the one
``efficiency``. Without a ramp nothing changes; a flat ramp at ``efficiency`` changes nothing either; a ramp
that rises with size makes the layouts of small matmuls slower, by exactly the sum over those matmuls."""
from __future__ import annotations

import dataclasses

import pytest

from paralab.analysis.plan import PRESETS, Layout, Setting, gpt_workload, predict
from paralab.analysis.plan.predict import arithmetic_seconds

A100 = PRESETS["a100-sxm"]
LAYOUTS = [Layout(dp=32, tp=1, pp=1, microbatch=1, microbatches=16, recompute="full"),
           Layout(dp=8, tp=4, pp=1, microbatch=2, microbatches=8, sp=True, recompute="selective"),
           Layout(dp=4, tp=2, pp=4, microbatch=1, microbatches=32, schedule="1f1b")]


def ramp(*points):
    return dataclasses.replace(A100, matmul=tuple(points))


def test_the_ramp_is_interpolated_in_log_flops_and_held_at_its_ends():
    c = ramp((1e9, 0.3), (1e11, 0.7))
    assert c.matmul_efficiency(1e9) == 0.3 and c.matmul_efficiency(1e11) == 0.7
    assert c.matmul_efficiency(1e10) == pytest.approx(0.5)  # halfway in log FLOPs
    assert c.matmul_efficiency(1e6) == 0.3 and c.matmul_efficiency(1e15) == 0.7  # not extrapolated
    assert A100.matmul_efficiency(1e10) == A100.efficiency  # no ramp: the one efficiency


def test_the_weight_matmuls_are_the_blocks_parameter_flops():
    """What ``Workload.matmuls`` lists is the blocks' and head's weight matrices; what it leaves to the one
    efficiency is attention's scores (4 s^2 h per block and sequence) and the biases and LayerNorms."""
    for mlp, kv in (("gelu", 0), ("swiglu", 8)):
        w = gpt_workload(8, 4096, 32, 2048, 51200, ffn_hidden=11008 if mlp == "swiglu" else 0, kv_heads=kv, mlp=mlp)
        n = len(w.units)
        for t, C, b in ((1, 1, 1), (4, 2, 2)):
            named = sum(f * k for f, k in w.matmuls(0, n, t, C, b))
            scores = 8 * 4.0 * 2048 ** 2 * 4096 * b / (t * C)
            rest = b * w.rank_flops(0, n, t, C) - named - scores
            assert 0 < rest < 1e-3 * named  # biases and LayerNorms only
    assert gpt_workload(2, 64, 2, 16, 100, experts=4, top_k=2).matmuls(1, 2, 1, 1, 1) == (
        (2 * 16 * 64 * 192, 1), (2 * 16 * 64 * 64, 1))  # a MoE block: attention's only; its experts at efficiency


@pytest.mark.parametrize("lay", LAYOUTS, ids=[x.label() for x in LAYOUTS])
def test_a_flat_ramp_at_the_efficiency_predicts_what_none_does(lay):
    w = gpt_workload(24, 2304, 24, 2048, 51200)
    plain = predict(w, lay, A100, Setting(512))
    flat = predict(w, lay, ramp((1e6, A100.efficiency), (1e15, A100.efficiency)), Setting(512))
    assert flat.step == pytest.approx(plain.step, rel=1e-12) and flat.memory == plain.memory


def test_a_rising_ramp_slows_the_small_matmuls_by_their_own_sum():
    """Half the efficiency below 30 GFLOP, the preset's above: a stage's arithmetic grows by exactly the
    small matmuls' FLOPs at the lower rate, and splitting the same model over more tensor ranks (smaller
    matmuls) loses more than with one efficiency."""
    w = gpt_workload(24, 2304, 24, 2048, 51200)
    n, rate = len(w.units), A100.rate("bf16")
    rising = ramp((3e10 - 1, 0.3), (3e10, 0.6))
    for t in (1, 8):
        flops = w.rank_flops(0, n, t, 1)
        small = sum(f * k for f, k in w.matmuls(0, n, t, 1, 1) if f < 3e10)
        assert 0 < small < flops  # at t = 1 the output projection (21.7 GFLOP), at t = 8 every matmul
        got = arithmetic_seconds(w, rising, 0, n, t, 1, 1, flops, rate, "bf16")
        assert got == pytest.approx(flops / rate + small / (0.3 * A100.peak("bf16")) - small / rate)
    one = Layout(dp=32, tp=1, pp=1, microbatch=1, microbatches=16)
    eight = Layout(dp=4, tp=8, pp=1, microbatch=1, microbatches=128)
    slower = [predict(w, x, rising, Setting(512)).compute / predict(w, x, A100, Setting(512)).compute
              for x in (one, eight)]
    assert 1 < slower[0] < slower[1]


def test_a_cluster_file_with_a_ramp_plans_and_says_so(tmp_path):
    """The ramp as bench/matmul.py prints it, in a TOML cluster file: the plan's cluster line names it."""
    from conftest import run_paralab
    f = tmp_path / "measured.toml"
    f.write_text('source = "a100 with a ramp measured by bench/matmul.py"\nmemory_gb = 80\nmemory_gbs = 2039\n'
                 "devices_per_node = 8\nintra_gbps = 2400\nintra_latency_us = 5\ninter_gbps = 200\n"
                 "inter_latency_us = 10\nefficiency = 0.6\nmatmul = [[1e9, 0.35], [1e11, 0.62], [1e12, 0.78]]\n"
                 "[peak_tflops]\nbf16 = 312\n")
    r = run_paralab("plan", "--model", "gpt", "--layers", "4", "--embed", "1024", "--heads", "8", "--context", "1024",
                    "--workers", "8", "--cluster", str(f), "--global-batch", "32", "--top", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "a measured ramp, 0.35 to 0.78 by size" in r.stdout
