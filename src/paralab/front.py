"""The `paralab` command's entry: the warm server's when one runs (``run/serve.py``), else the command line's.

Nothing here imports torch: a command the server takes is forked from a process that already has.
``python -m paralab.front IDLE_SECONDS`` is the server itself (what `paralab serve` starts).
"""
from __future__ import annotations

import sys


def command_line() -> int:
    """The command line, imported now (in a server's child: from disk as it is then, never in the server)."""
    from .cli import main
    return main()


def main() -> int:
    from .run.serve import delegate
    code = delegate(sys.argv[1:])
    if code is None:  # no server, or one that cannot run this command as a cold process would
        code = command_line()
    return code


if __name__ == "__main__":
    from .run.serve import serve
    serve(float(sys.argv[1]), command_line)
