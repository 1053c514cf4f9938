"""--max-restarts: a group that crashed starts again from the run's last checkpoint, and the finished run
equals one that was never interrupted, bit for bit (fp64, lr 0.1 with momentum)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FAST

EXACT = ["--precision", "fp64", "--lr", "0.1", "--num-batches", "6", "--checkpoint-every", "2"]


def losses(out) -> list:
    """Every rank's loss at every step: steps.jsonl, and the steps before the last resume."""
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return sorted([[r["rank"], r["step"], r["loss"]] for r in rows] + summary.get("losses_before_resume", []))


def state(out, world: int) -> list[dict]:
    """Every rank's final checkpointed state (weights, BatchNorm buffers, optimizer state)."""
    from paralab.run.checkpoint import checkpoint_path
    return [torch.load(checkpoint_path(out, r), weights_only=True)["state"] for r in range(world)]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


LAYOUTS = {
    "ddp": (["ddp", "--workers", "2"], 2),
    "fsdp3": (["fsdp", "--workers", "2", "--zero-stage", "3"], 2),
    "pipeline": (["pipeline", "--workers", "2", "--microbatches", "2", "--partition", "params"], 2),  # a fixed cut
    "3d": (["ddp", "--workers", "8", "--pp", "2", "--tp", "2", "--microbatches", "2", "--partition", "params",
            "--model", "gpt", "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "2",
            "--context", "16"], 8),
}


@pytest.mark.parametrize("layout,faults", [
    ("ddp", "1:3:kill:1,0:5:raise:2"),   # SIGKILL in the first start, an exception in the second
    ("fsdp3", "0:2:oom:1"),             # an out-of-memory-style exit (137) in a sharded run
    ("pipeline", "1:4:kill:1"),
    pytest.param("3d", "5:3:kill:1", marks=pytest.mark.slow),  # dp 2 x pp 2 x tp 2: 8 ranks on 2 cores
], ids=["ddp-kill-then-raise", "fsdp3-oom", "pipeline-kill", "3d-kill"])
def test_a_restarted_run_equals_one_never_interrupted(paralab, layout, faults):
    args, world = LAYOUTS[layout]
    plain = paralab("train", *args, *EXACT)
    assert plain.returncode == 0, plain.stderr[-3000:]
    r = paralab("train", *args, *EXACT, "--max-restarts", "2", env={"PARALAB_FAULT": faults})
    assert r.returncode == 0, r.stderr[-3000:]
    restarts = r.summary["restarts"]
    assert len(restarts) == len(faults.split(","))
    for restart, fault in zip(restarts, faults.split(",")):
        rank, step, *_ = map(lambda x: int(x) if x.isdigit() else x, fault.split(":"))
        assert restart["rank"] == rank and restart["reached_step"] == step
        assert restart["resumed_from_step"] == step // 2 * 2 and restart["steps_lost"] == step % 2
        assert f"paralab: restart {restart['attempt']}/2: rank {rank} " in r.stderr
    assert losses(r.out) == losses(plain.out) and len(losses(plain.out)) == 6 * world
    assert same(state(r.out, world), state(plain.out, world))
    assert not r.left_running()


def test_a_rank_killed_between_its_records_and_the_commit_loses_no_step_record(paralab):
    """Killed while saving step 4's checkpoint: its journal already holds steps 2 and 3 (a checkpoint's records
    go to disk before its commit), the generation is not committed, so the restart resumes from step 2 and
    steps.jsonl holds every (step, rank) once, an uninterrupted run's (they were lost when the journal came after
    the commit and the kill fell between)."""
    args, world = LAYOUTS["ddp"]
    plain = paralab("train", *args, *EXACT)
    r = paralab("train", *args, *EXACT, "--max-restarts", "1", env={"PARALAB_FAULT": "0:4:save:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    [restart] = r.summary["restarts"]
    assert restart["resumed_from_step"] == 2 and restart["rank"] == 0
    assert sorted((row["step"], row["rank"]) for row in r.rows("steps.jsonl")) == [(s, k) for s in range(6)
                                                                                  for k in range(world)]
    assert "losses_before_resume" not in r.summary  # every step's own record, none stood in for
    assert losses(r.out) == losses(plain.out) and len(losses(plain.out)) == 6 * world
    assert same(state(r.out, world), state(plain.out, world))


# a learning rate that changes every step: linear scaling (0.1 x 32 / 256) reached by a warm-up over the first
# epoch, which is 8 steps of 256 synthetic samples at a global batch of 32; 10 steps cross into the second epoch
SCHEDULE = ["--synthetic-size", "256", "--lr-scaling", "linear", "--warmup-epochs", "1", "--num-batches", "10"]


@pytest.mark.slow
def test_a_restart_replays_the_learning_rate_schedule_and_the_epochs(paralab):
    """Killed inside the warm-up (step 5, resumed from 4) and, after the schedule has settled and the second
    epoch's shuffle has begun, an exception (step 9, resumed from 8): every step's loss and the final state
    equal an uninterrupted run's, which they could not if a restart ran the schedule or the data from its
    start, or held the rate it was killed at. (steps.jsonl records no learning rate: the losses and weights
    are where it shows.)"""
    from paralab.training.lr_schedule import lr_at
    rates = [lr_at(step, lr=0.1, scaling="linear", global_batch=32, warmup_epochs=1, steps_per_epoch=8)
             for step in range(10)]
    assert len(set(rates[:9])) == 9 and rates[8] == rates[9] == 0.1 * 32 / 256  # what the runs below follow
    args = ["ddp", "--workers", "2", *EXACT, *SCHEDULE]
    plain = paralab("train", *args)
    assert plain.returncode == 0, plain.stderr[-3000:]
    constant = paralab("train", "ddp", "--workers", "2", *EXACT, *SCHEDULE[:2], "--num-batches", "10")
    assert constant.returncode == 0, constant.stderr[-3000:]
    first = losses(plain.out)
    scheduled, held = ({step: loss for rank, step, loss in rows if rank == 0} for rows in (first, losses(constant.out)))
    # the first update is at lr itself, every later one at another rate: the losses part from the third step on
    assert [scheduled[k] == held[k] for k in range(10)] == [True, True] + [False] * 8, (scheduled, held)
    faults = "1:5:kill:1,0:9:raise:2"
    r = paralab("train", *args, "--max-restarts", "2", env={"PARALAB_FAULT": faults})
    assert r.returncode == 0, r.stderr[-3000:]
    restarts = r.summary["restarts"]
    assert [(x["rank"], x["reached_step"], x["resumed_from_step"], x["steps_lost"]) for x in restarts] == [
        (1, 5, 4, 1), (0, 9, 8, 1)], restarts
    assert losses(r.out) == first and len(first) == 10 * 2
    assert same(state(r.out, 2), state(plain.out, 2))
    assert not r.left_running()


def test_a_rank_that_keeps_dying_uses_the_restarts_up(paralab):
    r = paralab("train", "ddp", "--workers", "2", *EXACT, "--max-restarts", "1", env={"PARALAB_FAULT": "1:3:kill"})
    assert r.returncode == 1
    assert "paralab: restart 1/1: rank 1 killed by signal SIGKILL" in r.stderr
    assert "paralab: the run failed 2 times and --max-restarts 1 is used up; the earlier failures:" in r.stderr
    assert "paralab:   attempt 1: rank 1 killed by signal SIGKILL" in r.stderr
    assert "--resume" in r.stderr  # the last failure still says how to resume by hand
    assert not (r.out / "summary.json").exists() and not r.left_running()


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_a_finished_run_is_finished_whatever_ends_a_rank_after_its_records(paralab, restarts):
    """A rank killed once the records are written (summary.json last): no restart, no traceback, no resume
    command, exit 0; the records are the run's, every step once (two pointless restarts and exit 1 before)."""
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "3", "--checkpoint-every", "1", "--max-restarts",
                restarts, env={"PARALAB_FAULT": "1:3:done"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rank 1 killed by signal SIGKILL after the run's records were written: the run is finished" in r.stderr
    assert "restart" not in r.stderr.replace("nothing was lost or restarted", "") and "Traceback" not in r.stderr
    assert "--resume" not in r.stderr
    assert sorted((row["step"], row["rank"]) for row in r.rows("steps.jsonl")) == [(s, k) for s in range(3)
                                                                                  for k in (0, 1)]
    assert not r.left_running()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_while_the_records_are_written_is_restarted_into_the_same_records(paralab, rank):
    """Killed half way through the records. Rank 0 (steps.jsonl written, not summary.json): the restart trains
    nothing and writes the records again. Rank 1 (its records sent to rank 0): rank 0 writes them, so the run
    is finished and nothing restarts. Either way every step's records are there once, an uninterrupted run's."""
    args = ("train", "ddp", "--workers", "2", "--num-batches", "3", "--checkpoint-every", "1", "--precision", "fp64")
    whole = paralab(*args)
    r = paralab(*args, "--max-restarts", "1", env={"PARALAB_FAULT": f"{rank}:3:records:1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("paralab: restart 1/1: rank 0 killed by signal SIGKILL" if rank == 0 else
            "rank 1 killed by signal SIGKILL after the run's records were written: the run is finished") in r.stderr
    rows = sorted((row["step"], row["rank"], row["loss"]) for row in r.rows("steps.jsonl"))
    assert rows == sorted((row["step"], row["rank"], row["loss"]) for row in whole.rows("steps.jsonl"))
    assert r.summary["test_loss"] == whole.summary["test_loss"] and not (r.out / "records").exists()


def test_records_that_cannot_be_written_stop_every_rank_with_exit_4_and_resume_writes_them(paralab, tmp_path):
    """The run's records fail to write (here: a folder in the way of steps.jsonl's temporary file; a full disk
    or a read-only folder alike): one line, exit 4, no traceback, no half-written file, the journals kept; once
    the way is clear, `--resume RUN --out RUN` trains nothing and writes every step's records."""
    out = tmp_path / "run"
    (out / "steps.jsonl.tmp").mkdir(parents=True)
    args = ("train", "ddp", "--workers", "2", "--num-batches", "3", "--checkpoint-every", "1")
    r = paralab(*args, out=out)
    assert r.returncode == 4, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "could not write the run's records" in line]
    assert len(lines) == 1 and f"--resume {out} --out {out}" in lines[0] and "Traceback" not in r.stderr
    assert not (out / "summary.json").exists() and not (out / "steps.jsonl").exists()
    assert (out / "records").is_dir()  # the journals, kept
    (out / "steps.jsonl.tmp").rmdir()
    again = paralab(*args, "--resume", str(out), out=out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted((row["step"], row["rank"]) for row in again.rows("steps.jsonl")) == [(s, k) for s in range(3)
                                                                                      for k in (0, 1)]
    assert (out / "eval.txt").exists() and (out / "trace.json").exists() and not (out / "records").exists()


def test_an_orderly_failure_is_not_restarted(paralab):
    """A loss that diverged is a verdict on the settings, not a crash: reported once, never run again."""
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "6", "--checkpoint-every", "1",
                "--max-restarts", "3", "--lr", "1e12", "--log-every", "1")
    assert r.returncode == 3, r.stderr[-2000:]
    assert "loss became non-finite" in r.stderr and "paralab: restart" not in r.stderr


@pytest.mark.parametrize("args,why", [
    (["--max-restarts", "1"], "add --checkpoint-every K"),
    (["--max-restarts", "1", "--checkpoint-every", "1", "--world-size", "2", "--rank", "0"],
     "under torchrun give torchrun its own --max-restarts"),
])
def test_restarts_need_checkpoints_and_local_workers(paralab, args, why):
    r = paralab("train", "ddp", *args)
    assert r.returncode == 2 and why in r.stderr, r.stderr[-2000:]
    assert not r.out.exists()


@pytest.mark.slow  # torchrun starts cold interpreters: about 20 s
def test_torchrun_restarts_and_the_group_finds_its_checkpoint(tmp_path, paralab):
    plain = paralab("train", "ddp", "--workers", "2", *EXACT)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", "-m", "paralab", "train", "ddp", *FAST, *EXACT, "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "PARALAB_FAULT": "1:3:raise:1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restarted by torchrun (restart 1): continuing from" in p.stdout and "checkpoint of step 2" in p.stdout
    assert losses(out) == losses(plain.out)
    assert same(state(out, 2), state(plain.out, 2))


def test_a_restarted_run_reads_as_one_run(paralab):
    """Killed in step 7 (checkpoints every 3): steps.jsonl holds every step once per rank, steps 0-5 from the
    first start and 6-9 from the second, the attempts end to end in time; the step done twice (6) is listed
    with the restart; nothing of the journal is left."""
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "10", "--checkpoint-every", "3",
                "--max-restarts", "1", env={"PARALAB_FAULT": "1:7:kill:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = r.rows("steps.jsonl")
    assert sorted((x["step"], x["rank"]) for x in rows) == [(s, k) for s in range(10) for k in range(2)]
    assert {x["step"]: x["attempt"] for x in rows} == {s: 1 if s < 6 else 2 for s in range(10)}
    summary = r.summary
    assert summary["attempts"] == {"1": [0, 5], "2": [6, 9]} and summary["restarts"][0]["redone"] == [6]
    assert "losses_before_resume" not in summary  # every loss is in steps.jsonl
    spans = r.rows("spans.jsonl")
    first = max(s["t1"] for s in spans if s["attempt"] == 1)
    assert all(s["t0"] >= first for s in spans if s["attempt"] == 2)  # one timeline, the attempts in order
    assert all(x["t0"] >= first for x in rows if x["attempt"] == 2)
    assert not (r.out / "records").exists()


@pytest.mark.slow
def test_a_powersgd_run_restarted_or_resumed_goes_on_as_one_never_stopped(paralab):
    """PowerSGD carries its steps, Q and error feedback from step to step, and each rank's checkpoint holds them
    (a restart once went back to uncompressed steps with an empty error and Q, and --resume was refused): a rank
    killed at step 5 and restarted from step 4 (two compressed steps behind it), and a run of 4 steps resumed to
    6, each end with the losses and state of 6 steps in one go."""
    args = ["ddp", "--workers", "2", "--compress", "powersgd", "--powersgd-start-iter", "2", *EXACT]
    plain = paralab("train", *args)
    restarted = paralab("train", *args, "--max-restarts", "1", env={"PARALAB_FAULT": "1:5:kill:1"})
    assert restarted.returncode == 0 and restarted.summary["restarts"][0]["resumed_from_step"] == 4, \
        restarted.stderr[-3000:]
    assert losses(restarted.out) == losses(plain.out) and same(state(restarted.out, 2), state(plain.out, 2))
    first = paralab("train", *args, "--num-batches", "4")
    assert plain.returncode == 0 and first.returncode == 0, first.stderr[-3000:]
    r = paralab("train", *args, "--resume", str(first.out), out=first.out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(r.out) == losses(plain.out) and len(losses(plain.out)) == 6 * 2
    assert same(state(r.out, 2), state(plain.out, 2))
