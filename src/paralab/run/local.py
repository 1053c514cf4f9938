"""Local ranks (``--workers N``): start them warm, supervise them, stop them all at the first failure.

The launcher starts N rank processes (``warm.rank_context``: forked from here once it has imported
what a rank needs, or from a preloaded forkserver), each pinned to its cores (``rendezvous.pin``),
in its network namespace under ``--network``, dying with the launcher (``PR_SET_PDEATHSIG``), so
nothing is orphaned. A rank that fails tells the launcher why before it exits (an exception with
its traceback and the step it was in); one that dies without a word is known by its exit code or
signal. The launcher waits for the first rank to end; after a failure it gives the others
``GRACE_S`` to end on their own (and say why), stops the rest (SIGTERM, then SIGKILL), names the
rank that failed first and how (``failures.py``) and where the ranks' op logs disagree
(``hangs.py``), then prints the command that resumes, or, with ``--max-restarts``, starts the whole
group again from the last checkpoint (``restart.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

from ..errors import exit_code
from ..progress import emit
from . import restart
from .config import RunConfig
from .failures import Ending, describe, explain, resume_hint
from .hangs import disagrees, explain_hang
from .rendezvous import loopback_interface, pin
from .warm import die_with_parent, rank_context

GRACE_S = 2.0  # after a failure: how long the other ranks get to exit (and say why) before SIGTERM
KILL_S = 5.0   # after SIGTERM: how long before SIGKILL
POLL_S = 0.2   # once a rank has ended: how often the launcher reads the others' reports


def _entry(rank: int, cfg: RunConfig, world: int, init_method: str, run_dir: str, parent: int | None,
           reports) -> None:
    """One local rank. Before a non-zero exit it tells the launcher why (a dict on ``reports``):
    an exception, as text with the time it happened, or an orderly exit. A rank that dies
    without a word (a signal, ``os._exit`` in native code) is explained by its exit code.
    ``parent``: the launcher's pid, or None when a forkserver (which goes when the launcher goes)
    is this process's parent."""
    die_with_parent(os.getppid() if parent is None else parent)
    from . import loop, worker
    reached = loop.Reached()  # the steps this rank has done, for the report if it fails
    pin(rank, cfg, world)
    try:
        if cfg.network_emulated:  # --network: into this rank's own namespace before any socket exists
            from .network import join
            join(cfg.network_emulated, rank)
        elif "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo's sockets on the loopback alone, as the store's
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        worker.run_worker(cfg, rank, world, rank, init_method, run_dir, reached)
        code = 0
    except SystemExit as exc:  # an orderly non-zero exit (FAIL verdict, diverged loss)
        code = exit_code(exc)
        if code:
            reports.put({"rank": rank, "kind": "exit", "time": time.time(), "code": code,
                         "summary": f"an orderly exit (code {code})"})
    except KeyboardInterrupt:
        code = 130
        reports.put({"rank": rank, "kind": "exit", "time": time.time(), "code": code, "summary": "interrupted"})
    except BaseException as exc:  # noqa: BLE001
        # bounded: a pipe holds 64 KiB (and the launcher reads it as the ranks end)
        reports.put({"rank": rank, "kind": "exception", "time": time.time(), "step": reached.steps,
                     "traceback": traceback.format_exc()[-20000:], "summary": describe(exc)})
        code = 1
    # Everything is written and the process group is gone; skip the interpreter's teardown
    # of torch, which takes about a second per rank and has nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _drain(reports, received: dict[int, dict]) -> None:
    while not reports.empty():
        report = reports.get()
        received[report["rank"]] = report


def run_local(cfg: RunConfig, init_method: str, run_dir: str) -> int:
    """Start cfg.workers ranks here and supervise them; the first failure stops them all. With
    ``--max-restarts N``, a group that crashed starts again, whole, from the run's last complete
    checkpoint, up to N times (``restart.py``)."""
    history: list[dict] = []
    while True:
        final = len(history) >= cfg.max_restarts
        code, cause, reached = _run_group(cfg, init_method, run_dir, final=final)
        if cause is None or final:
            if history and cause is not None:
                print("\n".join(restart.exhausted(history)), file=sys.stderr, flush=True)
            return code
        history.append(restart.record(cfg, run_dir, cause, reached, attempt=len(history) + 1))
        print(restart.announce(history[-1], cfg.max_restarts), file=sys.stderr, flush=True)
        emit("restart", **history[-1])
        cfg = restart.next_config(cfg, run_dir, history)


def _run_group(cfg: RunConfig, init_method: str, run_dir: str, final: bool = True):
    """One start of every rank, supervised to its end: (exit code, the rank that failed first as
    an :class:`Ending` or None, the furthest step a rank reported being in). ``final``: no restart
    follows, so a failure is explained with the command that resumes."""
    world = cfg.workers
    started = time.time()
    ctx, cfg.started_by = rank_context(cfg)  # fork from here once warm, where safe (warm.py)
    reports = ctx.SimpleQueue()
    parent = None if cfg.started_by == "forkserver" else os.getpid()
    procs = [ctx.Process(target=_entry, name=f"paralab-rank{r}",
                         args=(r, cfg, world, init_method, run_dir, parent, reports))
             for r in range(world)]
    sys.stdout.flush()  # a forked rank would print what is still buffered here again
    sys.stderr.flush()
    for p in procs:
        p.start()
    by_sentinel = {p.sentinel: r for r, p in enumerate(procs)}
    endings: dict[int, Ending] = {}
    received: dict[int, dict] = {}
    crash_time = None  # when the launcher first saw a rank fail
    try:
        while len(endings) < world:
            running = [procs[r].sentinel for r in range(world) if r not in endings]
            if not endings:  # all running: nothing to read until one ends
                timeout = None
            elif crash_time is None:
                timeout = POLL_S
            else:
                timeout = max(0.0, min(POLL_S, crash_time + GRACE_S - time.monotonic()))
            ready = wait(running, timeout=timeout)
            seen = time.time()
            for sentinel in ready:
                r = by_sentinel[sentinel]
                procs[r].join()
                endings[r] = Ending(r, procs[r].exitcode, seen)
            _drain(reports, received)  # a rank's report is written before it exits
            for e in endings.values():
                e.report = received.get(e.rank)
            if crash_time is None and any(e.failed for e in endings.values()):
                crash_time = time.monotonic()
            if crash_time is not None and time.monotonic() >= crash_time + GRACE_S:
                break  # the others had their chance to exit on their own
    except BaseException:  # Ctrl-C, or the launcher itself failing: take the workers down with it
        _stop(procs)
        raise
    _stop(procs)
    seen = time.time()
    _drain(reports, received)
    for r in range(world):
        if r not in endings:
            endings[r] = Ending(r, procs[r].exitcode, seen, stopped=True)
        endings[r].report = received.get(r)
    steps = {e.rank: e.report["step"] for e in endings.values() if e.report and e.report.get("step") is not None}
    hang = explain_hang(run_dir, {e.rank: e.what() for e in endings.values() if e.kind != "stopped"}, steps,
                        cfg.num_batches) if any(e.failed for e in endings.values()) else []
    explained = explain([endings[r] for r in range(world)], disagreement=disagrees(hang))
    reached = max(steps.values(), default=None)
    if explained is None:
        return max((e.code for e in endings.values() if e.code is not None), default=0), None, reached

    cause, lines = explained
    summary = finished_since(run_dir, started)
    if summary is not None:  # a finished run is finished: nothing to restart, nothing to resume
        print(f"paralab: rank {cause.rank} {cause.what()} after the run's records were written: the run is "
              f"finished ({Path(run_dir) / 'summary.json'}); nothing was lost or restarted", file=sys.stderr,
              flush=True)
        from .records import JOURNAL
        shutil.rmtree(Path(run_dir) / JOURNAL, ignore_errors=True)  # a journal its rank had no time to remove
        failed_check = (summary.get("check") or {}).get("result") == "FAIL"
        return (1 if failed_check or summary.get("error") else 0), None, reached
    # ranks that called different operations: that disagreement is the cause, so it comes first
    lines = hang + lines if disagrees(hang) else lines + hang
    print("\n".join(lines), file=sys.stderr, flush=True)
    if not final:
        return 1, cause, reached
    hint = resume_hint(cfg, run_dir)
    if hint:
        print("\n".join(hint[1]), file=sys.stderr, flush=True)
    kind = cause.kind
    emit("error", rank=cause.rank,
         message=cause.what() if kind == "exception" else f"rank {cause.rank} {cause.what()}",
         signal=-cause.code if kind == "signal" else None,
         exit_code=cause.code if kind == "exit" else None,
         consequences=[{"rank": e.rank, "message": e.what()} for e in endings.values()
                       if e is not cause and e.kind != "ok"],
         resume=hint[0] if hint else None)
    return 1, cause, reached


def finished_since(run_dir, since: float) -> dict | None:
    """The run's ``summary.json`` if this start of the group wrote it (rank 0 writes it last, once every
    rank's records are in): the run is finished whatever happens to a rank after it. None otherwise."""
    path = Path(run_dir) / "summary.json"
    try:
        if path.stat().st_mtime < since:  # an earlier run's, in a folder being extended
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _stop(procs) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left; reap them all."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + KILL_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
