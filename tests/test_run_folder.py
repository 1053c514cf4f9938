"""One run per folder (run/folder.py): a second run into a folder in use is refused, naming the one that holds
it; a finished run is replaced only when asked; ``--out`` naming a file is refused before start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, run_paralab


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "paralab", "train", "ddp", "--workers", "2", *FAST,
                              "--num-batches", "100000", "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "PARALAB_SERVE": "off"})
    try:
        deadline = time.monotonic() + 120
        while not (out / "oplog").is_dir() and time.monotonic() < deadline:  # the first run is going
            time.sleep(0.2)
        second = run_paralab("train", "single", *FAST, "--num-batches", "1", "--out", str(out), fast=False)
        assert first.poll() is None  # still going: the second did not stop it
        assert second.returncode == 2
        assert f"--out {out} is in use by a run that is still going (pid {first.pid}:" in second.stderr
        assert "--num-batches 100000" in second.stderr  # its command line
        assert not (out / "summary.json").exists() and not (out / "checkpoint").exists()  # nothing of the second
        # nor may a run resume from it: its newest checkpoint may be one being written
        third = run_paralab("train", "ddp", "--workers", "2", *FAST, "--num-batches", "2", "--resume", str(out),
                            "--out", str(tmp_path / "other"), fast=False)
        assert third.returncode == 2, third.stderr[-2000:]
        assert f"--resume {out} is in use by a run that is still going (pid {first.pid}:" in third.stderr
        assert not (tmp_path / "other").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the ranks, killed with the launcher, hold the folder's lock until they have exited, which for a process
    # of torch's size takes a moment after wait() reaps the launcher (this test once ran the next command
    # inside that moment): wait, boundedly, for the lock to be free, then take the folder with a run
    from paralab.run.folder import held
    deadline = time.monotonic() + 10
    while held(out) and time.monotonic() < deadline:  # still held after 10 s: the run below says so and fails
        time.sleep(0.05)
    # the lock went with the processes that held it: the folder takes a run again (no stale lock file)
    again = run_paralab("train", "single", *FAST, "--num-batches", "1", "--out", str(out), fast=False)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_finished_run_is_replaced_only_when_asked(tmp_path):
    out = tmp_path / "run"
    assert run_paralab("train", "single", *FAST, "--num-batches", "1", "--out", str(out), fast=False).returncode == 0
    again = run_paralab("train", "ddp", "--workers", "2", *FAST, "--num-batches", "1", "--out", str(out), fast=False)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--overwrite" in again.stderr
    assert json.loads((out / "summary.json").read_text())["strategy"] == "single"  # untouched
    (out / "stray.txt").write_text("left by hand")
    replaced = run_paralab("train", "ddp", "--workers", "2", *FAST, "--num-batches", "1", "--overwrite",
                           "--out", str(out), fast=False)
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["strategy"] == "ddp"
    assert not (out / "stray.txt").exists()  # the old run's folder was cleared, not mixed into


def test_out_naming_a_file_is_refused_before_start(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    r = run_paralab("train", "single", *FAST, "--num-batches", "1", "--out", str(target), fast=False)
    assert r.returncode == 2 and "is a file: name a folder" in r.stderr
    assert target.read_text() == "mine"


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, theirs, ...), whatever session each leads."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state, ppid = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}") and " Z " not in open(f"/proc/{p}/stat").read()]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_killed_compare_ends_its_runs_and_leaves_its_folder_in_sight(tmp_path, how):
    """compare's runs live in sessions of their own (so it can stop one and its ranks): a compare killed
    (kill -9 too) takes its run and the run's ranks with it within seconds; what it wrote is in its report
    folder, never a hidden one; while it runs, a second compare into that folder is refused, naming it."""
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "paralab", "compare", "--strategies", "ddp", "--workers", "2", "--width", "0.125",
           "--no-check", "--out", str(out), "--train-args=--dataset synthetic --synthetic-size 256 --batch-size 16 "
           "--num-batches 100000"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "PARALAB_SERVE": "off"})
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("runs/*/oplog")) and time.monotonic() < deadline:  # the run's ranks train
            time.sleep(0.2)
        below = _descendants(p.pid)
        assert len(below) >= 4, below  # the forkserver, the run, its two ranks
        second = run_paralab("compare", "--strategies", "single", "--out", str(out))
        assert second.returncode == 2 and f"--out {out} is in use" in second.stderr, second.stderr
        p.send_signal(how)
        p.wait(timeout=60)
        deadline = time.monotonic() + 5  # (0.1-0.3 s measured; 9 s before the forkserver skipped its teardown)
        while _alive(below) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(below) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in _alive(_descendants(p.pid)):
            os.kill(pid, signal.SIGKILL)
    assert [e.name for e in tmp_path.iterdir()] == ["report"]  # nothing hidden beside it
    assert list(out.glob("logs/*.log"))  # the run's output, where the report said it would be
    if how == signal.SIGTERM:
        assert "compare: stopped" in p.stderr.read()


def test_a_resume_starts_every_rank_from_the_newest_generation_all_of_them_can_read(tmp_path):
    """The ranks gather the steps each can read and take the newest they share: a newer generation missing a
    rank's file is passed over (by every rank alike); a rank started by hand on its own host reads its own."""
    from conftest import commit_generation
    from paralab.run import checkpoint, generations
    from paralab.run.config import RunConfig
    cfg = RunConfig(strategy="ddp", workers=2)
    ident = checkpoint.identity(cfg)
    for step in (2, 4, 6):
        commit_generation(tmp_path, step, ident, {0: {"step": step}, 1: {"step": step}}, world=2)
    commit_generation(tmp_path, 8, ident, {0: {"step": 8}}, world=2)  # rank 1's file absent
    assert generations.newest(tmp_path).step == 8
    mine = [set(checkpoint.usable_steps(tmp_path, cfg, rank)) for rank in (0, 1)]
    assert mine == [{2, 4, 6, 8}, {2, 4, 6}] and max(set.intersection(*mine)) == 6
    assert checkpoint.load(tmp_path, 1, at=6)["step"] == 6


def test_a_save_not_yet_committed_is_called_in_progress_while_its_run_is_going(tmp_path):
    """export or a resume reading a folder: a generation without its manifest is a save in progress while a live
    run holds the folder, and a save that stopped half way once none does."""
    from conftest import commit_generation
    from paralab.run import checkpoint, folder, generations
    commit_generation(tmp_path, 2, {"strategy": "ddp"}, {0: {"step": 2}}, world=1)
    generations.folder_for(tmp_path, 4).mkdir()  # rank files being written, no manifest yet
    hold = folder.claim(tmp_path)
    try:
        assert "(a save in progress: the run is still going)" in checkpoint.torn_note(tmp_path)
    finally:
        hold.release()
    assert "(a rank stopped while saving)" in checkpoint.torn_note(tmp_path)
