"""Keep torch imported in a background server, so that later paralab commands start warm.

  paralab serve              # start it (about as long as one `import torch`); idles out after 30 min
  paralab serve --status     # is one running, since when, and where its log is
  paralab serve --stop       # end it (commands it is running go on to their end)

While it runs, every `paralab` command of this user (same Python, same paralab checkout, the same
environment variables that torch reads while it loads) is forked from it instead of importing torch
itself: a command then pays for paralab's own imports and its run, not torch's (figures:
docs/benchmarks.md). Output, Ctrl-C and the exit code are the command's own, as without a server.
The server imports torch only, never paralab, so a change to paralab's code is seen by the next
command; a change to torch stops it. PARALAB_SERVE=off, or --start spawn, keeps a command away from it.
How it works: src/paralab/run/serve.py.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ..errors import UsageError
from ..options import finite_float

HELP = "keep torch imported in a background server so that later commands start warm"


def add_arguments(p) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="say whether a server runs, and its log")
    what.add_argument("--stop", action="store_true", help="end the running server")
    p.add_argument("--idle", type=finite_float, default=30.0, metavar="MINUTES",
                   help="end the server after this many minutes without a command (default: 30)")


def answering(path) -> bool:
    if path is None or not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def read_pid(where) -> int | None:
    try:
        return int((where / "serve.pid").read_text())
    except (OSError, ValueError):
        return None


def run(args) -> int:
    from ..run import serve
    if args.idle <= 0:
        raise UsageError(f"--idle must be a positive number of minutes (got {args.idle:g})")
    where = serve.folder(create=not (args.status or args.stop))
    if where is None and not (args.status or args.stop):
        raise UsageError(f"{serve.folder_path()} is not a folder of this user's alone (owned by uid {os.getuid()}, "
                         "mode 0700): remove it, or set XDG_RUNTIME_DIR to a private folder")
    path = where / "serve.sock" if where else None
    pid = read_pid(where) if where else None
    if args.status:
        if answering(path):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
            print(f"paralab serve: running (pid {pid}, since {since}); log {where / 'serve.log'}")
            return 0
        print("paralab serve: not running")
        return 1
    if args.stop:
        if not answering(path) or pid is None:
            print("paralab serve: not running")
            return 0
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"paralab serve: stopped (pid {pid})")
        return 0
    if answering(path):
        print(f"paralab serve: already running (pid {pid}); `paralab serve --stop` ends it")
        return 0
    t0 = time.monotonic()
    with open(where / "serve.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "paralab.front", str(args.idle * 60)],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                   env={**os.environ, "PARALAB_SERVE": "off"})
    (where / "serve.pid").write_text(str(process.pid))
    print("paralab serve: starting (the server imports torch) ...", file=sys.stderr, flush=True)
    while not answering(path):
        if process.poll() is not None:
            print(f"paralab serve: the server exited ({process.returncode}) before it listened; "
                  f"see {where / 'serve.log'}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"paralab serve: ready in {time.monotonic() - t0:.1f} s (pid {process.pid}); later paralab commands "
          f"start from it until {args.idle:g} min without one, or `paralab serve --stop`")
    return 0
