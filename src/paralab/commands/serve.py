"""Keep torch imported in a background server, so that later paralab commands start warm.

  paralab serve              # start it (about as long as one `import torch`); idles out after 30 min
  paralab serve --status     # is one running, since when, what it serves, and where its log is
  paralab serve --stop       # end it, and every command it is running (it says which)

While it runs, every `paralab` command of this user (same Python, same paralab checkout, the same
environment variables that torch reads while it loads) is forked from it instead of importing torch
itself: a command then pays for paralab's own imports and its run, not torch's (figures:
docs/benchmarks.md). Output, Ctrl-C and the exit code are the command's own, as without a server, and a
command lives as long as its client: the client killed (kill -9 included), the command and its ranks end
within a few seconds. One server per user (a lock); --status and --stop ask it through its socket.
The server imports torch only, never paralab, so a change to paralab's code is seen by the next
command; a change to torch stops it. PARALAB_SERVE=off, or --start spawn, keeps a command away from it.
How it works: src/paralab/run/serve.py.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import UsageError
from ..options import finite_float

HELP = "keep torch imported in a background server so that later commands start warm"


def add_arguments(p) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="say whether a server runs, and its log")
    what.add_argument("--stop", action="store_true", help="end the running server and the commands it serves")
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


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (the server, which is not this process's child: once it has exited,
    init reaps it when it gets to it, a second or more on some systems; until then it is a zombie, which
    has gone already)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state after the command's name (which may hold spaces and parentheses)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def commands(running: dict) -> str:
    return "; ".join(f"pid {pid}: paralab {' '.join(argv)}" for pid, argv in running.items())


def run(args) -> int:
    from ..run import serve
    if args.idle <= 0:
        raise UsageError(f"--idle must be a positive number of minutes (got {args.idle:g})")
    where = serve.folder(create=not (args.status or args.stop))
    if where is None and not (args.status or args.stop):
        raise UsageError(f"{serve.folder_path()} is not a folder of this user's alone (owned by uid {os.getuid()}, "
                         "mode 0700): remove it, or set XDG_RUNTIME_DIR to a private folder")
    path = where / "serve.sock" if where else None
    if args.status:  # asked through the socket: the server says who it is and what it runs
        answer = serve.control("status")
        if answer is None:
            print("paralab serve: not running")
            return 1
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(answer["since"]))
        running = answer.get("running") or {}
        print(f"paralab serve: running (pid {answer['pid']}, since {since}); log {where / 'serve.log'}"
              + (f"; serving {len(running)} command(s): {commands(running)}" if running else ""))
        return 0
    if args.stop:  # asked through the socket, never by signalling a pid it cannot prove is the server
        answer = serve.control("stop")
        if answer is None:
            print("paralab serve: not running")
            return 0
        deadline = time.monotonic() + 30  # the server ends its commands (SIGTERM, then SIGKILL) before it goes
        while alive(answer["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        ending = answer.get("ending") or {}
        if alive(answer["pid"]):
            print(f"paralab serve: asked to stop, but pid {answer['pid']} still runs after 30 s; see "
                  f"{where / 'serve.log'}", file=sys.stderr)
            return 1
        print(f"paralab serve: stopped (pid {answer['pid']})"
              + (f"; ended the {len(ending)} command(s) it served: {commands(ending)}" if ending else ""))
        return 0
    if answering(path):
        answer = serve.control("status")
        print(f"paralab serve: already running (pid {answer['pid'] if answer else '?'}); `paralab serve --stop` ends it")
        return 0
    t0 = time.monotonic()
    with open(where / "serve.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "paralab.front", str(args.idle * 60)],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                   env={**os.environ, "PARALAB_SERVE": "off"})
    print("paralab serve: starting (the server imports torch) ...", file=sys.stderr, flush=True)
    while not answering(path):
        if process.poll() is not None:
            if answering(path) or process.returncode == 0:  # another start won the lock: that one serves
                answer = serve.control("status")
                print(f"paralab serve: already running (pid {answer['pid'] if answer else '?'}); "
                      "`paralab serve --stop` ends it")
                return 0
            print(f"paralab serve: the server exited ({process.returncode}) before it listened; "
                  f"see {where / 'serve.log'}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"paralab serve: ready in {time.monotonic() - t0:.1f} s (pid {process.pid}); later paralab commands "
          f"start from it until {args.idle:g} min without one, or `paralab serve --stop`")
    return 0
