"""Shared test helpers: run the CLI in a child process and read its run directory.

The child is forked from a warm parent (``paralab.run.warm.start``: a forkserver that has imported
torch and paralab once for the whole session), as ``paralab compare`` starts its runs; the command
line, environment, working directory, output and exit code are the child's own, as a fresh
``python -m paralab`` would have them. ``PARALAB_TEST_COLD=1`` runs each in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# a `paralab serve` the developer left running must not run the tests' commands (tests/test_serve.py
# starts its own, in a folder of its own)
os.environ["PARALAB_SERVE"] = "off"
# The session's own folders, made once: a rank started from the session's forkserver that imports a
# test module (and so this file) finds them in its environment and makes none of its own.
# - decoded copies of datasets (data/decoded.py) go to a folder of this session's, not the user's cache;
# - `train --check` runs share their single-process references through one folder (`--check-cache`,
#   check/kept.py: a reference is loaded only by a run whose weights, batches and settings hash the
#   same, and each run still compares its own weights with it); a test that passes its own
#   --check-cache keeps it, and PARALAB_TEST_OWN_REFERENCES=1 trains one in every run.
_OWNER = "PARALAB_TEST_SESSION_FOLDERS" not in os.environ
if _OWNER:
    os.environ["PARALAB_DECODED"] = tempfile.mkdtemp(prefix="paralab-test-decoded-")
    os.environ["PARALAB_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="paralab-test-references-")
    os.environ["PARALAB_TEST_SESSION_FOLDERS"] = "1"
_DECODED, _KEPT = os.environ["PARALAB_DECODED"], os.environ["PARALAB_TEST_REFERENCES"]


def shared_references(precision: str = "fp64") -> str | None:
    """The session's folder of kept references, for a test's own ``RunConfig(check_cache=...)``, for a check in
    fp64 (``precision``) only: below it a reference kept for later trains the noise band's three more at every
    checked step, exact or not (check/kept.py), where a run that keeps nothing trains them only where a
    comparison is beyond exact, as most of the suite's fp32 checks are not."""
    return None if os.environ.get("PARALAB_TEST_OWN_REFERENCES") or precision != "fp64" else _KEPT


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(_DECODED, ignore_errors=True)
        shutil.rmtree(_KEPT, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, saying why, where no CUDA device is visible (`make gpu-check` runs them)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

# Small and fast: every multi-worker test uses these unless it needs otherwise. fp32, as a plain run's: a test
# whose --check is about something else (launching, failures, records) keeps the course setting's speed; the
# tests of the check itself and of its default precision (fp64) say --precision, or do not use these.
FAST = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.125", "--batch-size", "32",
        "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64", "--timeout", "30", "--precision", "fp32"]


def precision_args(precision: str) -> tuple[str, ...]:
    """``--precision P`` for a test that measures rounding, not speed: bf16 adds ``--allow-slow-bf16``, as a CPU
    without bf16 instructions (an AVX2-only EPYC) refuses bf16 otherwise and the suite must pass on every CPU."""
    return ("--precision", precision, *(("--allow-slow-bf16",) if precision == "bf16" else ()))


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    out: Path
    session: int | None = None  # the command's session (its pid): every process it started is in it

    def left_running(self, within: float = 30.0) -> list[int]:
        """Pids of processes of this command's session still alive after ``within`` seconds (none: [])."""
        deadline = time.monotonic() + within
        while True:
            alive = session_processes(self.session)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def rows(self, name: str) -> list[dict]:
        return [json.loads(line) for line in (self.out / name).read_text().splitlines()]


def run_paralab(*args: str, out: Path | None = None, env: dict | None = None, timeout: float = 240,
                fast: bool = True, cwd: Path | None = None, share: bool = True) -> Result:
    """``paralab ARGS`` (``fast``: :data:`FAST` before a ``train``'s own options; ``share``: a check's reference
    shared through the session's ``--check-cache``, which below fp64 trains its noise band to keep it)."""
    argv = list(args)
    if args and args[0] == "train":
        if fast:  # before the test's own options, so a test can override any of them
            argv = argv[:2] + FAST + argv[2:]
        if out is not None:
            argv += ["--out", str(out)]
        given = [value for flag, value in zip(argv, argv[1:]) if flag == "--precision"]
        precision = given[-1] if given else "fp64"  # the last given wins, as on a command line
        if share and "--check" in argv and "--check-cache" not in argv and shared_references(precision):
            argv += ["--check-cache", shared_references(precision)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if os.environ.get("PARALAB_TEST_COLD"):
        p = subprocess.Popen([sys.executable, "-m", "paralab", *argv], stdout=subprocess.PIPE, cwd=cwd,
                             stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return Result(p.returncode, stdout, stderr, out or Path("."), p.pid)
    return _run_warm(argv, full_env, timeout, out or Path("."), cwd)


def session_processes(session: int | None) -> list[int]:
    """Pids of the live (not zombie) processes of a session."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _ppid, _group, sid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(sid) == session and state != "Z":
            pids.append(int(entry.name))
    return pids


def _run_warm(argv: list[str], env: dict, timeout: float, out: Path, cwd: Path | None = None) -> Result:
    from paralab.cli import main
    from paralab.run import runner
    done = runner.call(main, (argv,), env=env, cwd=cwd or os.getcwd(), timeout=timeout)
    if done.exitcode is None:
        raise subprocess.TimeoutExpired(["paralab", *argv], timeout)
    return Result(done.exitcode, done.stdout, done.stderr, out, done.pid)


def selected(request, test_name: str) -> list[dict]:
    """The parameters of every selected test called ``test_name`` (a module fixture's way to run only what the
    session's selection needs)."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "originalname", "") == test_name and hasattr(item, "callspec")]


def two_at_a_time(fn, items) -> list:
    """``[fn(i, item) for i, item in enumerate(items)]``, two calls at a time: a run's ranks often wait (for each
    other, for rank 0's check, for a sandboxed run's limit), and the other call computes meanwhile. The session's
    warm forkserver is started first, before the threads ask for it."""
    return two_at_a_time_heavy_alone(fn, items, lambda item: False)


def two_at_a_time_heavy_alone(fn, items, heavy) -> list:
    """:func:`two_at_a_time`, where no two items that are ``heavy(item)`` (a full-size model's memory) run
    at once: one thread runs the heavy ones one after another, beside the others, then takes its share of
    what is left (the light items' compute fills the heavy run's waits, as two light ones fill each other's)."""
    import threading

    from paralab.run.warm import forkserver
    forkserver()
    items = list(items)
    results: list = [None] * len(items)
    failures: list = []
    light = iter([i for i, item in enumerate(items) if not heavy(item)])
    take = threading.Lock()

    def work(mine: list[int]) -> None:
        try:
            for i in mine:
                results[i] = fn(i, items[i])
            while True:
                with take:
                    i = next(light, None)
                if i is None:
                    return
                results[i] = fn(i, items[i])
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(mine,))
               for mine in ([i for i, item in enumerate(items) if heavy(item)], [])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results


def side_by_side(jobs: dict, root: Path, **kwargs) -> dict:
    """``run_paralab("train", *argv, out=root/<i>, **kwargs)`` for each ``key -> argv`` of ``jobs``, two at a
    time (:func:`two_at_a_time`): key -> Result."""
    results = two_at_a_time(lambda i, argv: run_paralab("train", *argv, out=root / f"run{i}", **kwargs),
                            jobs.values())
    return dict(zip(jobs, results))


@pytest.fixture
def paralab(tmp_path):
    """``paralab("train", "ddp", "--workers", "2")`` -> Result with a fresh run directory."""
    counter = iter(range(1000))

    def run(*args, **kwargs):
        out = kwargs.pop("out", tmp_path / f"run{next(counter)}")
        return run_paralab(*args, out=out, **kwargs)
    return run


# ---------------------------------------------------------------- checkpoints as a writer would have left them
def commit_generation(run_dir, step: int, identity: dict, payloads: dict, world: int, tag: str | None = None):
    """A committed checkpoint generation written in this process (``run/generations.py``'s layout): rank ->
    payload for the ranks given (a rank left out has no file: the manifest still lists what it would hold)."""
    import torch

    from paralab.run import generations
    folder = generations.folder_for(run_dir, step, tag)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for rank in range(world):
        path = folder / f"rank{rank}.pt"
        torch.save(payloads.get(rank, payloads[min(payloads)]), path)
        files[str(rank)] = {"bytes": path.stat().st_size, "sha256": generations.sha256(path)}
        if rank not in payloads:
            path.unlink()
    (folder / generations.MANIFEST).write_text(json.dumps({"format": generations.FORMAT, "step": step,
                                                           "world": world, "identity": identity, "files": files}))
    return folder


def recommit(run_dir, rank: int, change) -> None:
    """Rank ``rank``'s file of the newest committed checkpoint rewritten with ``change(saved)`` applied, and its
    manifest entry with it: what a writer with that bug would have committed (not a file edited since)."""
    import torch

    from paralab.run import generations
    gen = generations.newest(run_dir)
    saved = torch.load(gen.path(rank), weights_only=True)
    change(saved)
    torch.save(saved, gen.path(rank))
    manifest = gen.folder / generations.MANIFEST
    doc = json.loads(manifest.read_text())
    doc["files"][str(rank)] = {"bytes": gen.path(rank).stat().st_size, "sha256": generations.sha256(gen.path(rank))}
    manifest.write_text(json.dumps(doc))
