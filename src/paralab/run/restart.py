"""``--max-restarts N``: a group that crashed starts again, whole, from the run's last checkpoint.

When a rank dies (an exception, a signal such as the out-of-memory killer's, an unexplained exit
code), the launcher stops the others as always (``local._run_group``), then, while restarts are
left, starts every rank again with ``--resume`` pointing at the run's own directory: the newest
checkpoint every rank completed (``--checkpoint-every K``), or the start of the run if none was
written yet. The data order, augmentation and learning rate are functions of the step, and a
checkpoint holds the whole state (weights, BatchNorm buffers, optimizer state, the losses so far),
so the finished run equals one that was never interrupted, bit for bit. What was lost is the work
since that checkpoint: the steps from it to the one the ranks were in.

Each restart is a dict, printed when it happens, sent as a ``restart`` progress event, and kept in
``summary.json`` (``restarts``): the attempt, the rank that failed first and how, when, the step the
ranks had reached, the step resumed from and the steps lost. An orderly exit (a check FAIL, a loss
that diverged, Ctrl-C) is not a crash and is never restarted; a rank that keeps dying uses the
restarts up and the run fails with every attempt listed. torchrun restarts groups itself (its own
``--max-restarts``); a rank it restarts finds the checkpoint by itself (``worker.restarted_from``).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from .checkpoint import resumable_step


def record(cfg, run_dir, cause, reached: int | None, attempt: int) -> dict:
    """What one restart is about to do, after ``cause`` (a ``failures.Ending``) ended attempt ``attempt``."""
    step = resumable_step(Path(run_dir), cfg)
    origin = None
    if step is None and cfg.resume:  # nothing written here yet: the checkpoint this run started from
        origin = resumable_step(Path(cfg.resume), cfg)
    resumed_from = step if step is not None else (origin or 0)
    return {"attempt": attempt, "rank": cause.rank, "how": cause.what(), "time": cause.time,
            "when": time.strftime("%H:%M:%S", time.localtime(cause.time)),
            "reached_step": reached, "resumed_from_step": resumed_from,
            "steps_lost": None if reached is None else max(0, reached - resumed_from),
            "from": str(run_dir) if step is not None else (cfg.resume if origin is not None else None)}


def next_config(cfg, run_dir, history: list[dict]):
    """The config of the next attempt: resume from the checkpoint :func:`record` chose (or from the
    start), the restarts so far kept for the records."""
    return dataclasses.replace(cfg, resume=history[-1]["from"], restarts=list(history))


def announce(restart: dict, limit: int) -> str:
    lost = "" if restart["steps_lost"] is None else f"; {restart['steps_lost']} step(s) to do again"
    where = (f"the checkpoint of step {restart['resumed_from_step']}" if restart["from"] else
             "the start (no checkpoint yet)")
    return (f"paralab: restart {restart['attempt']}/{limit}: rank {restart['rank']} {restart['how']} at "
            f"{restart['when']}; every rank starts again from {where}{lost}")


def exhausted(history: list[dict]) -> list[str]:
    """The lines that end a run whose restarts are used up: what happened each time."""
    lines = [f"paralab: the run failed {len(history) + 1} times and --max-restarts {len(history)} is used up; "
             "the earlier failures:"]
    for r in history:
        lines.append(f"paralab:   attempt {r['attempt']}: rank {r['rank']} {r['how']} at {r['when']} "
                     f"(in step {r['reached_step']}, restarted from step {r['resumed_from_step']})")
    return lines
