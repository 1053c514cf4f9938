"""Exceptions that carry a message for the user.

``UsageError`` means the input was wrong: the CLI prints the message and
exits with code 2 before any worker starts or any run directory exists.
"""


import signal

#: the exit code of a command whose reader closed the pipe (`paralab plan ... | head`), as a shell reports one
#: ended by SIGPIPE
BROKEN_PIPE = 128 + signal.SIGPIPE


class UsageError(Exception):
    """Bad input; the message says what to change."""


def exit_code(exc: SystemExit) -> int:
    """The process exit code ``raise SystemExit(x)`` asks for: ``x`` if an integer, 0 for None, else 1 (a
    message), as the interpreter's own exit gives it."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
