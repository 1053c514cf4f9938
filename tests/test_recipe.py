"""The language-model recipe (issue 38, in part): AdamW and a warm-up + cosine schedule, under the layouts and
through a resharded resume, checked exactly as everything else (fp64, docs/correctness.md)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_paralab
from paralab.check.reference import TorchSchedule
from paralab.training.lr_schedule import LRSchedule, lr_at

GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--synthetic-size", "512", "--layers", "2", "--embed", "32", "--heads", "4",
       "--context", "16", "--batch-size", "16", "--eval-batches", "1", "--eval-batch-size", "16",
       "--precision", "fp64"]
# warm-up 2 steps (an epoch of 512 windows is 32 steps of 16), then down to a floor of 1e-3
RECIPE = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1", "--lr-schedule", "cosine",
          "--warmup-epochs", "0.0625", "--min-lr", "0.001"]


def torch_rates(lr: float, warmup: int, total: int, min_lr: float) -> list[float]:
    """The same schedule from torch's own schedulers: LinearLR from lr / warmup up to lr over the warm-up,
    then CosineAnnealingLR down to min_lr."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=min_lr)
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[warmup])
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("lr,warmup,total,min_lr", [(0.1, 4, 20, 0.0), (3e-4, 10, 100, 3e-5), (1.0, 2, 4, 0.5)])
def test_the_cosine_schedule_is_torchs(lr, warmup, total, min_lr):
    ours = [lr_at(s, lr=lr, scaling="none", global_batch=1, warmup_epochs=warmup, steps_per_epoch=1,
                  schedule="cosine", min_lr=min_lr, total_steps=total) for s in range(total)]
    assert ours == pytest.approx(torch_rates(lr, warmup, total, min_lr), rel=1e-12, abs=1e-15)
    assert ours[warmup] == lr and min_lr < ours[-1] < ours[warmup]


# (lr, --lr-scaling, global batch, --warmup-epochs, steps an epoch, --lr-schedule, --min-lr, steps): warm-ups of
# 0, whole and fractional steps, a linear scaling that raises the rate (batch 512) and one that lowers it (16)
SCHEDULES = [LRSchedule(lr, scaling, batch, warm, 5, kind, floor, 40)
             for lr in (0.1, 3e-4) for scaling in ("none", "linear") for batch in (16, 512)
             for warm in (0, 0.2, 1, 0.5, 2.5) for kind, floor in (("constant", 0.0), ("cosine", 0.0), ("cosine", 1e-5))]


def test_the_references_schedule_is_torchs_and_the_runs_is_the_same():
    """The reference's rates come from torch's schedulers (check/reference.py), the run's from its own code: the
    same at every step, warm-ups up or down, whole or fractional; a cosine warm-up of a fractional number of steps
    is one torch's schedulers cannot express (the reference then takes the run's)."""
    compared = 0
    for schedule in SCHEDULES:
        whole = float(schedule.warmup_steps).is_integer()
        assert TorchSchedule.expressible(schedule) == (schedule.kind == "constant" or whole)
        if not TorchSchedule.expressible(schedule):
            continue
        theirs = TorchSchedule(schedule)
        for step in range(schedule.total_steps + 3):  # (a constant schedule holds past its steps)
            if schedule.kind == "cosine" and step >= schedule.total_steps:
                break
            assert theirs(step) == pytest.approx(schedule(step), rel=1e-12), (schedule, step)
            compared += 1
    assert compared > 2500
    ramp = LRSchedule(0.1, "linear", 512, 0.5, 5, "constant")  # 2.5 steps from 0.1 up to 0.2, then held
    assert [TorchSchedule(ramp)(s) for s in range(4)] == pytest.approx([0.1, 0.14, 0.18, 0.2])


def test_a_fractional_cosine_warm_up_is_said_to_be_shared(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", "--dataset", "synthetic", "--synthetic-size", "256",
                    "--width", "0.125", "--batch-size", "16", "--num-batches", "4", "--lr-schedule", "cosine",
                    "--warmup-epochs", "0.1", "--eval-batches", "1", "--check", out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the reference takes the run's own learning-rate schedule (a cosine warm-up of 1.6 steps" in r.stdout


def rates_recorded(run) -> list[float]:
    rows = [json.loads(line) for line in (run.out / "steps.jsonl").read_text().splitlines()]
    return [r["lr"] for r in sorted(rows, key=lambda r: r["step"]) if r["rank"] == 0]


def test_adamw_with_a_cosine_schedule_is_exact_under_data_parallelism(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", *GPT, *RECIPE, "--num-batches", "8", "--check",
                    out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["precision"] == "fp64" and check["max_weight_dev"] <= 1e-12, check
    rates = rates_recorded(r)  # the rate each step used, as steps.jsonl records it
    assert rates == [lr_at(s, lr=0.01, scaling="none", global_batch=16, warmup_epochs=0.0625, steps_per_epoch=32,
                           schedule="cosine", min_lr=0.001, total_steps=8) for s in range(8)]
    assert rates[:3] == pytest.approx([0.005, 0.01, 0.01]) and rates[2:] == sorted(rates[2:], reverse=True)
    assert 0.001 < rates[-1] < 0.002  # 1e-3 + 9e-3 (1 + cos(5 pi / 6)) / 2


LAYOUTS = [
    ["single"], ["gather-scatter", "--workers", "2", "--accumulate", "2"], ["torch-ddp", "--workers", "2"],
    ["fsdp", "--workers", "2", "--zero-stage", "1"], ["fsdp", "--workers", "3", "--zero-stage", "3", "--batch-size", "18"],
    ["fsdp", "--workers", "4", "--zero-stage", "2", "--replicate", "2"], ["torch-fsdp", "--workers", "2"],
    ["tp", "--workers", "2", "--sequence-parallel"], ["torch-tp", "--workers", "2"],
    ["pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "zb-h1"],
    ["cp", "--workers", "2", "--cp-method", "ring"],
    ["allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2"],
    ["ddp", "--workers", "4", "--tp", "2", "--pp", "2", "--microbatches", "2"],
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda a: " ".join(a))
def test_adamw_with_a_cosine_schedule_is_exact(layout, tmp_path):
    r = run_paralab("train", layout[0], *GPT, *RECIPE, "--num-batches", "4", "--check", *layout[1:],
                    out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["precision"] == "fp64" and check["max_weight_dev"] <= 1e-12, check


@pytest.mark.slow
def test_a_cosine_run_resumes_resharded_to_finish_its_steps(tmp_path):
    """fsdp stops after step 4 with a checkpoint of step 3; ddp finishes its 8 steps from there (AdamW's moments
    and step counts resharded, the schedule where it was) and its check against one process trained all 8
    steps PASSes; asking the resumed run for 10 steps instead is refused (a cosine's rates depend on its
    length)."""
    args = [*GPT, *RECIPE, "--num-batches", "8", "--checkpoint-every", "3"]
    stopped = run_paralab("train", "fsdp", "--workers", "2", "--zero-stage", "3", *args, out=tmp_path / "run",
                          env={"PARALAB_FAULT": "0:4"})
    assert stopped.returncode != 0 and "injected fault" in stopped.stderr
    longer = run_paralab("train", "ddp", "--workers", "2", *GPT, *RECIPE, "--num-batches", "10", "--resume",
                         str(tmp_path / "run"), out=tmp_path / "longer")
    assert longer.returncode == 2 and "a cosine run resumes only to finish the steps it was started with" in \
        longer.stderr, longer.stderr
    resumed = run_paralab("train", "ddp", "--workers", "2", *args, "--resume", str(tmp_path / "run"), "--check",
                          out=tmp_path / "resumed")
    assert resumed.returncode == 0 and "check: PASS" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr
    assert "at step 3" in resumed.stdout and resumed.summary["check"]["max_weight_dev"] <= 1e-12
    assert rates_recorded(resumed)[-1] == pytest.approx(lr_at(7, lr=0.01, scaling="none", global_batch=16,
                                                              warmup_epochs=0.0625, steps_per_epoch=32,
                                                              schedule="cosine", min_lr=0.001, total_steps=8))
