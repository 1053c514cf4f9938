"""Start in-test ranks that end the way paralab's own ranks end.

They start from the session's preloaded forkserver (``paralab.run.warm``: torch and paralab
imported once), as paralab's own runs do, rather than from a fresh interpreter each.

A rank that returns normally tears gloo down in the interpreter's shutdown;
now and then that aborts a process whose work had succeeded ("terminate
called without an active exception", SIGABRT: pytorch/pytorch#65231), which
failed a CI run of this suite once. paralab's launcher skips that shutdown
(``launch._leave``); the test ranks do the same, after the rank function has
returned and written its results. A rank that raises still exits through
``torch.multiprocessing``'s own error path, with its traceback.
"""
from __future__ import annotations

import os
import sys

import torch.multiprocessing as mp


def _run_then_leave(rank: int, nprocs: int, fn, *args) -> None:
    _threads_as_paralab_does(nprocs)
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` from the warm forkserver, each rank ending with
    ``os._exit(0)`` on success."""
    from paralab.run.warm import forkserver
    forkserver()  # the forkserver's preload, set before it first starts
    mp.start_processes(_run_then_leave, args=(nprocs, fn, *args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _threads_as_paralab_does(nprocs: int) -> None:
    """Each rank's share of the cores, as paralab's launcher gives its local workers
    (``rendezvous.pin``). Left at torch's default, every rank ran a pool of one thread per core;
    on AVX2 CPUs a pool thread now and then returned ``logsumexp`` rows 1e-10 away from the same call's
    other rows (seen as a 4e-12 loss deviation of tp 2 in fp64, one run in about seven)."""
    import torch
    torch.set_num_threads(max(1, _cores() // nprocs))


def _run_jobs(rank: int, world: int, groups: list, root: str) -> None:
    """Process ``rank`` of ``len(groups) * world``: rank ``rank % world`` of group ``rank // world``, which runs
    its jobs (``RunConfig``s) in turn, each a whole run with its own process group; a verdict's exit (a check
    FAIL exits 1 on every rank, the summary says why) is written to ``exit<rank>``."""
    import torch

    from paralab.run.worker import run_worker
    torch.set_num_threads(1)
    group, rank = divmod(rank, world)
    for i, cfg in enumerate(groups[group]):
        try:
            run_worker(cfg, rank, world, rank, f"file://{root}/rendezvous-{group}-{i}", cfg.out)
        except SystemExit as exc:
            with open(os.path.join(cfg.out, f"exit{rank}"), "w") as f:
                f.write(str(exc.code))


def run_jobs(world: int, jobs: list, root) -> None:
    """Every job of ``jobs`` (``RunConfig``s of ``world`` workers), the ranks started once, not once per job:
    sets of ``world`` ranks side by side, each running its share of the jobs one after another: twice as many
    ranks as cores (at least two sets), since a run's ranks often wait (for each other, for rank 0's check,
    for its records to be written), and another set's ranks compute meanwhile. On the 2-core AMD EPYC VM the
    recompute matrix took 99 s instead of 146 with one set of 2-worker ranks, fp64's 3- and 4-worker jobs 40 s
    instead of 54. Every rank keeps one thread, so the arithmetic is the same however they share the cores."""
    count = max(1, min(len(jobs), max(2, 2 * _cores() // world)))
    groups = [jobs[g::count] for g in range(count)]
    spawn(_run_jobs, (world, groups, str(root)), world * count)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
