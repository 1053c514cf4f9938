"""Start the ranks of a run: local worker processes, one manual rank, or under torchrun.

Three ways to get a process group, one code path after it (``worker.run_worker``):

- **local** (``--workers N``): N processes spawned here, rendezvous on
  127.0.0.1 at a free port (``tcp://``). ``--cores-per-worker C`` pins rank r
  to cores [rC, rC+C) of the cores this process may use and gives torch C
  threads; without it the cores are shared out evenly.
- **manual** (``--world-size W --rank R --master-addr A --master-port P``,
  as in CS744): this process is rank R; rendezvous over ``tcp://A:P``. Run
  the same command, with its own ``--rank``, on every node.
- **torchrun** (``torchrun --nproc-per-node K -m paralab train ...``): RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT come from the
  environment (``env://``).
- **Slurm** (``srun -n N paralab train ...``): each task is one rank; rank,
  world, local rank and rank 0's host come from Slurm's environment, the
  port from MASTER_PORT or the job id (``rendezvous.slurm_place``). torchrun
  under srun is torchrun's.

Failures. A rank that fails makes every rank stop: locally, the launcher
sees the first rank end, gives the others ``GRACE_S`` to end on their own,
terminates the rest (SIGTERM, then SIGKILL) and exits 1; workers also die
with the launcher (``PR_SET_PDEATHSIG``), so nothing is orphaned. It then
names the rank that failed first and how, and the command that resumes
(``failures.py``). In the manual and torchrun forms each process prints its
own traceback (and the resume command) and exits 1; its peers see the
connection drop (or hit ``--timeout``) and exit 1 too. A check FAIL (exit 1)
or a diverged loss (exit 3) is an orderly exit every rank takes together.
Ports, interfaces and core pinning are ``rendezvous.py``'s.

The rendezvous has no authentication (a property of torch.distributed):
local runs bind to 127.0.0.1; multi-node runs belong on a trusted network.

``--network RATE`` (local workers only, ``network.py``): each rank runs in
a network namespace of its own on a shaped link to a bridge, the rendezvous
is rank 0's address there, and the namespaces are deleted however the run
ends (:func:`_run_on_network`).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait

from ..progress import emit
from .config import RunConfig
from .failures import Ending, describe, explain, is_peer_loss, resume_hint
from . import restart
from .hangs import explain_hang
from .rendezvous import choose_gloo_interface, free_port, pin, slurm_place, tcp_url, under_slurm, under_torchrun
from .warm import rank_context

GRACE_S = 2.0  # after a failure: how long the other ranks get to exit (and say why) before SIGTERM
KILL_S = 5.0   # after SIGTERM: how long before SIGKILL
POLL_S = 0.2   # once a rank has ended: how often the launcher reads the others' reports

def launch(cfg: RunConfig, run_dir: str) -> int:
    """Run every rank this command is responsible for; return the exit code."""
    if under_torchrun():
        cfg.launched_by = "torchrun"
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        pin(local, cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:  # ranks on other hosts
            cfg.master_addr = os.environ.get("MASTER_ADDR", cfg.master_addr)
            choose_gloo_interface(cfg, rank)
        _leave(_run_here(cfg, rank, world, local, None, run_dir))
    if cfg.launched_by == "slurm":  # the command line saw under_slurm()
        place = slurm_place(master_port=cfg.master_port)  # an unreadable environment: exit 2, nothing started
        cfg.master_addr, cfg.master_port = place.master_addr, place.master_port
        if place.bound():  # the task's cores are its own: pin within them
            pin(0, cfg, 1)
        else:
            pin(place.local_rank, cfg, place.local_world)
        if place.nodes > 1:
            choose_gloo_interface(cfg, place.rank)
        _leave(_run_here(cfg, place.rank, place.world, place.local_rank,
                         tcp_url(place.master_addr, place.master_port), run_dir))
    if cfg.world_size is not None:
        cfg.launched_by = "manual"
        pin(0, cfg, 1)
        choose_gloo_interface(cfg, cfg.rank)
        _leave(_run_here(cfg, cfg.rank, cfg.world_size, 0, tcp_url(cfg.master_addr, cfg.master_port or 29500),
                         run_dir))
    if cfg.network and cfg.workers > 1:
        return _run_on_network(cfg, run_dir)
    init_method = tcp_url("127.0.0.1", cfg.master_port or free_port())
    if cfg.workers == 1:
        pin(0, cfg, 1)
        return _run_here(cfg, 0, 1, 0, init_method, run_dir)
    return _run_local(cfg, init_method, run_dir)


def _run_on_network(cfg: RunConfig, run_dir: str) -> int:
    """``--network``: the local ranks, each in its own namespace on a shaped link (``network.py``).

    The namespaces are deleted however the run ends: success, a failed or killed rank, Ctrl-C, or
    SIGTERM (what ``paralab compare`` sends a run it stops), which is turned into an exception here
    so that the ranks are stopped and the ``finally`` below deletes the namespaces.
    """
    from . import network

    if not network.privileged():
        return _run_in_user_namespace(cfg, run_dir)
    if network.in_sandbox():  # the no-root path's launcher: go when the one outside goes, however it ends
        _die_with_parent(os.getppid())

    def terminated(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        try:
            net = network.Network(network.parse(cfg.network), cfg.workers)
            net.up()
        except network.NetworkError as exc:
            print(f"paralab: error: --network {cfg.network}: could not build the emulated network: {exc}",
                  file=sys.stderr, flush=True)
            emit("error", message=f"--network: {exc}")
            return 2
        try:
            cfg.network_emulated = net.record()
            print(f"paralab: emulated network: {network.describe(cfg.network_emulated)}", file=sys.stderr, flush=True)
            return _run_local(cfg, net.init_method(cfg.master_port), run_dir)
        finally:
            net.down()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_in_user_namespace(cfg: RunConfig, run_dir: str) -> int:
    """``--network`` without root: run this launch again, as paralab's runner child, inside a user
    namespace where this user is root of its own network and mount namespaces (``network.py``).

    The child builds the network and supervises the ranks as the root path does; its output, progress
    events and run directory are this run's. It runs in a process group of its own, so Ctrl-C and
    SIGTERM reach it once, passed on from here; if this process is killed, the kernel stops the child
    (it asked to die with its parent), and everything it made goes with the user namespace.
    """
    import json
    import subprocess
    from . import network

    cmd = network.sandbox_command([sys.executable, "-m", "paralab.run.runner", str(run_dir)])
    print(f"paralab: not root: building the emulated network inside a user namespace ({' '.join(cmd[:5])})",
          file=sys.stderr, flush=True)
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, env={**os.environ, network.SANDBOX_ENV: "1"},
                             process_group=0)

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        child.stdin.write(json.dumps(cfg.to_dict()).encode())
        child.stdin.close()
        code = child.wait()
        return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:
            child.kill()
            child.wait()


def _leave(code: int):
    """End a torchrun or manual rank once its work is done and written.

    It skips the interpreter's shutdown, as spawned ranks do: tearing down
    gloo's background threads in static destructors occasionally aborts the
    process ("terminate called without an active exception") after a run that
    succeeded, which would turn a good run into a failed exit code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_here(cfg, rank, world, local_rank, init_method, run_dir) -> int:
    """This process is one rank: run it, print its traceback if it fails."""
    from .worker import run_worker
    try:
        run_worker(cfg, rank, world, local_rank, init_method, run_dir)
        return 0
    except SystemExit as exc:  # an orderly non-zero exit (check FAIL, diverged loss)
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - report the traceback, exit non-zero
        traceback.print_exc()
        lost = is_peer_loss(traceback.format_exc())  # then it is a consequence: another rank failed first
        print(f"paralab: rank {rank} failed" + (" after losing a peer: the rank that failed first is another one "
                                               "(see its output)" if lost else ""), file=sys.stderr, flush=True)
        hang = explain_hang(run_dir) if world > 1 else []  # every rank's op log this run directory holds
        if hang:
            print("\n".join(hang), file=sys.stderr, flush=True)
        hint = None
        if cfg.launched_by not in ("torchrun", "slurm") or rank == 0:  # torchrun, srun: once, not once per rank
            hint = resume_hint(cfg, run_dir, ranks=[rank] if world > 1 else None)
            if hint:
                print("\n".join(hint[1]), file=sys.stderr, flush=True)
        emit("error", rank=rank, message=describe(exc), resume=hint[0] if hint else None)
        return 1


# ---------------------------------------------------------------------------- local workers
def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when the launcher dies, however it dies."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call above took effect
        os._exit(1)


def _entry(rank: int, cfg: RunConfig, world: int, init_method: str, run_dir: str, parent: int | None,
           reports) -> None:
    """One local rank. Before a non-zero exit it tells the launcher why (a dict on ``reports``):
    an exception, as text with the time it happened, or an orderly exit. A rank that dies
    without a word (a signal, ``os._exit`` in native code) is explained by its exit code.
    ``parent``: the launcher's pid, or None when a forkserver (which goes when the launcher goes)
    is this process's parent."""
    _die_with_parent(os.getppid() if parent is None else parent)
    from . import worker
    pin(rank, cfg, world)
    try:
        if cfg.network_emulated:  # --network: into this rank's own namespace before any socket exists
            from .network import join
            join(cfg.network_emulated, rank)
        worker.run_worker(cfg, rank, world, rank, init_method, run_dir)
        code = 0
    except SystemExit as exc:  # an orderly non-zero exit (FAIL verdict, diverged loss)
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if code:
            reports.put({"rank": rank, "kind": "exit", "time": time.time(), "code": code,
                         "summary": f"an orderly exit (code {code})"})
    except KeyboardInterrupt:
        code = 130
        reports.put({"rank": rank, "kind": "exit", "time": time.time(), "code": code, "summary": "interrupted"})
    except BaseException as exc:  # noqa: BLE001
        # bounded: a pipe holds 64 KiB (and the launcher reads it as the ranks end)
        reports.put({"rank": rank, "kind": "exception", "time": time.time(), "step": worker.at_step,
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


def _run_local(cfg: RunConfig, init_method: str, run_dir: str) -> int:
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
    explained = explain([endings[r] for r in range(world)])
    reached = max((e.report.get("step") for e in endings.values() if e.report and e.report.get("step") is not None),
                  default=None)
    if explained is None:
        return max((e.code for e in endings.values() if e.code is not None), default=0), None, reached

    cause, lines = explained
    lines += explain_hang(run_dir, {e.rank: e.what() for e in endings.values() if e.kind != "stopped"})
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
