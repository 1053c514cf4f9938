"""Gradient clipping (``--clip-grad``, issue 38): the whole model's gradient norm under every layout, checked
against torch's own ``clip_grad_norm_`` on the single process at every step, in fp64; and the non-finite guard
that shares its all-reduce (``--on-nonfinite stop|skip``, a NaN injected into one rank's loss).

The norm is small enough (0.05, against norms of about 2) that clipping fires at every step, so the
weights a check compares depend on the norm being right: a norm counted wrong scales every gradient
wrong. Under every layout clipping is checked with dropout and packed documents on too
(tests/test_features_together.py, slow selection). Seeded bugs in the norm (a replicated parameter counted
once per holder, a stage left out) are in tests/test_mutants.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_paralab
from paralab.comm import Comm
from paralab.recorder import Recorder
from paralab.training import grad_norm

GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--synthetic-size", "256", "--layers", "2", "--embed", "32",
       "--heads", "4", "--context", "16", "--batch-size", "16", "--eval-batches", "1", "--eval-batch-size", "16",
       "--precision", "fp64", "--num-batches", "3"]
CLIP = 0.05


def test_a_strategy_without_a_norm_is_refused():
    """torch-dp and torch-cp (CUDA only) compute no whole-model norm yet: --clip-grad and --on-nonfinite are refused
    naming the strategy (what `paralab train` runs before any rank starts)."""
    from paralab.errors import UsageError
    from paralab.run.config import RunConfig, refuse_unclipped
    from paralab.strategies import get_strategy
    for name in ("torch-dp", "torch-cp"):
        cls = get_strategy(name)
        assert not cls.clips
        with pytest.raises(UsageError, match=f"--clip-grad is not supported by strategy '{name}'"):
            refuse_unclipped(RunConfig(strategy=name, clip_grad=1.0), cls, cls)
        with pytest.raises(UsageError, match="--on-nonfinite is not supported"):
            refuse_unclipped(RunConfig(strategy=name, on_nonfinite="stop"), cls, cls)


def norms_recorded(run) -> dict[int, list[float]]:
    """rank -> the gradient norm of each step, as steps.jsonl records it."""
    rows = [json.loads(line) for line in (run.out / "steps.jsonl").read_text().splitlines()]
    out: dict[int, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["step"]):
        out.setdefault(r["rank"], []).append(r.get("grad_norm"))
    return out


def test_the_norm_and_the_clip_are_torchs():
    """One rank holding everything: the norm and the scaled gradients are clip_grad_norm_'s; a copy counted
    per holder (copies 2) adds its square once in total, a per-element count weighs each element."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)]
    expected = [t.clone() for t in grads]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in expected]
    for p, t in zip(params, expected):
        p.grad = t
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 0.5).item()
    comm = Comm(Recorder(0, torch.device("cpu")), 0, 1)
    norm = grad_norm.reduce(comm, grad_norm.square_sum([(t, 1) for t in grads]), torch.device("cpu"))[0]
    assert norm == pytest.approx(torch_norm, rel=1e-15)
    grad_norm.clip_(grads, norm, 0.5)
    for ours, theirs in zip(grads, params):
        assert torch.equal(ours, theirs.grad)
    twice = grad_norm.square_sum([(grads[0], 2), (grads[0], 2), (grads[1], 1)])
    assert twice.item() == pytest.approx(grads[0].pow(2).sum().item() + grads[1].pow(2).sum().item(), rel=1e-15)
    per_element = torch.full_like(grads[1], 4.0)
    per_element[0] = 1.0
    assert grad_norm.square_sum([(grads[1], per_element)]).item() == pytest.approx(
        grads[1][0].item() ** 2 + grads[1][1:].pow(2).sum().item() / 4, rel=1e-15)


def test_clipped_data_parallelism_is_exact_and_records_the_norm(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", *GPT, "--clip-grad", str(CLIP), "--check",
                    out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["max_grad_norm_dev"] <= 1e-12 and check["max_weight_dev"] <= 1e-12, check
    norms = norms_recorded(r)
    assert norms[0] == norms[1], norms          # one all-reduce: every rank the same norm
    assert all(n > 10 * CLIP for n in norms[0])  # clipping fired at every step
    table = run_paralab("plot", "grad-norm", str(tmp_path / "run"))
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()[2:]
    assert len(rows) == 3 and f"{norms[0][0]:.6g}" in rows[0] and all(row.endswith("yes") for row in rows), rows
    png = run_paralab("plot", "grad-norm", str(tmp_path / "run"), "-o", str(tmp_path / "norm.png"))
    assert png.returncode == 0 and (tmp_path / "norm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png.stderr


def losses_recorded(run) -> list[float]:
    rows = [json.loads(line) for line in (run.out / "steps.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def test_a_norm_below_the_clip_is_left_as_it_is(tmp_path):
    """A clip far above the norm changes nothing: the run's losses are an unclipped run's, bit for bit."""
    clipped = run_paralab("train", "single", *GPT, "--clip-grad", "1e6", out=tmp_path / "clipped")
    plain = run_paralab("train", "single", *GPT, out=tmp_path / "plain")
    assert clipped.returncode == 0 and plain.returncode == 0, clipped.stderr[-2000:] + plain.stderr[-2000:]
    assert losses_recorded(clipped) == losses_recorded(plain)
    assert all(n is not None and n < 1e6 for n in norms_recorded(clipped)[0])
    assert all(n is None for n in norms_recorded(plain)[0])  # no --clip-grad: no norm computed, none recorded
    checked = run_paralab("train", "single", *GPT, "--clip-grad", "1e6", "--check", out=tmp_path / "checked")
    assert checked.returncode == 0 and "check: PASS" in checked.stdout, checked.stderr[-2000:]
    assert "check: not exercised: --clip-grad 1e+06 never clipped" in checked.stdout
    refused = run_paralab("plot", "grad-norm", str(tmp_path / "plain"), "-o", str(tmp_path / "none.png"))
    assert refused.returncode == 2 and "train with --clip-grad NORM" in refused.stderr, refused.stderr
    assert not (tmp_path / "none.png").exists()


def rows_by_step(run) -> dict[int, list[dict]]:
    rows = [json.loads(line) for line in (run.out / "steps.jsonl").read_text().splitlines()]
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["step"], []).append(r)
    return out


def test_a_nan_on_one_rank_stops_every_rank_in_that_step_naming_it(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", *GPT, "--num-batches", "5", "--on-nonfinite", "stop",
                    out=tmp_path / "run", env={"PARALAB_FAULT": "1:2:nan"})
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "step 3 (steps.jsonl step 2): the loss is not finite on rank 1;" in r.stderr
    assert "the loss is not finite on rank 1" in r.summary["error"]
    assert sorted(rows_by_step(r)) == [0, 1]  # neither rank finished step 2: both stopped before its update


def test_skip_skips_the_update_on_every_rank(tmp_path):
    """A NaN loss on rank 1 at the last of 3 steps, skipped: the model is the one 2 plain steps leave."""
    skipped = run_paralab("train", "ddp", "--workers", "2", *GPT, "--on-nonfinite", "skip", out=tmp_path / "skip",
                          env={"PARALAB_FAULT": "1:2:nan"})
    two = run_paralab("train", "ddp", "--workers", "2", *GPT, "--num-batches", "2", out=tmp_path / "two")
    assert skipped.returncode == 0 and two.returncode == 0, skipped.stderr[-2000:] + two.stderr[-2000:]
    assert "every rank skipped its update" in skipped.stdout
    assert skipped.summary["skipped_steps"] == [2]
    assert [r.get("skipped", False) for r in rows_by_step(skipped)[2]] == [True, True]
    assert skipped.summary["test_loss"] == two.summary["test_loss"]  # the same weights, bit for bit


@pytest.mark.slow
def test_clipping_at_the_fp32_course_setting(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", *GPT, "--precision", "fp32", "--lr", "0.001",
                    "--clip-grad", str(CLIP), "--check", out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.summary["check"]["max_grad_norm_dev"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout,rank", [(["pipeline", "--workers", "2", "--microbatches", "2"], 1),
                                         (["fsdp", "--workers", "2", "--zero-stage", "3"], 0),
                                         (["tp", "--workers", "2", "--sequence-parallel"], 0)],
                         ids=["pipeline (the loss on the last stage)", "fsdp zero-3", "tp sp"])
def test_the_guard_under_other_layouts(layout, rank, tmp_path):
    stop = run_paralab("train", layout[0], *GPT, "--num-batches", "4", "--on-nonfinite", "stop", *layout[1:],
                       out=tmp_path / "stop", env={"PARALAB_FAULT": f"{rank}:1:nan"})
    assert stop.returncode == 3 and f"the loss is not finite on rank {rank}" in stop.stderr, stop.stderr[-2000:]
    assert sorted(rows_by_step(stop)) == [0]
    skip = run_paralab("train", layout[0], *GPT, "--on-nonfinite", "skip", *layout[1:], out=tmp_path / "skip",
                       env={"PARALAB_FAULT": f"{rank}:2:nan"})
    two = run_paralab("train", layout[0], *GPT, "--num-batches", "2", *layout[1:], out=tmp_path / "two")
    assert skip.returncode == 0 and two.returncode == 0, skip.stderr[-2000:] + two.stderr[-2000:]
    assert skip.summary["skipped_steps"] == [2] and skip.summary["test_loss"] == two.summary["test_loss"]
