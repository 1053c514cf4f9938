"""Progress: a small bar on stderr, structured progress events, and the status line of a run of runs.

- :class:`Progress`: the bar a rank draws (redrawn in place on a terminal, a
  line per 10% otherwise). When the environment names an events file
  (``PARALAB_EVENTS``, set by :func:`paralab.run.runner.run` for the run it
  starts), it also appends one JSON line per update to that file, so a
  program that runs paralab reads its progress as data instead of reading
  its output.
- :func:`emit`: append any event to that file (the launcher reports a failed
  rank this way).
- :class:`StatusLine`: the one-line status of a run inside a longer job
  (``compare``, ``sweep``), fed from those events.

Events are JSON objects, one a line, with an ``event`` key:

  ``{"event": "progress", "phase": "train", "done": 3, "total": 20}``   a bar moved
  ``{"event": "phase_end", "phase": "train", "done": 20, "total": 20}`` a bar closed
  ``{"event": "loss", "step": 20, "total": 20, "loss": 2.25}``          the loss at a log point
  ``{"event": "error", "rank": 1, "message": "RuntimeError: ..."}``    a rank failed
"""
from __future__ import annotations

import json
import os
import sys
import time

#: environment variable naming the JSON-lines file events are appended to
EVENTS_ENV = "PARALAB_EVENTS"


def emit(event: str, **fields) -> None:
    """Append ``{"event": event, **fields}`` to the events file, if one is named; never raises."""
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    line = json.dumps({"event": event, **fields}, default=str) + "\n"
    try:
        # one write of one line, appended: lines from several processes do not interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # progress reporting must never fail a run


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, start: int = 0, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.start = start
        self.done = start
        self.last_decile = -1
        self.drawn = False
        self.events = enabled and bool(os.environ.get(EVENTS_ENV))

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if not self.enabled:
            return
        if self.events:
            emit("progress", phase=self.label, done=done, total=self.total)
        frac = done / self.total
        elapsed = time.perf_counter() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        bar = "#" * int(frac * 24)
        text = (f"{self.label} [{bar:<24}] {done}/{self.total} {100 * frac:5.1f}% "
                f"{rate:6.2f} it/s eta {eta:5.0f}s {note}")
        if self.tty:
            self.stream.write("\r" + text[:120])
            self.drawn = True
        elif int(frac * 10) != self.last_decile or done == self.total:
            self.last_decile = int(frac * 10)
            self.stream.write(text + "\n")
        self.stream.flush()

    def event(self, event: str, **fields) -> None:
        """Emit an event about this bar's work (e.g. the loss at a log point), if events are on."""
        if self.events:
            emit(event, **fields)

    def clear(self) -> str:
        """Erase the bar so a log line can be printed; returns '' for convenience in f-strings."""
        if self.enabled and self.tty and self.drawn:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
            self.drawn = False
        return ""

    def close(self) -> None:
        if self.events:
            emit("phase_end", phase=self.label, done=self.done, total=self.total)
            self.events = False  # closed once: a second close() says nothing more
        if self.enabled and self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


#: how the phases a runner reports between bars read on a status line
PHASES = {"starting": "starting", "eval": "eval", "check": "check: reference", "records": "writing records"}


class StatusLine:
    """One status line per run of a longer job: redrawn in place on a terminal; without one,
    a line is printed when the phase changes, when a phase reaches its last step, and at the end."""

    WIDTH = 118

    def __init__(self, stream=None, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.verbose = verbose
        self._last_key: tuple | None = None

    def show(self, prefix: str, phase: str, done: int | None = None, total: int | None = None,
             seconds: float | None = None, note: str = "") -> None:
        """``prefix  phase done/total  note  seconds`` (each part only when given)."""
        text = "  ".join(p for p in (prefix, f"{phase} {done}/{total}" if done is not None and total else phase,
                                     note, f"{seconds:5.1f}s" if seconds is not None else "") if p)
        if self.tty:
            self.stream.write("\r" + text[:self.WIDTH].ljust(self.WIDTH))
        else:
            key = (prefix, phase, done is not None and done == total)
            if key == self._last_key:
                return
            self._last_key = key
            self.stream.write(text + "\n")
        self.stream.flush()

    def follow(self, prefix: str):
        """An ``on_event`` callback (``paralab.run.runner.run``) that keeps this line up to date."""
        state = {"phase": "starting", "done": None, "total": None, "note": "", "t0": time.monotonic()}

        def on_event(e: dict) -> None:
            kind = e.get("event")
            if kind == "progress":
                state.update(phase=str(e.get("phase", "")), done=e.get("done"), total=e.get("total"))
            elif kind == "phase":
                state.update(phase=PHASES.get(e.get("phase"), str(e.get("phase"))), done=None, total=None)
            elif kind == "loss" and isinstance(e.get("loss"), (int, float)):
                state["note"] = f"loss {e['loss']:.4f}"
            elif kind == "error":
                state["note"] = "error" + (f" on rank {e['rank']}" if e.get("rank") is not None else "")
            self.show(prefix, state["phase"], state["done"], state["total"], time.monotonic() - state["t0"],
                      state["note"])
        return on_event

    def final(self, prefix: str, verdict: str, seconds: float) -> None:
        text = f"{prefix}  {verdict}  {seconds:.1f}s"
        self.stream.write(("\r" + text[:self.WIDTH].ljust(self.WIDTH) if self.tty else text) + "\n")
        self.stream.flush()
        self._last_key = None

    def passthrough(self, line: str) -> None:
        """A line of a run's own output (``--verbose``)."""
        if self.verbose:
            if self.tty:
                self.stream.write("\r" + " " * self.WIDTH + "\r")
            self.stream.write("    | " + line + "\n")
            self.stream.flush()
