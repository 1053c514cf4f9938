"""Run one training run from a program: ``run(cfg, run_dir, on_event) -> RunResult``.

This is how ``paralab compare`` and ``paralab sweep`` (or a notebook, or a
benchmark script) run paralab: they build a :class:`~paralab.run.config.RunConfig`
and call :func:`run`. The run goes into its own process, so a run that
crashes, hangs or runs out of memory is stopped and reported while the
caller goes on. That process is forked from a warm parent (``warm.start``:
one preloaded forkserver serves every run of the caller), so a run starts
without importing torch again. What comes back is data, never text to parse:

- the config travels to the child as a dict (``RunConfig.to_dict`` /
  ``from_dict``): no command line is built or parsed;
- progress comes as events (``paralab.progress``): the child's rank 0
  appends JSON lines to an events file that :func:`run` reads while the run
  goes, handing each to ``on_event``; a failed rank is reported the same way;
- results are the run directory's ``summary.json``.

The child's own output (progress bars, the loss every ``log_every`` steps,
tracebacks) goes to a file that :func:`run` reads as it grows, into the
``log`` file, for people.

Events passed to ``on_event`` (dicts with an ``event`` key): those of
:mod:`paralab.progress` (``progress``, ``phase_end``, ``loss``, ``error``),
and from :func:`run` itself ``{"event": "phase", "phase": ...}`` when the run
starts (``starting``) and when it moves past a bar (``check`` after the test
evaluation when the run checks against the reference, else ``records``), and
``{"event": "tick", "seconds": s}`` about twice a second while nothing else
happens.

Run as ``python -m paralab.run.runner RUN_DIR`` with the config as JSON on
standard input, this module is such a child in a fresh interpreter (how
``--network`` without root runs its launch inside a user namespace).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from . import warm
from .config import RunConfig
from ..errors import UsageError
from ..progress import EVENTS_ENV, emit

TICK_S = 0.5


@dataclass
class RunResult:
    status: str                 # "ok": summary.json written; "failed"; "timeout"
    returncode: int | None      # the child's exit code (None: stopped at the timeout)
    seconds: float              # wall time of the child
    run_dir: Path
    summary: dict | None        # summary.json, when the run wrote one
    error: str | None           # why it failed; for a finished run, the summary's own error (e.g. a diverged loss)
    log: Path | None            # the child's output
    signal: int | None = None   # a rank (or the run) was killed by this signal (e.g. 9: out of memory)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def check(self) -> str | None:
        """PASS / FAIL of ``--check``, when the run checked."""
        return ((self.summary or {}).get("check") or {}).get("result")


def run(cfg: RunConfig, run_dir, on_event: Callable[[dict], None] | None = None, *, log=None,
        timeout: float | None = None, on_output: Callable[[str], None] | None = None) -> RunResult:
    """Train ``cfg`` into ``run_dir`` in a child process; return when it has finished or been stopped.

    ``cfg`` should be validated by the caller (the child validates it again and fails
    with the message if not). ``log``: file for the child's output (default: none kept).
    ``timeout``: seconds after which the child and its ranks are stopped. ``on_output``:
    called with each line of the child's output (e.g. to echo it). Raises UsageError if
    ``run_dir`` already holds a run or the config asks for ranks started elsewhere.
    """
    run_dir = Path(run_dir).absolute()
    if (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} already holds a run; pick another directory")
    if cfg.world_size is not None or cfg.rank is not None:
        raise UsageError("the runner starts local worker processes; --world-size/--rank runs are "
                         "started by hand on each node")
    cfg = dataclasses.replace(cfg, out=str(run_dir))
    log = Path(log) if log is not None else None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    on_event = on_event or (lambda e: None)
    events_path, output_path = _scratch("events", ".jsonl"), _scratch("output", ".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", EVENTS_ENV: events_path}
    t0 = time.monotonic()
    events, output = LineReader(events_path), LineReader(output_path)
    errors: list[dict] = []
    timed_out = False
    log_file = open(log, "w") if log is not None else None
    proc = None
    try:
        if log_file:
            log_file.write(f"# paralab.run.runner: {cfg.strategy} on {cfg.workers} worker(s) -> {run_dir}\n")
            log_file.write("# config: " + json.dumps(cfg.to_dict(), default=str) + "\n")
            log_file.flush()
        if cfg.start == "spawn":  # a fresh interpreter, as every run started before warm starts
            proc = warm.start_fresh([sys.executable, "-m", "paralab.run.runner", str(run_dir)],
                                    json.dumps(cfg.to_dict(), default=str).encode(), output=output_path, env=env,
                                    cwd=os.getcwd())
        else:  # a child of this process's warm forkserver: torch, paralab and what a rank imports are loaded
            proc = warm.start(_train, (cfg.to_dict(), str(run_dir)), output=output_path, env=env, cwd=os.getcwd())
        on_event({"event": "phase", "phase": "starting"})
        last_signal = time.monotonic()
        while True:
            ended = bool(wait([proc.sentinel], timeout=TICK_S / 2))
            for line in output.lines():
                for part in line.split("\r"):  # a progress bar redrawn in place
                    part = part.rstrip()
                    if part:
                        if log_file:
                            log_file.write(part + "\n")
                        if on_output:
                            on_output(part)
            new = [e for e in map(_event, events.lines()) if e is not None]
            for e in new:
                _deliver(e, cfg, on_event, errors)
            if new:
                last_signal = time.monotonic()
            if ended:
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                timed_out = True
                stop(proc)
                break
            if time.monotonic() - last_signal >= TICK_S:
                on_event({"event": "tick", "seconds": time.monotonic() - t0})
                last_signal = time.monotonic()
        proc.join()
    except BaseException:
        if proc is not None:
            stop(proc)
        raise
    finally:
        if log_file:
            if timed_out:
                log_file.write(f"paralab.run.runner: stopped after {timeout:.0f} s\n")
            log_file.close()
        for path in (events_path, output_path):
            try:
                os.unlink(path)
            except OSError:
                pass
    seconds = time.monotonic() - t0
    code = None if timed_out else proc.exitcode
    summary = read_summary(run_dir)
    sig = next((e["signal"] for e in errors if e.get("signal")), None)
    if code is not None and code < 0:
        sig = sig or -code
    if summary is not None:
        status, error = "ok", summary.get("error")
    elif timed_out:
        status, error = "timeout", f"timed out after {timeout:.0f} s"
    else:
        status = "failed"
        error = errors[0].get("message") if errors else None
        if not error:
            error = (f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}")
    return RunResult(status, code, seconds, run_dir, summary, error, log, sig)


def _scratch(what: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"paralab-{what}-", suffix=suffix)
    os.close(fd)
    return path


def _event(line: str) -> dict | None:
    try:
        e = json.loads(line)
    except ValueError:
        return None
    return e if isinstance(e, dict) else None


def _deliver(e: dict, cfg: RunConfig, on_event, errors: list) -> None:
    if e.get("event") == "error":
        errors.append(e)
    on_event(e)
    if e.get("event") == "phase_end":
        after = {"train": "eval", "eval": "check" if cfg.check else "records"}.get(e.get("phase"))
        if after:
            on_event({"event": "phase", "phase": after})


class LineReader:
    """The complete lines appended to a file since the last call (a line still being written waits)."""

    def __init__(self, path):
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [raw.decode(errors="replace") for raw in complete]


def read_summary(run_dir) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Called:
    """What :func:`call` gives back: the child's exit code (None: stopped at the timeout), pid and output."""
    exitcode: int | None
    pid: int
    stdout: str
    stderr: str


def call(target, args: tuple, *, env: dict, cwd, timeout: float | None = None) -> Called:
    """``target(*args)`` (a command line's ``main``) in a child of this process's warm forkserver, its output
    captured, waited for; past ``timeout`` (or if the caller is interrupted) it and every process it started
    are stopped. The suite and the benchmarks run ``paralab`` commands so, importing torch once."""
    with tempfile.TemporaryDirectory(prefix="paralab-call-") as scratch:
        stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
        proc = warm.start(target, args, output=str(stdout), errors=str(stderr), env=env, cwd=str(cwd))
        try:
            proc.join(timeout)
        finally:
            stop(proc)  # nothing of it outlives the call: past the timeout, or the caller interrupted
        return Called(proc.exitcode, proc.pid, stdout.read_text(), stderr.read_text())


def stop(proc) -> None:
    """Stop a child started here and every process it started (its own session): SIGTERM, then SIGKILL."""
    if proc.exitcode is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # not yet the leader of its session: nothing of its own started yet
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.join(10 if sig == signal.SIGTERM else None)
        if proc.exitcode is not None:
            return


# ---------------------------------------------------------------------------- the child
def _train(config: dict, run_dir: str) -> int:
    """The child: validate the config (exit 2 with the message if it is refused), then launch the run."""
    from .launch import launch
    try:
        cfg = RunConfig.from_dict(config)
        cfg.validate()
    except (UsageError, ValueError, TypeError) as exc:
        print(f"paralab: error: {exc}", file=sys.stderr, flush=True)
        emit("error", message=str(exc))
        return 2
    return launch(cfg, run_dir)


def _child(argv: list[str]) -> int:
    """``python -m paralab.run.runner RUN_DIR < config.json``: how ``--network`` without root runs
    a launch again inside a user namespace (``launch._run_in_user_namespace``)."""
    warm.mark_fresh()  # a fresh interpreter's main: nothing has run here
    if len(argv) != 1:
        print("usage: python -m paralab.run.runner RUN_DIR < config.json", file=sys.stderr)
        return 2
    try:
        config = json.loads(sys.stdin.read())
    except ValueError as exc:
        print(f"paralab: error: the config on standard input is not JSON: {exc}", file=sys.stderr, flush=True)
        return 2
    return _train(config, argv[0])


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
