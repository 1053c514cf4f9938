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
