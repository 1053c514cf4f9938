"""A matmul ramp measured on the device (a cluster file's ``matmul``, as ``bench/matmul.py`` prints it): the
planner times a gpt's weight matmuls at the fraction of the peak their size reached, the rest at the one
``efficiency``. Without a ramp nothing changes; a flat ramp at ``efficiency`` changes nothing either; a ramp
that rises with size makes the layouts of small matmuls slower, by exactly the sum over those matmuls."""
from __future__ import annotations

import dataclasses

import pytest

from paralab.analysis.plan import PRESETS, Layout, Setting, gpt_workload, predict
from paralab.analysis.plan.predict import arithmetic_seconds

A100 = PRESETS["a100-sxm-datasheet"]  # one efficiency, no ramp (the a100-sxm preset has its fitted ramp)
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
    assert "a ramp, 0.35 to 0.78 by size" in r.stdout


# ------------------------------------------------------------------ the Hopper presets' ramp, from published figures
def _published_gemms():
    import csv
    from pathlib import Path
    lines = (Path(__file__).parents[1] / "docs" / "data" / "xla-sm90-bf16-gemm.csv").read_text().splitlines()
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    return [(int(r["m"]), int(r["n"]), int(r["k"]), float(r["tflops"])) for r in rows]


def test_the_hopper_presets_carry_the_ramp_of_the_published_sm90_table():
    """The OpenXLA authors' sm_90 table (125 single bf16 GEMMs, m, n, k from 256 to 4096): per size the median
    fraction of the H100's dense peak, up to where it reaches the presets' 0.6. The presets hold that ramp,
    rounded; the A100 datasheet preset, for which no such table was found, keeps the one efficiency, and the
    a100-sxm preset (and its 40 GB variant) the ramp fitted to measured runs (analysis/measured.py)."""
    from paralab.analysis.plan.cluster import HOPPER_GEMMS, gemm_ramp
    gemms = _published_gemms()
    assert len(gemms) == len({g[:3] for g in gemms}) == 125  # the whole 5 x 5 x 5 grid, each shape once
    derived = gemm_ramp(gemms, 989.4, 0.6)
    assert len(derived) == len(HOPPER_GEMMS)
    for (f, e), (g, d) in zip(derived, HOPPER_GEMMS):
        assert f == pytest.approx(g, rel=1e-3) and e == pytest.approx(d, abs=1e-4)
    assert derived[-1][1] == 0.6 and all(e < 0.6 for _, e in derived[:-1])
    largest = max(t for *_, t in gemms)  # the table's best (a 4096^3 GEMM) is over the ceiling: a run sustains less
    assert largest / 989.4 > 0.75
    for name in ("h100-sxm", "h800", "h200"):
        assert PRESETS[name].matmul == HOPPER_GEMMS and "kDefaultMatmulPTable" in PRESETS[name].source
    for name in ("a100-sxm-datasheet", "cpu"):
        assert PRESETS[name].matmul is None
    from paralab.analysis.measured import ramp
    fitted = PRESETS["a100-sxm"]
    assert PRESETS["a100-40gb"].matmul == fitted.matmul
    half = fitted.matmul[0][0] * (fitted.efficiency / fitted.matmul[0][1] - 1) / 1e9  # e = E f / (f + half)
    assert [e for _, e in fitted.matmul] == pytest.approx([e for _, e in ramp(fitted.efficiency, half)], rel=1e-9)


def test_gemm_ramp_is_the_median_per_size_cut_at_the_ceiling():
    """Three sizes, the middle one by three shapes: its median, then where the line meets the ceiling."""
    from paralab.analysis.plan.cluster import gemm_ramp
    gemms = [(1, 1, 1, 10.0), (2, 1, 1, 20.0), (1, 2, 1, 40.0), (1, 1, 2, 30.0), (2, 2, 1, 90.0)]
    ramp = gemm_ramp(gemms, 100.0, 0.5)
    assert ramp[:2] == ((2.0, 0.1), (4.0, 0.3))  # 2 m n k FLOPs; the median of 0.2, 0.4, 0.3
    assert ramp[2][1] == 0.5 and ramp[2][0] == pytest.approx(4.0 * 2 ** ((0.5 - 0.3) / (0.9 - 0.3)))
    assert gemm_ramp(gemms, 100.0, 0.05) == ()  # already over the ceiling at the smallest size


def test_on_an_h100_large_matmuls_keep_the_efficiency_and_small_ones_slow_down():
    """The GPT-3 175B's weight matmuls at tp 8 are all over 14.5 GFLOP: its prediction is the one-efficiency
    one to the last digit. A 1.3B model at tp 8 has a block's matmuls of 2.1 to 8.6 GFLOP: slower, by its own matmuls.
    An fp32 plan does not use a 16-bit ramp."""
    h100 = PRESETS["h100-sxm"]
    flat = dataclasses.replace(h100, matmul=None)
    big = gpt_workload(96, 12288, 96, 2048, 51200)
    lay = Layout(dp=8, tp=8, pp=16, microbatch=1, microbatches=16, schedule="1f1b", recompute="full")
    assert all(f > 1.453e10 for f, _ in big.matmuls(0, len(big.units), 8, 1, 1))
    assert predict(big, lay, h100, Setting(128)).step == predict(big, lay, flat, Setting(128)).step
    small = gpt_workload(24, 2048, 16, 2048, 51200)
    lay = Layout(dp=4, tp=8, pp=1, microbatch=1, microbatches=32, recompute="full")
    assert all(f < 1e10 for f, _ in small.matmuls(1, 2, 8, 1, 1))
    slower = predict(small, lay, h100, Setting(128)).compute / predict(small, lay, flat, Setting(128)).compute
    assert slower > 1.1
    fp32 = Setting(128, precision="fp32")
    assert predict(small, lay, h100, fp32).step == predict(small, lay, flat, fp32).step


def test_the_h200_measured_cluster_file_is_the_preset_with_the_ramp_the_gpu_measured():
    """examples/clusters/h200-measured.toml: every figure the h200 preset's but the ramp, which is the one
    bench/results/gpu-matmul.json holds (measured on a lent H200); with it the planner times a small gpt's
    matmuls faster than the presets' capped table does (the device reached more than 0.6)."""
    import json
    from pathlib import Path

    from paralab.analysis.plan.cluster import load_cluster
    root = Path(__file__).resolve().parent.parent
    mine = load_cluster(str(root / "examples" / "clusters" / "h200-measured.toml"))
    measured = json.loads((root / "bench" / "results" / "gpu-matmul.json").read_text())
    assert measured["device"] == "NVIDIA H200" and [list(p) for p in mine.matmul] == measured["cluster_matmul"]
    preset = PRESETS["h200"]
    skip = {"name", "source", "matmul"}
    assert {f.name: getattr(mine, f.name) for f in dataclasses.fields(mine) if f.name not in skip} == \
        {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset) if f.name not in skip}
    work = gpt_workload(24, 2048, 16, 2048, 50257)
    setting = Setting(512, "mixed", "adam")
    lay = Layout(dp=64, tp=1, pp=1, microbatch=8, microbatches=1, zero=3, replicate=8)
    assert predict(work, lay, mine, setting).compute < predict(work, lay, preset, setting).compute
