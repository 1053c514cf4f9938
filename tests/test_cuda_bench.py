"""bench/gpu_check.py's parts that need no GPU: MFU's FLOP count and peak table, and its refusal without one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402


def test_step_flops_counts_forward_and_backward():
    one = gpu_check.step_flops("vgg11", 1.0, 1)
    # VGG-11 on 32x32 inputs: about 153 M multiply-adds forward (8 convs + classifier), so one
    # training step (forward + backward = 3 x forward) is about 0.92 GFLOP per sample
    assert 0.85e9 < one < 1.0e9
    assert gpu_check.step_flops("vgg11", 1.0, 4) == 4 * one  # linear in the batch


def test_peak_table():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494.7e12
    assert gpu_check.peak_flops("NVIDIA H200", "fp32") == 67e12
    assert gpu_check.peak_flops("Tesla T4", "fp32") is None  # unknown: no MFU rather than a guess


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_says_no_gpu_and_runs_nothing():
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "no CUDA device visible, so nothing was run" in p.stderr and "still owed" in p.stderr


def test_matmul_ramp_times_a_blocks_four_gemms_at_their_shapes(tmp_path):
    """bench/matmul.py (gpu_check's step 5) on this CPU: each row is one of a block's GEMMs at the shape the
    width and tensor degree give it (the MLP's up matrix 4 h / t wide, ...), its FLOPs 2 m n k; a width that
    t does not divide is left out; the JSON names the device."""
    import json
    import matmul
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, str(BENCH / "matmul.py"), "--tokens", "8", "--widths", "16", "20",
                        "--tp", "1", "8", "--repeats", "2", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["kind"] == "cpu" and d["device"] and d["peak_flops"] is None
    rows = {(r["gemm"], r["width"], r["tp"]): r for r in d["rows"]}
    assert len(rows) == 3 * 4 and ("qkv", 20, 8) not in rows  # 20 over 8 ranks does not divide
    assert (rows[("up", 16, 8)]["k"], rows[("up", 16, 8)]["n"]) == (16, 8)
    assert (rows[("down", 16, 8)]["k"], rows[("down", 16, 8)]["n"]) == (8, 16)
    assert (rows[("qkv", 20, 1)]["k"], rows[("qkv", 20, 1)]["n"]) == (20, 60)
    for r in d["rows"]:
        assert r["flops"] == 2 * r["m"] * r["k"] * r["n"] and r["seconds"] > 0
        assert r["flops_per_s"] == pytest.approx(r["flops"] / r["seconds"])
    assert matmul.shape("proj", 8, 16, 8) == (8, 2, 16)
    assert d["cluster_matmul"] == []  # no peak known for a CPU: no fraction, no ramp
    rows = [{"flops": 4, "fraction_of_peak": 0.5}, {"flops": 2, "fraction_of_peak": 0.2},
            {"flops": 4, "fraction_of_peak": 0.7}, {"flops": 4, "fraction_of_peak": 0.6}]
    assert matmul.ramp(rows) == [[2, 0.2], [4, 0.6]]  # a cluster file's matmul: by FLOPs, the median


def test_matmul_ramp_refuses_bad_input_and_a_missing_gpu():
    bad = subprocess.run([sys.executable, str(BENCH / "matmul.py"), "--widths", "0"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "positive integers" in bad.stderr
    if not torch.cuda.is_available():
        none = subprocess.run([sys.executable, str(BENCH / "matmul.py"), "--device", "cuda"], capture_output=True,
                              text=True, timeout=300)
        assert none.returncode == 2 and "no CUDA device" in none.stderr
