"""Warm starts: ranks and runs begin in a process that has already imported what they need.

Starting a rank used to mean a fresh interpreter importing torch and paralab, then, at the first
optimizer, ``torch._dynamo``: ``torch.optim.Optimizer`` imports it in ``add_param_group`` (which its
constructor calls), ``zero_grad``, ``state_dict`` and ``step`` (behind ``torch._disable_dynamo`` and
``_use_grad_for_differentiable``), with no switch PyTorch documents to skip it. It computes nothing,
so importing it earlier changes no arithmetic; importing it once, in a parent that then forks, means
no rank pays for it. :data:`PRELOAD` names what a rank imports; a child forked after
:func:`prepare` starts with all of it in memory.

How ranks start (``--start``, :func:`rank_context`):

- ``auto``: **fork** from this process when that is safe (:func:`fork_hazard` is None): it is
  paralab's own command line or a warm child (:func:`mark_fresh`: known to have run nothing
  before), the run is CPU-only (CUDA cannot survive a fork once initialised, and validating a
  CUDA run initialises it), it runs one Python thread and no OS thread has started since it was
  marked (so no OpenMP pool exists to be orphaned in the child); else a **forkserver**
  preloaded with :data:`PRELOAD`: a fresh interpreter that imports once, never runs a kernel nor
  touches CUDA, and forks each rank on request.
- ``forkserver``: always the preloaded forkserver.
- ``spawn``: a fresh interpreter per rank (no preloading: how ranks started before).

Runs started by the runner (``compare``, ``sweep``, the benchmarks) come from :func:`start`: one
preloaded forkserver per calling process, kept for all its runs; each run is a child of it (its
own session, its output into a file) that then forks its ranks under ``auto``. Environment
variables read while torch loads (``OMP_NUM_THREADS``, ``MKL_*``) take the value the forkserver
started with; the rest are each child's own (:func:`start` passes the caller's current ones).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import sys
import threading

from ..errors import exit_code

#: what a rank imports before its first step; preloaded by :func:`prepare` and by the forkserver
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "paralab.run.worker", "paralab.run.launch",
           "paralab.check.verdict")

START_METHODS = ("auto", "forkserver", "spawn")

_threads_when_fresh: int | None = None  # this process's OS threads when mark_fresh() was called; None: never


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: count Python's own only
        return threading.active_count()


def mark_fresh() -> None:
    """Say that this process has run no kernel yet (a command line's process, a warm child), and
    note its threads: any started later (an OpenMP pool) make forking from it unsafe."""
    global _threads_when_fresh
    _threads_when_fresh = _os_threads()


def prepare() -> None:
    """Import :data:`PRELOAD` here (those already imported cost nothing)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def may_use_cuda(cfg) -> bool:
    """Whether the run could initialise CUDA (so no process it forks from may have)."""
    import torch
    if cfg.device == "cpu" and cfg.backend != "nccl":
        return False
    return cfg.device == "cuda" or cfg.backend == "nccl" or torch.version.cuda is not None \
        or getattr(torch.version, "hip", None) is not None


def fork_hazard(cfg) -> str | None:
    """Why forking ranks from this process would be unsafe, or None when it is safe."""
    if sys.platform != "linux":
        return "fork is only used on Linux"
    if may_use_cuda(cfg):
        return "the run may use CUDA"
    if _threads_when_fresh is None:
        return "this process may have run kernels before (it is not paralab's command line nor a warm child)"
    if threading.active_count() > 1:
        return "this process runs other Python threads"
    if _os_threads() > _threads_when_fresh:
        return "this process has started threads (an OpenMP pool?) since it began"
    return None


def forkserver():
    """The forkserver context, preloaded with :data:`PRELOAD` (started by its first child); the server alone
    also imports ``server_exit``, so that it ends at once when its caller does (and its runs with it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, "paralab.run.server_exit"])
    return ctx


def start_early() -> None:
    """Start this process's preloaded forkserver now: it imports :data:`PRELOAD` on a core of its own
    while the caller imports the same and plans its runs (nothing waits for it until the first run)."""
    from multiprocessing import forkserver as server
    forkserver()
    server.ensure_running()


def rank_context(cfg):
    """The multiprocessing context this launcher starts its local ranks from, and its name."""
    if cfg.start == "spawn":
        return mp.get_context("spawn"), "spawn"
    if cfg.start == "auto":
        prepare()
        if fork_hazard(cfg) is None:
            return mp.get_context("fork"), "fork"
    return forkserver(), "forkserver"


def die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent ``parent`` dies, however it dies (SIGKILL
    included). A rank asks it of its launcher, a run of the forkserver it was forked from (which ends when
    the process that started the run ends), so killing ``compare`` ends its run and the run's ranks."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call above took effect
        os._exit(1)


# ---------------------------------------------------------------------------- whole runs (the runner)
def start(target, args: tuple, *, output: str, env: dict, cwd: str, errors: str | None = None):
    """Start ``target(*args)`` in a child of this process's preloaded forkserver; return the Process.

    The child leads a session of its own (so it and every rank it starts can be stopped together:
    ``os.killpg(process.pid, ...)``), works in ``cwd`` with environment ``env``, and writes its
    standard output to the file ``output``, its standard error to ``errors`` (default: ``output``).
    Its exit code is ``target``'s return value. It dies with the forkserver, which ends when this process
    ends: a killed caller leaves no run training.
    """
    process = forkserver().Process(target=_child, args=(target, args, output, errors or output, dict(env), cwd),
                                   daemon=False)
    process.start()
    return process


def start_fresh(argv: list[str], stdin: bytes, *, output: str, env: dict, cwd: str) -> "Fresh":
    """Start ``argv`` as a fresh interpreter would, in its own session, output to the file ``output``,
    ``stdin`` on its standard input: what :func:`start` replaces (``--start spawn`` keeps it)."""
    return Fresh(argv, stdin, output=output, env=env, cwd=cwd)


class Fresh:
    """A child in a fresh interpreter, seen through the part of ``multiprocessing.Process`` the
    runner uses: ``pid``, ``sentinel`` (a pidfd, readable once it has ended), ``exitcode``, ``join``."""

    def __init__(self, argv, stdin: bytes, *, output: str, env: dict, cwd: str):
        import subprocess
        with open(output, "ab") as out:
            parent = os.getpid()
            self._popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                           env=env, cwd=cwd, start_new_session=True,
                                           preexec_fn=lambda: die_with_parent(parent))
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)
        try:
            self._popen.stdin.write(stdin)
            self._popen.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        import subprocess
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        if self.sentinel is not None:  # ended: the pidfd is not needed any more
            os.close(self.sentinel)
            self.sentinel = None


def _child(target, args, output, errors, env, cwd) -> None:
    # Die with the forkserver, and let it end when the process that asked for this run ends. multiprocessing
    # hands every child the write end of the forkserver's "alive" pipe (so that a child can be a client too),
    # and the server ends only at that pipe's end of file: a run that kept it would keep the server, and so
    # itself, alive after its caller was killed. A run that needs a forkserver of its own starts one.
    from multiprocessing import forkserver as server
    alive = server._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        server._forkserver._forkserver_alive_fd = None
    die_with_parent(os.getppid())
    mark_fresh()  # forked from a server that has only imported
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for path, fd in ((output, 1), (errors, 2)):  # appending: one file can take both
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        code = target(*args)
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:  # noqa: BLE001 - a traceback in the output, exit 1
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
