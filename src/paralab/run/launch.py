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
stops the rest, names the rank that failed first and how, and the command
that resumes, or starts the group again (``local.py``). In the manual and torchrun forms each process prints its
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
import traceback

from ..progress import emit
from .config import RunConfig
from .failures import GroupNotFormed, describe, is_peer_loss, resume_hint
from .hangs import explain_hang
from .local import run_local
from .warm import die_with_parent
from .rendezvous import choose_gloo_interface, free_port, pin, slurm_place, tcp_url, under_torchrun

def launch(cfg: RunConfig, run_dir: str, on_end=None) -> int:
    """Run every rank this command is responsible for; return the exit code. ``on_end``: called before a
    rank that is this process ends it (the torchrun, Slurm and manual forms end the process themselves)."""
    if under_torchrun():
        cfg.launched_by = "torchrun"
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        pin(local, cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:  # ranks on other hosts
            cfg.master_addr = os.environ.get("MASTER_ADDR", cfg.master_addr)
            choose_gloo_interface(cfg, rank)
        _leave(_run_here(cfg, rank, world, local, None, run_dir), on_end)
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
                         tcp_url(place.master_addr, place.master_port), run_dir), on_end)
    if cfg.world_size is not None:
        cfg.launched_by = "manual"
        pin(0, cfg, 1)
        choose_gloo_interface(cfg, cfg.rank)
        _leave(_run_here(cfg, cfg.rank, cfg.world_size, 0, tcp_url(cfg.master_addr, cfg.master_port or 29500),
                         run_dir), on_end)
    if cfg.network and cfg.workers > 1:
        return _run_on_network(cfg, run_dir)
    init_method = tcp_url("127.0.0.1", cfg.master_port or free_port())
    if cfg.workers == 1:
        pin(0, cfg, 1)
        return _run_here(cfg, 0, 1, 0, init_method, run_dir)
    return run_local(cfg, init_method, run_dir)


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
        die_with_parent(os.getppid())

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
            return run_local(cfg, net.init_method(cfg.master_port), run_dir)
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


def _leave(code: int, on_end=None):
    """End a torchrun or manual rank once its work is done and written (``on_end`` first: the run's hold on
    its folder let go).

    It skips the interpreter's shutdown, as spawned ranks do: tearing down
    gloo's background threads in static destructors occasionally aborts the
    process ("terminate called without an active exception") after a run that
    succeeded, which would turn a good run into a failed exit code.
    """
    if on_end is not None:
        on_end()
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
    except GroupNotFormed as exc:  # nothing ran: what to do, without a traceback
        print(f"paralab: {exc}", file=sys.stderr, flush=True)
        emit("error", rank=rank, message=describe(exc), resume=None)
        return 1
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
