"""Exceptions that carry a message for the user.

``UsageError`` means the input was wrong: the CLI prints the message and
exits with code 2 before any worker starts or any run directory exists.
"""


import errno
import signal

#: the exit code of a command whose reader closed the pipe (`paralab plan ... | head`), as a shell reports one
#: ended by SIGPIPE
BROKEN_PIPE = 128 + signal.SIGPIPE


class UsageError(Exception):
    """Bad input; the message says what to change."""


#: the exit code of a command that could not write what it makes: no space left, or no permission (the same
#: as a checkpoint that could not be saved, docs/train.md)
CANNOT_WRITE = 4


class CannotWrite(UsageError):
    """The system refused a write (no space, no permission, a read-only file system): exit 4."""


def write_refused(what: str, exc: OSError) -> UsageError:
    """The error for an OSError met writing ``what`` (e.g. ``"-o x.pt"``): :class:`CannotWrite` where the disk
    is full or the write not permitted, else a :class:`UsageError` (a path that cannot be, e.g. under /proc)."""
    message = f"{what}: cannot write it ({exc.strerror or exc})"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
        return CannotWrite(message)
    return UsageError(message + "; name a place you can write")


def exit_code(exc: SystemExit) -> int:
    """The process exit code ``raise SystemExit(x)`` asks for: ``x`` if an integer, 0 for None, else 1 (a
    message), as the interpreter's own exit gives it."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
