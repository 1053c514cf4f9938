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

Failures. A rank that raises makes every rank stop: locally, the launcher
sees the first rank die, terminates the others (SIGTERM, then SIGKILL) and
exits 1 printing the failed rank's traceback; workers also die with the
launcher (``PR_SET_PDEATHSIG``), so nothing is orphaned. In the manual and
torchrun forms each process prints its own traceback and exits 1; its peers
see the connection drop (or hit ``--timeout``) and exit 1 too. A check FAIL
(exit 1) or a diverged loss (exit 3) is an orderly exit that every rank
takes together, not a crash.

With gloo across hosts, the interface gloo uses is the one that routes to
``--master-addr`` unless ``GLOO_SOCKET_IFNAME`` says otherwise.

The rendezvous has no authentication (a property of torch.distributed):
local runs bind to 127.0.0.1; multi-node runs belong on a trusted network.
"""
from __future__ import annotations

import ipaddress
import os
import random
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .config import RunConfig
from .progress import emit

GRACE_S = 2.0  # after a failure: how long the other ranks get to exit (and say why) before SIGTERM
KILL_S = 5.0   # after SIGTERM: how long before SIGKILL

# Errors a rank raises because *another* rank died: the launcher reports the
# rank whose error is not one of these (the cause), not the ones it brought down.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
             "timed out", "DistNetworkError", "DistBackendError", "Connection refused")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the rendezvous to bind a few seconds later.

    Picked below the kernel's ephemeral range where possible: outgoing connections
    take their local ports from that range, so one of them could grab a port from
    it in between (a real risk with many runs at once). 29500-29599 (torch's
    default) is avoided too.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    pick = random.SystemRandom()
    candidates = [pick.randrange(max(1024, low - 10000), low) for _ in range(20)] if low > 11024 else []
    for port in candidates + [0]:  # 0: let the kernel choose
        if 29500 <= port < 29600:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def tcp_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # IPv6 literal
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


# ---------------------------------------------------------------------------- placement
def pin(local_rank: int, cfg: RunConfig, local_workers: int) -> None:
    """Give each local rank its own cores (where the OS allows) and a matching thread count."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    if cfg.cores_per_worker:
        c = cfg.cores_per_worker
        mine = allowed[local_rank * c:(local_rank + 1) * c]
        if len(mine) < c:
            print(f"paralab: rank {local_rank}: only {len(allowed)} core(s) allowed here; "
                  f"cannot give {c} to each of {local_workers} worker(s); running unpinned",
                  file=sys.stderr, flush=True)
        elif hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, mine)
            except OSError as exc:
                print(f"paralab: rank {local_rank}: could not pin to cores {mine} ({exc}); running unpinned",
                      file=sys.stderr, flush=True)
        torch.set_num_threads(c)
    elif local_workers > 1:
        torch.set_num_threads(max(1, len(allowed) // local_workers))


def interface_towards(host: str) -> str | None:
    """The network interface this machine uses to reach ``host`` (IPv4, Linux), or None.

    Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    """
    try:
        import fcntl
        import struct
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        if ipaddress.ip_address(addr).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except (OSError, ImportError, IndexError, ValueError):
        return None
    return None


def choose_gloo_interface(cfg: RunConfig, rank: int) -> None:
    """Multi-host gloo: use the interface that routes to the master, unless the user chose one."""
    if cfg.backend == "nccl" or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = interface_towards(cfg.master_addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        print(f"paralab: rank {rank}: gloo uses interface {name} (the route to {cfg.master_addr}); "
              "set GLOO_SOCKET_IFNAME to choose another", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- entry points
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
    if cfg.world_size is not None:
        cfg.launched_by = "manual"
        pin(0, cfg, 1)
        choose_gloo_interface(cfg, cfg.rank)
        _leave(_run_here(cfg, cfg.rank, cfg.world_size, 0, tcp_url(cfg.master_addr, cfg.master_port or 29500),
                         run_dir))
    init_method = tcp_url("127.0.0.1", cfg.master_port or free_port())
    if cfg.workers == 1:
        pin(0, cfg, 1)
        return _run_here(cfg, 0, 1, 0, init_method, run_dir)
    return _run_local(cfg, init_method, run_dir)


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
        print(f"paralab: rank {rank} failed", file=sys.stderr, flush=True)
        emit("error", rank=rank, message=describe(exc))
        return 1


def describe(exc: BaseException) -> str:
    """``Type: message``, as the last line of a traceback says it (bounded)."""
    lines = str(exc).strip().splitlines()
    return (f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)[:300]


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


def _entry(rank: int, cfg: RunConfig, world: int, init_method: str, run_dir: str, parent: int,
           errors) -> None:
    """One spawned rank. An exception goes to the launcher as text, with the time it happened."""
    _die_with_parent(parent)
    from .worker import run_worker
    pin(rank, cfg, world)
    try:
        run_worker(cfg, rank, world, rank, init_method, run_dir)
        code = 0
    except SystemExit as exc:  # an orderly non-zero exit (FAIL verdict, diverged loss)
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # noqa: BLE001
        # bounded: a pipe holds 64 KiB
        errors.put((rank, time.time(), traceback.format_exc()[-20000:], describe(exc)))
        code = 1
    # Everything is written and the process group is gone; skip the interpreter's teardown
    # of torch, which takes about a second per rank and has nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_peer_loss(text: str) -> bool:
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return any(marker in last for marker in PEER_LOSS)


def _run_local(cfg: RunConfig, init_method: str, run_dir: str) -> int:
    """Spawn cfg.workers ranks here and supervise them; the first failure stops them all."""
    world = cfg.workers
    spawn = mp.get_context("spawn")
    errors = spawn.SimpleQueue()
    procs = [spawn.Process(target=_entry, name=f"paralab-rank{r}",
                           args=(r, cfg, world, init_method, run_dir, os.getpid(), errors))
             for r in range(world)]
    for p in procs:
        p.start()
    by_sentinel = {p.sentinel: r for r, p in enumerate(procs)}
    codes: dict[int, int] = {}
    first_crash, crash_time = None, None  # the first rank seen to crash, and when
    try:
        while len(codes) < world:
            running = [procs[r].sentinel for r in range(world) if r not in codes]
            timeout = None if crash_time is None else max(0.0, crash_time + GRACE_S - time.monotonic())
            for sentinel in wait(running, timeout=timeout):
                r = by_sentinel[sentinel]
                procs[r].join()
                codes[r] = procs[r].exitcode
                # killed by a signal, or exited non-zero after reporting an exception
                crashed = codes[r] < 0 or (codes[r] != 0 and not errors.empty())
                if crashed and first_crash is None:
                    first_crash, crash_time = r, time.monotonic()
            if crash_time is not None and time.monotonic() >= crash_time + GRACE_S:
                break  # the others had their chance to exit on their own
    except BaseException:  # Ctrl-C, or the launcher itself failing: take the workers down with it
        _stop(procs)
        raise
    _stop(procs)
    if first_crash is None:
        return max(codes.values(), default=0)

    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if reports:
        # the cause: the earliest error that is not a consequence of losing a peer
        rank, _, text, summary = min(reports, key=lambda e: (_is_peer_loss(e[2]), e[1]))
        print(f"paralab: rank {rank} failed; all ranks stopped.\n{text.rstrip()}", file=sys.stderr)
        emit("error", rank=rank, message=summary)
        for other, _, other_text, _ in sorted(reports):
            if other != rank:
                last = other_text.strip().splitlines()[-1][:200] if other_text.strip() else ""
                print(f"paralab: rank {other} failed after it: {last}", file=sys.stderr)
    else:
        code = codes[first_crash]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"paralab: rank {first_crash} died ({how}); all ranks stopped.", file=sys.stderr)
        emit("error", rank=first_crash, message=f"rank {first_crash} died ({how})",
             signal=-code if code < 0 else None)
    return 1


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
