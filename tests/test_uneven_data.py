"""A dataset that does not divide over the data-parallel replicas: padding (noted) or --drop-last.

205 synthetic samples, global batch 40, 2 workers: without --drop-last an epoch is 6 steps and
its last step pads each replica to 103 samples by repeating one (rank 0 says so); with
--drop-last an epoch is 205 // 40 = 5 full steps, none repeated, and the run equals
``single --drop-last`` step for step (``--norm none``: no BatchNorm, so the split of a batch over
replicas changes nothing but rounding).
"""
import pytest

UNEVEN = ["--synthetic-size", "205", "--batch-size", "40", "--epochs", "1", "--norm", "none", "--lr", "0.01",
          "--log-every", "1", "--eval-batches", "2"]


def losses(result) -> list[float]:
    """Each step's loss over the whole global batch (the replicas' shards are equal: the mean)."""
    by_step: dict[int, list[float]] = {}
    for row in result.rows("steps.jsonl"):
        by_step.setdefault(row["step"], []).append(row["loss"])
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


def samples(result) -> list[int]:
    by_step: dict[int, int] = {}
    for row in result.rows("steps.jsonl"):
        by_step[row["step"]] = by_step.get(row["step"], 0) + row["samples"]
    return [v for _, v in sorted(by_step.items())]


def test_padding_is_noted(paralab):
    r = paralab("train", "ddp", "--workers", "2", *UNEVEN)
    assert r.returncode == 0, r.stderr
    assert samples(r) == [40] * 5 + [6]  # 5 real samples + 1 repeated in the epoch's last step
    assert r.stdout.count("paralab: note:") == 1  # rank 0, once
    assert "205 training samples do not divide over 2 data-parallel replicas" in r.stdout
    assert "this run trains on 1 repeated sample(s)" in r.stdout


def test_drop_last_equals_a_single_process(paralab):
    dp = paralab("train", "ddp", "--workers", "2", *UNEVEN, "--drop-last", "--check")
    one = paralab("train", "single", *UNEVEN, "--drop-last")
    assert dp.returncode == 0 and one.returncode == 0, dp.stderr + one.stderr
    assert samples(dp) == samples(one) == [40] * 5  # 205 // 40 full steps, as documented
    assert "repeated" not in dp.stdout and "repeated" not in one.stdout
    assert "--drop-last: each epoch is 5 step(s) of 40 samples; the last 5" in dp.stdout
    assert dp.summary["check"]["result"] == "PASS"
    assert losses(dp) == pytest.approx(losses(one), abs=1e-5)
    assert dp.summary["test_loss"] == pytest.approx(one.summary["test_loss"], abs=1e-5)
