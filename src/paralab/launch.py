"""Start the ranks of a run: local worker processes, one manual rank, or under torchrun.

- local (``--workers N``): N processes spawned here, rendezvous on
  127.0.0.1 at a free port; ``--cores-per-worker C`` pins rank r to cores
  [rC, rC+C) and gives torch C threads. The first rank to fail stops the
  others, and its traceback is printed.
- manual (``--world-size W --rank R --master-addr A --master-port P``):
  this process is rank R; rendezvous over tcp:// as in CS744.
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the
  environment (env://).

The rendezvous has no authentication: multi-node runs belong on a trusted network.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

from .config import RunConfig


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(rank: int, cfg: RunConfig, local_workers: int) -> None:
    """Give each local rank its own cores (where the OS allows) and a matching thread count."""
    cores = os.cpu_count() or 1
    if cfg.cores_per_worker:
        c = cfg.cores_per_worker
        if hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, range(rank * c, (rank + 1) * c))
            except OSError as exc:
                print(f"paralab: rank {rank}: could not pin to cores ({exc}); running unpinned",
                      file=sys.stderr)
        torch.set_num_threads(c)
    elif local_workers > 1:
        torch.set_num_threads(max(1, cores // local_workers))


def _entry(local_rank: int, cfg: RunConfig, world: int, init_method: str, run_dir: str, codes) -> None:
    from .worker import run_worker
    pin(local_rank, cfg, world)
    try:
        run_worker(cfg, local_rank, world, local_rank, init_method, run_dir)
        codes.put((local_rank, 0))
    except SystemExit as exc:  # a FAIL verdict or a diverged loss: not a crash
        codes.put((local_rank, int(exc.code or 0)))


def launch(cfg: RunConfig, run_dir: str) -> int:
    """Run every rank this command is responsible for; return the exit code."""
    from .worker import run_worker

    if under_torchrun():
        cfg.launched_by = "torchrun"
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        return _run_here(run_worker, cfg, rank, world, local, None, run_dir)
    if cfg.world_size is not None:
        cfg.launched_by = "manual"
        port = cfg.master_port or 29500
        return _run_here(run_worker, cfg, cfg.rank, cfg.world_size, 0,
                         f"tcp://{cfg.master_addr}:{port}", run_dir)
    init_method = f"tcp://127.0.0.1:{cfg.master_port or free_port()}"
    if cfg.workers == 1:
        pin(0, cfg, 1)
        return _run_here(run_worker, cfg, 0, 1, 0, init_method, run_dir)

    spawn = mp.get_context("spawn")
    codes = spawn.SimpleQueue()
    context = mp.start_processes(_entry, args=(cfg, cfg.workers, init_method, run_dir, codes),
                                 nprocs=cfg.workers, start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as exc:
        print(f"paralab: rank {exc.error_index} failed; all ranks stopped.\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"paralab: rank {exc.error_index} exited with code {exc.exit_code}; all ranks stopped.",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        raise
    results = []
    while not codes.empty():
        results.append(codes.get())
    return max((code for _, code in results), default=0)


def _run_here(run_worker, cfg, rank, world, local_rank, init_method, run_dir) -> int:
    try:
        run_worker(cfg, rank, world, local_rank, init_method, run_dir)
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception:  # noqa: BLE001 - report the traceback, exit non-zero
        traceback.print_exc()
        print(f"paralab: rank {rank} failed", file=sys.stderr)
        return 1
