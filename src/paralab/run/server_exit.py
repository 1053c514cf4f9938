"""Imported by the runner's forkserver alone (``warm.forkserver``'s preload): its exit skips the interpreter's
teardown.

The forkserver ends when the process that started it ends (the end of its "alive" pipe). It then exits as
any interpreter does, tearing down torch and ``torch._dynamo`` module by module: seconds on a busy machine
(8.8 s measured while the cores were busy), and the runs it forked die with it (``warm.die_with_parent``) only
then. Its exit code means nothing to anyone, so it leaves at once. The processes it forks inherit this exit
handler, and each of them already ends with ``os._exit`` (a run in ``warm._child``, a rank in
``local._entry``, a figure in multiprocessing's own), so it changes nothing for them. Nothing else imports
this module: a command line's exit code is its own.
"""
from __future__ import annotations

import atexit
import os


def _leave() -> None:
    os._exit(0)


atexit.register(_leave)
