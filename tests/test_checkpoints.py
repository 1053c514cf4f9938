"""Crash-consistent checkpoints (run/generations.py): a save is committed whole or not read; nothing committed
is overwritten, by a later save, a full disk or a file changed by hand (issue 36)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FAST, run_paralab
from paralab.run import generations

RUN = ["ddp", "--workers", "2", *FAST, "--precision", "fp64"]


def train(*args, out: Path, env=None, timeout=240):
    return run_paralab("train", *args, out=out, fast=False, env=env, timeout=timeout)


def generation_names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoint").iterdir() if p.is_dir())


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "checkpoint").rglob("*")) if p.is_file()}


def test_generations_are_committed_and_the_newest_kept(tmp_path):
    r = train(*RUN, "--num-batches", "5", "--checkpoint-every", "1", out=tmp_path / "a")
    assert r.returncode == 0, r.stderr[-2000:]
    assert generation_names(r.out) == ["step-00000004", "step-00000005"]  # --keep-checkpoints 2
    gen = generations.newest(r.out)
    assert gen.step == 5 and gen.world == 2 and gen.identity["strategy"] == "ddp"
    for rank in (0, 1):
        assert gen.verify(rank) == gen.path(rank)  # size and SHA-256 as committed
    r3 = train(*RUN, "--num-batches", "5", "--checkpoint-every", "1", "--keep-checkpoints", "3", out=tmp_path / "b")
    assert generation_names(r3.out) == ["step-00000003", "step-00000004", "step-00000005"]


def test_a_rank_killed_while_saving_leaves_a_torn_save_that_is_ignored(tmp_path):
    """Rank 1 dies after writing its file of step 3, before the commit: step 3 is torn, step 2 complete. A
    resume says so in one line, continues from step 2, and ends equal to a run never interrupted; with
    --max-restarts the group restarts from step 2: one step (at most K) redone."""
    whole = train(*RUN, "--num-batches", "6", out=tmp_path / "whole")
    killed = train(*RUN, "--num-batches", "6", "--checkpoint-every", "1", out=tmp_path / "killed",
                   env={"PARALAB_FAULT": "1:3:save"})
    assert killed.returncode != 0
    assert "step-00000003" in generation_names(killed.out) and generations.newest(killed.out).step == 2
    assert not list(killed.out.rglob("*.tmp"))  # no stray temporary file
    resumed = train(*RUN, "--num-batches", "6", "--checkpoint-every", "1", "--resume", str(killed.out),
                    out=killed.out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-00000003 in" in resumed.stdout and "incomplete (a rank stopped while saving): ignored" in resumed.stdout
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    a, b = (torch.load(generations.newest(r.out).verify(0), weights_only=True)["state"]["model"]
            for r in (whole, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    restarted = train(*RUN, "--num-batches", "6", "--checkpoint-every", "1", "--max-restarts", "1",
                      out=tmp_path / "restarted", env={"PARALAB_FAULT": "1:3:save:1"})
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "starts again from the checkpoint of step 2" in restarted.stderr
    restart = json.loads((restarted.out / "summary.json").read_text())["restarts"][0]
    assert restart["resumed_from_step"] == 2 and restart["steps_lost"] <= 1  # --checkpoint-every 1


def test_a_run_killed_after_its_last_checkpoint_is_finished_by_resume(tmp_path):
    """Killed after committing its last step, before its records (bench/chaos.py's launcher kill once landed
    there, and --resume refused: "already trained 4 steps"): the resume trains nothing, evaluates and writes
    the records of every step, and its weights are an uninterrupted run's."""
    whole = train(*RUN, "--num-batches", "4", out=tmp_path / "whole")
    killed = train(*RUN, "--num-batches", "4", "--checkpoint-every", "1", out=tmp_path / "killed",
                   env={"PARALAB_FAULT": "0:4:kill"})
    assert killed.returncode != 0 and generations.newest(killed.out).step == 4
    assert not (killed.out / "summary.json").exists()
    resumed = train(*RUN, "--num-batches", "4", "--checkpoint-every", "1", "--resume", str(killed.out),
                    out=killed.out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    summary = json.loads((killed.out / "summary.json").read_text())
    assert summary["test_loss"] == json.loads((whole.out / "summary.json").read_text())["test_loss"]
    assert sorted({r["step"] for r in resumed.rows("steps.jsonl")}) == [0, 1, 2, 3]  # every step's records
    assert generation_names(killed.out) == ["step-00000003", "step-00000004"]  # nothing saved twice
    # a finished run is not finished again: its resume asks for more steps
    again = train(*RUN, "--num-batches", "4", "--resume", str(killed.out), out=tmp_path / "elsewhere")
    assert again.returncode == 2 and "already trained 4 steps" in again.stderr


def test_a_finished_run_extended_in_its_own_folder_keeps_its_records_and_appends(tmp_path):
    """`--resume RUN --out RUN` with more steps: the first run's step records stay as they were (they used to be
    replaced by the new steps' alone), the new steps follow them as the next attempt, and the weights and the
    losses are those of one run trained for all the steps."""
    whole = train(*RUN, "--num-batches", "5", out=tmp_path / "whole")
    first = train(*RUN, "--num-batches", "3", out=tmp_path / "run")
    before = first.rows("steps.jsonl")
    extended = train(*RUN, "--num-batches", "5", "--resume", str(first.out), out=first.out)
    assert extended.returncode == 0, extended.stderr[-2000:]
    rows = {(r["step"], r["rank"]): r for r in extended.rows("steps.jsonl")}
    assert sorted(rows) == [(step, rank) for step in range(5) for rank in (0, 1)]  # each exactly once
    assert all(rows[(r["step"], r["rank"])] == r for r in before)  # the first run's rows, unchanged
    assert {rows[(step, 0)]["attempt"] for step in (3, 4)} == {2}
    assert [rows[(step, 0)]["loss"] for step in range(5)] == [r["loss"] for r in whole.rows("steps.jsonl")
                                                              if r["rank"] == 0]
    assert extended.summary["test_loss"] == whole.summary["test_loss"]
    # an extension stopped after its last checkpoint, before its records (the old summary.json still there): the
    # resume trains nothing and writes them, every step once
    stopped = train(*RUN, "--num-batches", "7", "--resume", str(first.out), out=first.out,
                    env={"PARALAB_FAULT": "0:7:kill"})
    assert stopped.returncode != 0 and json.loads((first.out / "summary.json").read_text())["steps"] == 5
    finished = train(*RUN, "--num-batches", "7", "--resume", str(first.out), out=first.out)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "at step 7" in finished.stdout
    assert sorted((r["step"], r["rank"]) for r in finished.rows("steps.jsonl")) == [(s, k) for s in range(7)
                                                                                    for k in (0, 1)]


@pytest.mark.parametrize("damage", ["edited", "truncated"])
def test_a_checkpoint_changed_since_its_commit_is_refused_naming_the_file(tmp_path, damage):
    r = train(*RUN, "--num-batches", "2", out=tmp_path / "a")
    assert r.returncode == 0
    path = generations.newest(r.out).path(1)
    data = bytearray(path.read_bytes())
    if damage == "edited":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    before = snapshot(r.out)
    resumed = train(*RUN, "--num-batches", "4", "--resume", str(r.out), out=tmp_path / "b")
    assert resumed.returncode == 2 and f"{path} is not the file its manifest committed" in resumed.stderr
    exported = run_paralab("export", str(r.out), "-o", str(tmp_path / "m.pt"))
    assert exported.returncode == 2 and str(path) in exported.stderr and not (tmp_path / "m.pt").exists()
    assert snapshot(r.out) == before and not (tmp_path / "b").exists()  # nothing overwritten, nothing started


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    mine = train(*RUN, "--num-batches", "2", out=tmp_path / "mine")
    other = train(*RUN, "--num-batches", "2", "--seed", "7", out=tmp_path / "other")
    shutil.rmtree(mine.out / "checkpoint")
    shutil.copytree(other.out / "checkpoint", mine.out / "checkpoint")  # another run's, committed
    resumed = train(*RUN, "--num-batches", "4", "--resume", str(mine.out), out=mine.out)
    assert resumed.returncode == 2 and "different run" in resumed.stderr and "seed" in resumed.stderr


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_stops_every_rank_and_keeps_what_was_committed(tmp_path):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "3m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out = disk / "run"
        r = train(*RUN[:-2], "--num-batches", "40", "--checkpoint-every", "1", out=out)  # fp32: smaller files
        assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
        lines = [line for line in r.stderr.splitlines() if "No space left on device" in line]
        assert len(lines) == 1 and "while writing step" in lines[0] and "'s is intact: paralab train" in lines[0]
        assert "--resume" in lines[0] and "Traceback" not in r.stderr
        intact = generations.newest(out)
        assert intact is not None and all(intact.verify(rank) for rank in (0, 1))
        before = {k: v for k, v in snapshot(out).items() if intact.folder.name in k}
        # resuming into the same full folder fails the same way, and the committed save is untouched
        again = train(*RUN[:-2], "--num-batches", "40", "--checkpoint-every", "1", "--resume", str(out), out=out)
        assert again.returncode == 4 and "No space left on device" in again.stderr
        assert all(snapshot(out).get(k) == v for k, v in before.items())
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
