"""Spawn in-test ranks that end the way paralab's own ranks end.

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


def _run_then_leave(rank: int, fn, *args) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each rank ending with ``os._exit(0)`` on success."""
    mp.spawn(_run_then_leave, args=(fn, *args), nprocs=nprocs, join=True)
