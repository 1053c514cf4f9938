"""End-to-end single-process training: learning, records, determinism, resume."""
import json

import pytest

import torch

from paralab.run.checkpoint import load


def test_synthetic_is_learnable_and_run_directory_is_complete(paralab):
    r = paralab("train", "single", "--num-batches", "100", "--eval-batches", "4", "--lr", "0.05")
    assert r.returncode == 0, r.stderr
    s = r.summary
    for key in ("strategy", "workers", "parameters", "seconds_per_iter", "samples_per_s", "split",
                "comm_bytes", "bus_bandwidth", "test_loss", "test_accuracy", "check"):
        assert key in s
    assert s["strategy"] == "single" and s["workers"] == 1 and s["steps"] == 100
    assert s["final_loss"] < 0.5 * s["first_loss"]
    assert s["test_accuracy"] > 0.5  # chance is 0.1
    split = s["split"]["0"]
    assert split["compute"] > 0 and split["data"] > 0 and split["optimizer"] > 0
    assert abs(split["forward"] + split["backward"] - split["compute"]) < 1e-9
    assert split["comm"] == 0
    assert s["samples_per_s"] > 0 and abs(s["samples_per_s"] * s["seconds_per_iter"] - 32) < 1e-6
    for name in ("config.json", "steps.jsonl", "spans.jsonl", "summary.json", "eval.txt", "trace.json",
                 "checkpoint/step-00000100/rank0.pt", "checkpoint/step-00000100/manifest.json"):
        assert (r.out / name).exists(), name
    assert len(r.rows("steps.jsonl")) == 100
    cfg = json.loads((r.out / "config.json").read_text())
    assert cfg["environment"]["torch"] == torch.__version__
    trace = json.loads((r.out / "trace.json").read_text())
    assert any(e["ph"] == "X" and e["name"].startswith("forward") for e in trace["traceEvents"])
    eval_txt = (r.out / "eval.txt").read_text()
    assert "confusion matrix" in eval_txt and "precision" in eval_txt
    assert "loss" in r.stdout and "step    100/100" in r.stdout


def test_same_seed_same_losses_bit_for_bit(paralab):
    a = paralab("train", "single", "--num-batches", "6", "--log-every", "1")
    b = paralab("train", "single", "--num-batches", "6", "--log-every", "1")
    c = paralab("train", "single", "--num-batches", "6", "--log-every", "1", "--seed", "1")
    assert a.returncode == b.returncode == c.returncode == 0
    la = [row["loss"] for row in a.rows("steps.jsonl")]
    assert la == [row["loss"] for row in b.rows("steps.jsonl")]
    assert la != [row["loss"] for row in c.rows("steps.jsonl")]


def test_resume_is_bit_identical(paralab, tmp_path):
    full = paralab("train", "single", "--num-batches", "6", out=tmp_path / "full")
    first = paralab("train", "single", "--num-batches", "3", out=tmp_path / "first")
    second = paralab("train", "single", "--num-batches", "6", "--resume", str(tmp_path / "first"),
                     out=tmp_path / "second")
    assert full.returncode == first.returncode == second.returncode == 0, second.stderr
    assert "resumed" in second.stdout
    a = load(tmp_path / "full", 0)
    b = load(tmp_path / "second", 0)
    assert a["step"] == b["step"] == 6
    model_a, model_b = a["state"]["model"], b["state"]["model"]
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    # and the resumed run really started where the first stopped
    assert [r["step"] for r in second.rows("steps.jsonl")] == [3, 4, 5]


def test_periodic_checkpoints(paralab, tmp_path):
    r = paralab("train", "single", "--num-batches", "4", "--checkpoint-every", "2")
    assert r.returncode == 0
    assert load(r.out, 0)["step"] == 4


def test_bf16_runs(paralab):
    # --allow-slow-bf16: runs on any CPU (bf16 is refused where the CPU has no bf16 instructions)
    r = paralab("train", "single", "--num-batches", "3", "--precision", "bf16", "--allow-slow-bf16")
    assert r.returncode == 0, r.stderr
    assert r.summary["precision"] == "bf16" and r.summary["final_loss"] == r.summary["final_loss"]


def test_non_finite_loss_stops_and_keeps_records(paralab):
    r = paralab("train", "single", "--num-batches", "30", "--lr", "1e12", "--norm", "none",
                "--momentum", "0")
    assert r.returncode != 0
    assert "non-finite at step" in r.stderr
    steps = r.rows("steps.jsonl")
    assert 0 < len(steps) < 30
    assert r.summary["error"].startswith("loss became non-finite at step")


def test_throughput_counts_the_short_last_batch(paralab):
    # 100 samples, batch 32: the epoch's fourth step has 4 samples
    r = paralab("train", "single", "--synthetic-size", "100", "--num-batches", "4", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    rows = r.rows("steps.jsonl")
    assert [row["samples"] for row in rows] == [32, 32, 32, 4]
    assert r.summary["samples_per_s"] == pytest.approx(100 / sum(row["seconds"] for row in rows))


def test_each_data_parallel_shard_is_evaluated_once():
    """The ranks of one shard (a tp or cp group's, each holding the whole logits; a pipeline's, the last stage
    alone) predict the same samples: each shard's figures are counted once, from a rank that predicted them."""
    from paralab.training.evaluate import once_per_shard
    # dp 2 x tp 2: shard 0 on ranks 0 and 1, shard 1 on ranks 2 and 3; a pipeline's first stage predicts none
    parts = [(0, 5, "a"), (0, 5, "a"), (1, 4, "b"), (1, 4, "b")]
    assert once_per_shard(parts) == [("a",), ("b",)]
    assert once_per_shard([(0, 0, "none"), (0, 6, "last stage")]) == [("last stage",)]
