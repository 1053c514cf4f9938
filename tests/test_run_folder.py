"""One run per folder (run/folder.py): a second run into a folder in use is refused, naming the one that holds
it; a finished run is replaced only when asked; ``--out`` naming a file is refused before start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # the lock went with the process that held it: the folder takes a run again (no stale lock file)
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
