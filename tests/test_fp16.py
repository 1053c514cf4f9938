"""``--precision fp16``: autocast to float16 with dynamic loss scaling (training/loss_scale.py), checked.

The loss scale is paralab's own (scaled in ``Context.loss``, taken out of the gradients each rank holds in
``Strategy.clip_gradients``, an overflow skipped on every rank); the check's reference uses torch's own
``GradScaler``, and the first test holds the two to the same sequence of scales, skips and weights. Then real
runs: a 2-worker data-parallel check is exact (its shards replayed one by one, each backward at its rank's
scale), other layouts within rounding, a bug a bug, and a resumed run continues the scale where it was.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from paralab.training import loss_scale
from paralab.training.loss_scale import LossScale, torch_scaler


def test_the_loss_scale_is_torchs_gradscaler(monkeypatch):
    """Gradients that overflow now and then, and a growth interval of 3: paralab's scale, its skips and the
    weights it leaves are torch's GradScaler's, step by step."""
    monkeypatch.setattr(loss_scale, "INTERVAL", 3)
    mine, theirs = LossScale(), torch_scaler(torch.device("cpu"))
    theirs.load_state_dict({**theirs.state_dict(), "growth_interval": 3})
    w_mine, w_theirs = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    opt_mine, opt_theirs = (torch.optim.SGD([w], lr=0.5) for w in (w_mine, w_theirs))
    factors = [1.0, 1e34, 1.0, 1.0, 1.0, 1.0, float("inf"), 1.0, 1.0, 1.0, 1.0]  # 1e34 x scale: inf in float32
    scales = []
    for step, factor in enumerate(factors):
        x = torch.tensor([1.0, -2.0, 3.0, 0.5]) * factor
        mine.scaled((w_mine * x).sum()).backward()
        theirs.scale((w_theirs * x).sum()).backward()
        mine.unscale_([w_mine.grad])
        overflow = not torch.isfinite(w_mine.grad).all()
        mine.update(overflow)
        if not overflow:
            opt_mine.step()
        theirs.step(opt_theirs)
        theirs.update()
        opt_mine.zero_grad()
        opt_theirs.zero_grad()
        assert mine.scale == theirs.get_scale(), step
        assert torch.equal(w_mine, w_theirs), step
        scales.append(mine.scale)
    assert scales[1] == scales[0] / 2 and scales[4] == 2 * scales[1]  # it backed off, then grew again
    state = mine.state_dict()
    again = LossScale()
    again.load_state_dict(state)
    assert again == mine and torch_scaler(torch.device("cpu"), state).get_scale() == mine.scale


def test_a_scaled_loss_keeps_its_value_and_scales_its_gradient():
    x = torch.tensor([0.25, 2.0], requires_grad=True)
    loss = (x ** 2).sum()
    scaled = LossScale(scale=1024.0).scaled(loss)
    assert scaled.item() == loss.item()
    scaled.backward()
    assert torch.equal(x.grad, 1024.0 * 2 * x.detach())


# ---------------------------------------------------------------- real runs
CNN = ["--dataset", "synthetic", "--synthetic-size", "256", "--width", "0.125", "--batch-size", "32",
       "--num-batches", "3", "--check", "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64",
       "--precision", "fp16"]
GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--synthetic-size", "256", "--layers", "2", "--embed", "32",
       "--heads", "4", "--context", "16", "--batch-size", "8"]
LAYOUTS = {  # id -> (argv, the verdicts a correct run may get)
    "ddp": (("ddp", "--workers", "2", *CNN), ("exact",)),
    "fsdp3": (("fsdp", "--zero-stage", "3", "--workers", "3", *CNN, "--batch-size", "48"),
              ("exact", "within rounding")),
    "pipeline": (("pipeline", "--workers", "2", "--microbatches", "4", *CNN), ("exact", "within rounding")),
    # PyTorch's pipeline schedule calls the loss itself (ctx.loss: scaled as every layout's)
    "torch-pipeline": (("torch-pipeline", "--workers", "2", "--microbatches", "4", *CNN), ("exact", "within rounding")),
    # clipped, and overflowing at its first step: a skipped step has no gradient norm, on either side
    "clip-overflow": (("ddp", "--workers", "2", *CNN, "--clip-grad", "0.05", "--initial-loss-scale", str(2 ** 24)),
                      ("exact", "within rounding")),
    "tp-gpt": (("tp", "--workers", "2", *CNN, *GPT), ("exact", "within rounding")),
    # a mixture of experts: its load-balancing losses scaled as the loss is, beside it and on a pipeline's stages;
    # at top-2 over 20 steps of 512 tokens rounding crosses a dozen near-ties of the routers, whose choice the
    # reference takes as the run made it (check/routing.py; the check once said bug at such a layout)
    "ep-gpt": (("ddp", "--workers", "2", "--ep", "2", *CNN, *GPT, "--experts", "4", "--top-k", "2", "--context", "32",
                "--batch-size", "16", "--num-batches", "20"), ("exact", "within rounding")),
    "ep-pp-gpt": (("ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", *CNN, *GPT,
                   "--experts", "4"), ("exact", "within rounding")),
    # PowerSGD from the first step, which overflows at the starting scale: its error is kept unscaled and the
    # skipped step leaves Q, the error and its count as they were, in the run and the reference (once refused)
    "powersgd": (("ddp", "--workers", "2", *CNN, "--compress", "powersgd", "--powersgd-start-iter", "0"),
                 ("exact", "within rounding")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pathlib import Path

    from conftest import side_by_side
    example = Path(__file__).resolve().parent.parent / "examples" / "strategies" / "forgot_to_average.py"
    jobs = {k: argv for k, (argv, _) in LAYOUTS.items()} | {"bug": (str(example), "--workers", "2", *CNN)} | {
        f"scale-{s}": ("ddp", "--workers", "2", *CNN, "--initial-loss-scale", str(s)) for s in (1, 2 ** 24)}
    return side_by_side(jobs, tmp_path_factory.mktemp("fp16"))


@pytest.mark.parametrize("key", LAYOUTS)
def test_a_correct_layout_in_fp16_passes(runs, key):
    r = runs[key]
    if key in ("clip-overflow", "powersgd"):
        assert 0 in r.summary["skipped_steps"], r.stdout[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    check = r.summary["check"]
    assert check["precision"] == "fp16" and check["verdict"] in LAYOUTS[key][1], r.stdout[-3000:]
    assert "float32 under fp16 autocast with torch's GradScaler" in r.stdout
    # every step an overflow skipped is in the summary, and each was said as it happened
    skipped = r.summary["skipped_steps"]
    assert all(f"step {s + 1} (steps.jsonl step {s}): the gradient overflowed" in r.stdout for s in skipped)
    if key == "ep-gpt":  # near-ties followed, and said
        assert "check: experts: the reference took the run's choice at " in r.stdout, r.stdout[-3000:]
        assert [line.split(" at ")[0] for line in check["experts_followed"]] == [
            "experts: the reference took the run's choice"]  # every choice it made otherwise, a near-tie


def test_a_bug_in_fp16_is_a_bug(runs):
    r = runs["bug"]
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    check = r.summary["check"]
    assert check["verdict"] == "bug" and check["worst_ratio"] > 10 and "check: FAIL (bug, worst " in r.stdout
    # replayed in fp16, each quantity against its own band: the first gradient backward meets, fp64's place (a
    # step later where the first step overflowed at the starting scale and was skipped by both)
    line = check["first_divergence"]
    assert "rank 0, backward of 13.1 (Linear) weight gradient, max |d| " in line and " x its band" in line, line
    assert float(line.rpartition(", ")[2].split(" x its band")[0]) > 2, line


def test_an_overflow_is_exercised_or_said_not_to_be(runs):
    """--initial-loss-scale 2^24 overflows at the first step (every rank skips it, the reference alike: exact);
    a scale of 1 never overflows, and the check says that path was not exercised and how to reach it."""
    big, small = runs[f"scale-{2 ** 24}"], runs["scale-1"]
    for r in (big, small):
        assert r.returncode == 0 and r.summary["check"]["verdict"] == "exact", r.stdout[-3000:] + r.stderr[-2000:]
    assert 0 in big.summary["skipped_steps"] and "not exercised: fp16" not in big.stdout
    assert small.summary["skipped_steps"] == []
    assert "check: not exercised: fp16: no step's gradient overflowed (the loss scale is 1 now)" in small.stdout
    assert f"a larger --initial-loss-scale (e.g. {2 ** 24})" in small.stdout


def test_a_resumed_fp16_run_continues_its_loss_scale(paralab, tmp_path):
    """Stopped after step 3 and resumed to step 6, a run's losses are an uninterrupted run's bit for bit: the
    checkpoint keeps the scale (halved by step 1's overflow), which a resume starting again at 2^16 would not
    reproduce."""
    argv = ("ddp", "--workers", "2", *CNN[:CNN.index("--check")], "--no-progress", "--precision", "fp16",
            "--lr", "0.05")
    whole = paralab("train", *argv, "--num-batches", "6", out=tmp_path / "whole")
    part = paralab("train", *argv, "--num-batches", "3", out=tmp_path / "part")
    assert whole.returncode == 0 and part.returncode == 0, whole.stderr[-2000:] + part.stderr[-2000:]
    saved = [json.loads(line) for line in (tmp_path / "part" / "steps.jsonl").read_text().splitlines()]
    again = paralab("train", *argv, "--num-batches", "6", "--resume", str(tmp_path / "part"), out=tmp_path / "part")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]

    def losses(r):
        rows = [json.loads(line) for line in (r.out / "steps.jsonl").read_text().splitlines()]
        return sorted((row["step"], row["rank"], row["loss"]) for row in rows)
    assert losses(again) == losses(whole) and all(math.isfinite(loss) for *_, loss in losses(whole))
    assert len(saved) == 6 and len(losses(again)) == 12
    # and the scale each last checkpoint keeps: the same scale and count of good steps (a power of two changes
    # no gradient that neither overflows nor underflows, so the losses alone might not tell)
    from paralab.run import checkpoint
    kept = [checkpoint.load(r.out, rank)["loss_scale"] for r in (whole, again) for rank in (0, 1)]
    assert kept[0] == kept[1] == kept[2] == kept[3] and kept[0][1] > 0


def test_fp16_is_refused_where_it_cannot_be_scaled(paralab):
    """A strategy that computes no whole-model gradient norm cannot take the scale out of what it holds."""
    from paralab.errors import UsageError
    from paralab.run.config import RunConfig, refuse_unclipped
    from paralab.strategies import get_strategy
    unclipped = [name for name in ("torch-dp", "torch-cp") if not get_strategy(name).clips]
    assert unclipped
    for name in unclipped:
        with pytest.raises(UsageError, match=f"--precision fp16 is not supported by strategy '{name}'"):
            refuse_unclipped(RunConfig(strategy=name, precision="fp16"), get_strategy(name), get_strategy(name))
    r = paralab("train", "ddp", "--workers", "2", *CNN, "--initial-loss-scale", "1000")
    assert r.returncode == 2 and "--initial-loss-scale 1000 must be a power of two (e.g. 1024)" in r.stderr
    r = paralab("train", "ddp", "--workers", "2", *CNN[:-2], "--precision", "bf16", "--allow-slow-bf16",
                "--initial-loss-scale", "1024")
    assert r.returncode == 2 and "is fp16's loss scale: give --precision fp16" in r.stderr


# ---------------------------------------------------------------- an overflow the run and the reference decide apart
def _one_step(grad: float, run_skipped: bool, run_state: list):
    from paralab.check.reference import Replay, _scaler_step
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.5)
    scaler = torch_scaler(torch.device("cpu"))
    scaler.scale((w * grad).sum()).backward()
    scaler.unscale_(optimizer)
    how = Replay(scaler=scaler, scales={}, run={0: (run_skipped, run_state)})
    return _scaler_step(how, optimizer, [w], 0), w.detach().clone(), scaler


def test_the_reference_follows_the_runs_overflow_decision_and_says_so():
    """Where the run skipped a step whose gradient was finite in the reference, the reference skips it too and
    takes the run's scale; where the reference overflowed and the run did not, it cannot step and says that
    the two now differ by an update. Agreeing, it is torch's GradScaler alone."""
    (scale, skipped, why), w, scaler = _one_step(1.0, True, [32768.0, 0])
    assert (scale, skipped) == (65536.0, True) and torch.equal(w, torch.ones(2))  # not stepped, as the run
    assert "the run's gradient overflowed at fp16 loss scale 65536" in why and scaler.get_scale() == 32768.0
    (_, skipped, why), w, scaler = _one_step(float("inf"), False, [65536.0, 1])
    assert skipped and "the reference's gradient overflowed" in why and scaler.get_scale() == 65536.0
    assert scaler.state_dict()["_growth_tracker"] == 1  # the run's count of good steps, taken over
    (_, skipped, why), w, scaler = _one_step(1.0, False, [65536.0, 1])
    assert not skipped and why == "" and torch.equal(w, torch.full((2,), 0.5))  # stepped by torch's scaler


def test_a_scale_other_than_torchs_after_an_agreed_step_is_a_bug():
    """The run and the reference agree that step 1 did not overflow, but the run's scale after it is not what
    torch's GradScaler holds: said, the run's taken over, and a bug."""
    from paralab.check.reference import SCALE_DIFFERS
    from paralab.check.verdict import overflowed_too_often
    (_, skipped, why), w, scaler = _one_step(1.0, False, [32768.0, 0])  # torch: 65536 and 1 good step
    assert not skipped and SCALE_DIFFERS in why and "the run's loss scale after it is 32768" in why
    assert scaler.get_scale() == 32768.0 and "loss scale is not torch's" in overflowed_too_often([why])


def test_two_overflows_the_reference_did_not_have_are_a_bug():
    from paralab.check.verdict import overflowed_too_often
    once = ["step 7: the run's gradient overflowed at fp16 loss scale 65536 and the reference's did not: ..."]
    twice = once + ["step 9: the run's gradient overflowed at fp16 loss scale 32768 and the reference's did not: ..."]
    assert overflowed_too_often(once) is None
    assert "at 2 steps (step 7, step 9)" in overflowed_too_often(twice)
    assert overflowed_too_often(once + ["step 9: the reference's gradient overflowed at ..."]) is None
