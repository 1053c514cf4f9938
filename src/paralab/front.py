"""The `paralab` command's entry: the warm server's when one runs (``run/serve.py``), else the command line's.

Nothing here imports torch: a command the server takes is forked from a process that already has.
"""
from __future__ import annotations

import sys


def main() -> int:
    from .run.serve import delegate
    code = delegate(sys.argv[1:])
    if code is None:  # no server, or one that cannot run this command as a cold process would
        from .cli import main as command_line
        code = command_line()
    return code
