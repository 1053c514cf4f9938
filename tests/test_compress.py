"""--compress (strategies/compression/): the arithmetic, the bytes on the wire, --check against a
reference that applies the same compression, torch-ddp's PyTorch hooks, and the refusals."""
from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.strategies.compression import (ReferenceCompression, compressible, initial_q, matrix_shape,
                                            orthonormalize_)


def options(compress="powersgd", rank=1, start=0):
    return SimpleNamespace(compress=compress, powersgd_rank=rank, powersgd_start_iter=start)


# ---------------------------------------------------------------------------- the arithmetic
def test_gram_schmidt_gives_orthonormal_columns():
    p = torch.randn(50, 4, dtype=torch.float64)
    orthonormalize_(p)
    assert torch.allclose(p.t() @ p, torch.eye(4, dtype=torch.float64), atol=1e-12)


def test_which_tensors_powersgd_compresses():
    assert matrix_shape(torch.Size([64, 32, 3, 3])) == (64, 288)
    assert compressible(torch.Size([64, 32, 3, 3]), 1) and compressible(torch.Size([64, 32, 3, 3]), 4)
    assert not compressible(torch.Size([64]), 1)               # biases, BatchNorm: sent as they are
    assert not compressible(torch.Size([10, 4]), 2)           # 40 numbers; P and Q would be 28 (not half)
    assert compressible(torch.Size([10, 40]), 2)              # 400 vs 100
    q1, q2 = initial_q(torch.Size([8, 5]), 2, torch.float32), initial_q(torch.Size([8, 5]), 2, torch.float32)
    assert q1.shape == (5, 2) and torch.equal(q1, q2)          # the same on every rank


def test_fp16_reference_rounds_each_share_and_the_sum():
    ref = ReferenceCompression(options("fp16"), 2)
    a = torch.tensor([1.0 + 2 ** -12, 3.0e-8, 1000.1])
    b = torch.tensor([2 ** -12, 0.0, 0.05])
    out = ref.combine([[a], [b]])[0]
    expected = (a.half().float() + b.half().float()).half().float()
    assert torch.equal(out, expected) and not torch.equal(out, a + b)


def test_powersgd_error_feedback_loses_nothing_over_time():
    """Error feedback: what was sent so far plus what the ranks still owe equals the exact sum of every
    step's gradients (sum_t approx_t + sum_r e_r = sum_t sum_r g_r,t), whatever the rank."""
    torch.manual_seed(0)
    ref = ReferenceCompression(options(rank=1, start=0), 3)
    sent = torch.zeros(30, 20, dtype=torch.float64)
    exact = torch.zeros_like(sent)
    for _ in range(5):
        grads = [torch.randn(30, 20, dtype=torch.float64) for _ in range(3)]
        out = ref.combine([[g] for g in grads])[0]
        sent += out
        exact += sum(grads)
        assert torch.linalg.matrix_rank(out) == 1            # rank-1 messages, not the gradient itself
    owed = sum(ref.error[(r, 0)] for r in range(3))
    assert torch.allclose(sent + owed, exact, atol=1e-10)
    assert (sent - exact).abs().max() > 1e-3                   # the compression really dropped something


def test_powersgd_starts_after_the_uncompressed_phase():
    ref = ReferenceCompression(options(rank=1, start=2), 2)
    grads = [[torch.randn(30, 20, dtype=torch.float64)] for _ in range(2)]
    for step in range(3):
        out = ref.combine(grads)[0]
        exact = grads[0][0] + grads[1][0]
        assert torch.equal(out, exact) == (step < 2)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes, message", [
    (dict(strategy="allreduce", compress="fp16"), "only ddp and torch-ddp compress"),
    (dict(strategy="ddp", compress="zip"), "--compress must be one of"),
    (dict(strategy="ddp", compress="powersgd", powersgd_rank=0), "--powersgd-rank must be at least 1"),
    (dict(strategy="ddp", compress="fp16", check=True, workers=3, batch_size=24), "gloo's ring order"),
    (dict(strategy="torch-ddp", compress="fp16", check=True), "reference replays only our ddp's"),
    (dict(strategy="torch-ddp", compress="powersgd", powersgd_start_iter=1), "at least 2"),
])
def test_refused_before_start(changes, message):
    cfg = RunConfig(dataset="synthetic", **{"workers": 2, "batch_size": 32, **changes})
    with pytest.raises(UsageError, match=message):
        cfg.validate()


# ---------------------------------------------------------------------------- runs
def weights(run) -> dict:
    from paralab.run.checkpoint import checkpoint_path
    return torch.load(checkpoint_path(run.out, 0), weights_only=True)["state"]["model"]


def allreduce_bytes(run) -> float:
    return run.summary["comm_ops"]["all_reduce"]["bytes_per_step"]


def model_shapes() -> list[torch.Size]:
    from paralab.models import build_model
    from conftest import FAST
    width = float(FAST[FAST.index("--width") + 1])
    return [p.shape for p in build_model("vgg11", width=width, norm="batch", num_classes=10).parameters()]


def test_ddp_fp16_is_checked_exactly_and_sends_half_the_bytes(paralab):
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "3", "--compress", "fp16", "--check")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check: --compress fp16 changes the arithmetic" in r.stdout + r.stderr
    check = r.summary["check"]
    assert check["result"] == "PASS" and check["max_weight_dev"] == 0.0, check
    numbers = sum(s.numel() for s in model_shapes())
    assert allreduce_bytes(r) == 2 * numbers                       # every gradient crossed as 2 bytes
    assert r.summary["strategy_details"]["0"]["compress"] == "fp16"


def test_ddp_powersgd_is_checked_against_the_same_low_rank_arithmetic(paralab):
    common = ("train", "ddp", "--workers", "2", "--num-batches", "3", "--precision", "fp64")
    r = paralab(*common, "--compress", "powersgd", "--powersgd-rank", "2", "--powersgd-start-iter", "1", "--check")
    assert r.returncode == 0, r.stderr[-3000:]
    check = r.summary["check"]
    assert check["result"] == "PASS" and check["max_weight_dev"] <= 1e-9, check
    assert "the same low-rank arithmetic" in r.stdout + r.stderr
    # the bytes on the wire in the measured steps (1 and 2; step 0 is uncompressed and warm-up): per
    # tensor (n + m) x 2 numbers (P and Q) where PowerSGD compresses it, all of it elsewhere, 8 B each
    shapes = model_shapes()
    sent = sum(sum(matrix_shape(s)) * 2 if compressible(s, 2) else s.numel() for s in shapes)
    assert allreduce_bytes(r) == 8 * sent
    assert sent < sum(s.numel() for s in shapes) / 3
    assert r.summary["strategy_details"]["0"]["elements_sent_last_step"]["p"] > 0
    # the control: the compressed run ends far from plain ddp, so a reference that ignored the
    # compression would have failed the check by orders of magnitude
    plain = paralab(*common)
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = weights(r), weights(plain)
    dev = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    assert dev > 1e-6, dev


def test_torch_ddp_runs_pytorchs_hooks_on_gloo(paralab):
    r = paralab("train", "torch-ddp", "--workers", "2", "--num-batches", "2", "--compress", "bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    numbers = sum(s.numel() for s in model_shapes())
    assert allreduce_bytes(r) == 2 * numbers                       # bf16 through our hook, counted
    r = paralab("train", "torch-ddp", "--workers", "2", "--num-batches", "4", "--compress", "powersgd",
                "--powersgd-start-iter", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert math.isfinite(r.summary["final_loss"]), r.summary     # PowerSGD ran, nothing diverged (NaN or inf)


def test_train_help_lists_the_compression_options():
    out = subprocess.run([sys.executable, "-m", "paralab", "train", "--help"], capture_output=True, text=True).stdout
    for flag in ("--compress", "--powersgd-rank", "--powersgd-start-iter", "--network"):
        assert flag in out


@pytest.mark.slow
def test_ddp_powersgd_over_three_replicas_differs_from_the_reference_by_rounding_only(paralab):
    """Beyond 2 replicas gloo sums P and Q in its ring order, the reference in rank order: in fp64 the
    difference stays at rounding level, inside the check's tolerance."""
    r = paralab("train", "ddp", "--workers", "3", "--batch-size", "24", "--num-batches", "3", "--precision", "fp64",
                "--compress", "powersgd", "--powersgd-start-iter", "1", "--check")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.summary["check"]["result"] == "PASS", r.summary["check"]
