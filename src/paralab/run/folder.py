"""One run per folder: the lock a run holds on its ``--out``, and what may be done with a folder that holds one.

A run's records, checkpoints and op logs all live in its folder, so two runs
writing one folder would leave a mixture of both that neither could read (one
run's records gone, a checkpoint of one strategy's rank 0 and another's rank
1). So:

- a run holds an exclusive lock (``flock``) on its folder while it runs,
  taken by the process that launches it (for ranks started one per process,
  rank 0's); a second run into a folder in use is refused before it starts,
  naming the process that holds it (read from ``/proc/locks``). The lock
  goes when that process ends, however it ends: there is no stale lock file;
- a folder that holds a finished run is reused only by ``--resume`` (which
  continues it) or ``--overwrite`` (which clears it first);
- ``--out`` naming a file is refused before start (``RunConfig.validate``);
- ``compare`` and ``sweep`` hold their report folder the same way (:func:`claim_new`) and write into it
  as they go, so a report killed half-way leaves its finished runs in plain sight, and a second
  command into a folder in use is refused;
- a ``--resume`` source that a live run holds is refused (:func:`refuse_if_held`): its newest
  checkpoint may be one being written.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from ..errors import UsageError, write_refused


class Claim:
    """A run's hold on its folder (released when this process ends, or by :meth:`release`)."""

    def __init__(self, folder: Path, fd: int, created: bool):
        self.folder, self.fd, self.created = folder, fd, created

    def release(self) -> None:
        """Let the folder go; one this claim created and nothing was written to is removed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.created:
            try:
                self.folder.rmdir()
            except OSError:  # the run wrote something: it stays
                pass


def claim(folder: Path) -> Claim:
    """Hold ``folder`` (made if missing) for this run; UsageError if another run holds it."""
    folder = Path(folder)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as exc:  # under /proc (2), /sys or no permission (4)
        raise write_refused(f"--out {folder}", exc) from None
    if not writable:
        os.close(fd)
        raise write_refused(f"--out {folder}", PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"--out {folder} is in use by a run that is still going ({holder(folder)}); wait for it "
                         "to end, or pass another --out") from None
    return Claim(folder, fd, created)


def refuse_taken(folder: Path) -> None:
    """UsageError where a command's report folder ``--out`` is in use, or exists at all (a report is never
    written into another's folder)."""
    if Path(folder).exists():
        refuse_if_held(Path(folder), "--out")
        raise UsageError(f"{folder} already exists; pass another --out (or remove it)")


def claim_new(folder: Path) -> Claim:
    """Hold ``folder`` for a command's report, made here (:func:`refuse_taken` first)."""
    refuse_taken(folder)
    return claim(Path(folder))


def held(folder: Path) -> bool:
    """Whether a live process holds ``folder`` (a run still going). Asked with a lock of its own, let go at
    once: this process's own hold would count too, so ask only of a folder this process does not hold."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def refuse_if_held(folder: Path, flag: str) -> None:
    """UsageError where a live process holds ``folder`` (``flag``: the option that named it)."""
    if held(folder):
        raise UsageError(f"{flag} {folder} is in use by a run that is still going ({holder(folder)}); wait for "
                         "it to end")


def holder(folder: Path) -> str:
    """Who holds ``folder``'s lock, in words: its pid and command line, as ``/proc/locks`` and
    ``/proc/PID/cmdline`` say (Linux); "another process" where they cannot be read."""
    try:
        inode = os.stat(folder).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                pid = int(fields[4])
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                return f"pid {pid}: {command}" if command else f"pid {pid}"
    except (OSError, ValueError):
        pass
    return "another process"


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds a finished run (its records were written)."""
    return (Path(folder) / "summary.json").exists()


def clear(folder: Path) -> None:
    """``--overwrite``: everything in ``folder`` removed (the folder itself, and its lock, stay)."""
    for entry in Path(folder).iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
