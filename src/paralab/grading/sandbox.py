"""Run one untrusted command in a sandbox: bubblewrap for what it sees, limits for what it may use.

A submission is a student's Python file; grading it runs it. Each run is a ``bwrap`` (bubblewrap, the
sandbox Flatpak uses) process tree with

- **its own view of the files**: the whole file system read-only, with a fresh ``/tmp``, ``/dev/shm`` and
  home, the submissions folder and the grader's output folder hidden (an empty folder in their place), then
  the submission's own file (read-only) and its own run folder (writable) put back: it cannot read another
  submission, a reference or another student's results, and can write only its run folder and its ``/tmp``;
- **no network**: its own network namespace, holding a loopback of its own (what the ranks talk over);
- **its own processes**: a PID namespace whose first process dies with the grader (``--die-with-parent``),
  which takes every process in it along; nothing it starts outlives its run;
- **limits**: a wall time (the run's process group killed when it passes), per process CPU seconds and
  address space (``prlimit``), and a cap on processes (a ``pids`` cgroup when the grader is root, which the
  kernel enforces for every process in it; else ``RLIMIT_NPROC``, counted over the grader's user).

:func:`available` says why no sandbox can start here (no ``bwrap``, no user namespaces, no way to cap
processes); ``paralab grade`` then refuses unless ``--no-sandbox``.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PIDS_V1 = Path("/sys/fs/cgroup/pids")
CGROUP_V2 = Path("/sys/fs/cgroup")
_serial = itertools.count()


@dataclass(frozen=True)
class Limits:
    wall_s: float
    memory_bytes: int       # address space per process
    processes: int          # processes (and threads) at once
    cpu_s: int              # CPU seconds per process


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the wall time
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _pids_root() -> Path | None:
    """Where a pids cgroup can be made here (root only), or None."""
    if os.geteuid() != 0:
        return None
    if (PIDS_V1 / "cgroup.procs").exists() and os.access(PIDS_V1, os.W_OK):
        return PIDS_V1
    controllers = CGROUP_V2 / "cgroup.subtree_control"
    if controllers.exists() and "pids" in controllers.read_text().split() and os.access(CGROUP_V2, os.W_OK):
        return CGROUP_V2
    return None


def available() -> str | None:
    """None if a sandbox can start here; else why not, and what to do."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    if os.geteuid() == 0 and _pids_root() is None:
        return ("running as root, processes can be capped only by a pids cgroup, and none can be made here "
                "(/sys/fs/cgroup/pids, or cgroup v2 with the pids controller)")
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"bwrap cannot start a sandbox here ({probe.stderr.strip() or probe.returncode}): user namespaces?"
    return None


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def command(argv: list[str], *, workdir: Path, writable: Path, readable: list[Path], hidden: list[Path]) -> list[str]:
    """The ``bwrap`` command line around ``argv`` (see the module): ``hidden`` folders emptied, then
    ``readable`` files and the ``writable`` folder put back, ``workdir`` the working folder."""
    home = Path.home().resolve()
    emptied = [Path("/tmp"), Path("/dev/shm"), home]
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for folder in emptied:
        args += ["--tmpfs", str(folder)]
    # the interpreter, its packages and paralab itself, where they sit in an emptied folder (a clone in /tmp)
    needed = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(__file__).resolve().parents[2]}
    for keep in sorted(needed):
        if any(_under(keep, folder) for folder in emptied):
            args += ["--ro-bind", str(keep), str(keep)]
    for folder in hidden:
        args += ["--tmpfs", str(folder.resolve())]
    for path in readable:
        args += ["--ro-bind", str(path.resolve()), str(path.resolve())]
    args += ["--bind", str(writable.resolve()), str(writable.resolve()), "--chdir", str(workdir.resolve()),
             "--unshare-all", "--die-with-parent", "--new-session",
             "--hostname", "localhost", "--setenv", "HOME", str(writable.resolve()), "--setenv", "TMPDIR", "/tmp", "--"]
    return args + argv


def run(argv: list[str], limits: Limits, *, sandboxed: bool, env: dict, **where) -> Outcome:
    """Run ``argv`` (in the sandbox of :func:`command` unless ``sandboxed`` is False) under ``limits``."""
    cmd = command(argv, **where) if sandboxed else argv
    group = None
    root = _pids_root() if sandboxed else None
    if root is not None:
        group = root / f"paralab-grade-{os.getpid()}-{next(_serial)}"
        group.mkdir()
        (group / "pids.max").write_text(str(limits.processes))
    # the limits set by util-linux's prlimit and the cgroup joined by a shell, each then exec'ing the next: no
    # Python runs between fork and exec (a preexec_fn is unsafe in a process with threads, as --jobs makes it)
    rlimits = ["prlimit", f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_s}"]
    if sandboxed and root is None:  # RLIMIT_NPROC counts every process of the user: the cap comes on top
        rlimits.append(f"--nproc={_user_processes() + limits.processes}")
    cmd = rlimits + ["--"] + cmd
    if group is not None:
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs")] + cmd
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=where["workdir"], start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limits.wall_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        _kill(proc, group)
        stdout, stderr = proc.communicate()
    finally:
        _kill(proc, group)
        if group is not None:
            _remove(group)
    return Outcome(code, stdout, stderr, time.monotonic() - t0)


def _kill(proc: subprocess.Popen, group: Path | None) -> None:
    """The run's process group, and every process left in its cgroup (one that left the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if group is not None:
        for _ in range(50):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()] if group.exists() else []
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
    proc.wait()


def _remove(group: Path) -> None:
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def _user_processes() -> int:
    """Processes of this user now: RLIMIT_NPROC counts them all, so the cap is on top of these."""
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count
