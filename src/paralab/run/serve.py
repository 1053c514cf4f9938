"""A warm server: `paralab serve` keeps torch imported so that later commands start warm.

A command's first seconds go to importing torch and ``torch._dynamo`` (which every ``torch.optim``
optimizer imports; ``warm.py``). Within one command, ranks already fork from a process that has
imported them; across commands nothing was kept. ``paralab serve`` starts a server in the background
(``python -m paralab.front IDLE``) that imports them once (:data:`PRELOAD`: torch only, never
paralab, so edits to paralab's code are seen by the next command) and then waits on a Unix socket.

The command line's entry (:func:`delegate`, called by ``paralab.front`` before anything heavy is
imported) looks for the socket. If a server answers, it sends the command (arguments, working
directory, environment) with its own standard input, output and error (the file descriptors
themselves, ``SCM_RIGHTS``), and the server forks a child that becomes the command: a new session
(so signals reach it and every rank it starts), the client's descriptors as its own, the client's
directory and environment, then ``paralab.cli.main``. The client forwards Ctrl-C (SIGINT), SIGTERM
and SIGHUP to the child's process group and exits with the child's exit code, which the server
sends when it reaps the child (a signal's death as 128 + its number, the shell's convention).

The server refuses a command (and the client runs it itself, as without a server) when the command
would differ from a cold one: another Python or paralab checkout, environment variables that torch
reads while it loads set differently (:data:`LOAD_TIME`), or torch or this module changed on disk
since the server started (then the server also exits). It accepts only its own user (the socket's
folder is private, and the peer's uid is checked), reads only JSON, and exits after ``--idle``
minutes without a command. ``PARALAB_SERVE=off`` (the tests set it) or ``--start spawn`` keeps a
command away from it. Why a server and not more preloading: docs/architecture.md, "Starting processes".
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from ..errors import BROKEN_PIPE, exit_code

#: what the server imports before it listens (torch only: paralab's own modules load fresh per command)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
#: prefixes of the environment variables read while torch and its libraries load
LOAD_TIME = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "LD_",
             "PYTHON", "GLOO_")


def folder_path() -> Path:
    """Where the server's private folder (socket, pid, log) is: $XDG_RUNTIME_DIR, else /tmp."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"paralab-serve-{os.getuid()}"


def folder(create: bool = False) -> Path | None:
    """The server's private folder, or None where it is missing (``create``: make it) or not this user's
    alone (owned by another, or open to others): then no server is used."""
    path = folder_path()
    if create:
        path.mkdir(mode=0o700, exist_ok=True)
    try:
        st = path.lstat()
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077 else None


def socket_path() -> Path | None:
    where = folder()
    return where / "serve.sock" if where else None


def load_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME)}


def identity() -> dict:
    """What makes a command run here run the same as in a cold process (see the module's docstring)."""
    import paralab
    return {"python": os.path.realpath(sys.executable), "prefix": sys.prefix,  # the interpreter, its venv
            "paralab": os.path.dirname(os.path.realpath(paralab.__file__)), "env": load_env(os.environ)}


# ---------------------------------------------------------------------------- the client (stdlib only)
def delegate(argv: list[str]) -> int | None:
    """Run ``argv`` in the warm server if one answers and takes it: the command's exit code; else None
    (no server, or it refused: the caller runs the command itself)."""
    spawn = "--start=spawn" in argv or any(a == "--start" and b == "spawn" for a, b in zip(argv, argv[1:]))
    if os.environ.get("PARALAB_SERVE", "").lower() in ("off", "0", "no") or not argv or argv[0] == "serve" \
            or spawn:  # asked for fresh interpreters: cold, as asked
        return None
    path = socket_path()
    if path is None or not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "identity": identity()}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = conn.makefile("r")
        reply = json.loads(reader.readline() or "{}")
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:  # refused (another identity, a stale server): run cold
        conn.close()
        return None
    child = reply["pid"]

    def forward(signum, _frame):
        try:
            os.killpg(child, signum)
        except ProcessLookupError:
            pass
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    try:
        line = reader.readline()
        return int(json.loads(line)["exit"]) if line else _lost()
    except (OSError, ValueError, KeyError):
        return _lost()


def control(what: str, timeout: float = 30.0) -> dict | None:
    """Ask the running server (``"status"``, ``"stop"``) through its socket: its answer, or None where no
    server of this user's answers. No pid is signalled: only the process that listens on the socket in this
    user's private folder is asked, and it answers for itself."""
    path = socket_path()
    if path is None or not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        conn.sendall(json.dumps({"control": what}).encode() + b"\n")
        line = conn.makefile("r").readline()
        return json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


def _lost() -> int:
    print("paralab: the warm server went away before the command ended (paralab serve --stop; run it again)",
          file=sys.stderr, flush=True)
    return 1


# ---------------------------------------------------------------------------- the server
def _fingerprint() -> dict:
    """Files whose change makes this server stale: torch's version file, this module and the entry."""
    import torch
    files = [Path(torch.__file__).with_name("version.py"), Path(__file__), Path(__file__).parents[1] / "front.py"]
    return {str(f): f.stat().st_mtime_ns for f in files if f.exists()}


#: seconds a connection may take to send its request before it is dropped (it never holds up the others)
REQUEST_SECONDS = 10.0
#: seconds between asking a command whose client went away to end (SIGTERM) and making it (SIGKILL)
GRACE_SECONDS = 2.0


#: the most bytes a request may take (the command line, directory and environment: a few KiB); more is dropped
REQUEST_BYTES = 1 << 20


class Pending:
    """A connection whose request has not all come yet: the bytes and descriptors so far, and since when. It
    is read only when readable and never waited on, so a client that sends a byte at a time holds up
    nothing; it has :data:`REQUEST_SECONDS` to finish, or it is dropped."""

    def __init__(self, since: float):
        self.since, self.data, self.fds = since, b"", []

    def drop(self, conn: socket.socket) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        conn.close()


class Served:
    """A running command: its client's connection (the command lives as long as it), its command line."""

    def __init__(self, conn: socket.socket, argv: list[str]):
        self.conn, self.argv = conn, argv
        self.ending: float | None = None  # when it was asked to end (its client gone, or the server stopping)

    def end(self, pid: int, now: float) -> None:
        """Ask the command and every process of its session to end; :func:`_escalate` makes them."""
        if self.ending is None:
            self.ending = now
            _signal_group(pid, signal.SIGTERM)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the command made itself a session (and group) leader: pid is its group
    except (ProcessLookupError, PermissionError):
        pass


def serve(idle_seconds: float, command) -> None:
    """The server's loop (the process ``paralab serve`` starts in the background); ``command()`` is what
    each forked child runs once it has become the client's command (the command line's ``main``).

    One server per user: it holds ``serve.lock`` (flock) while it lives; a second one exits at once. Every
    connection is read when it is ready and never waited on: a request not whole within
    :data:`REQUEST_SECONDS` (silent, or sent a byte at a time) is dropped and holds up no other, and a
    malformed or over-long one is dropped at once and starts nothing (:func:`_read`); a command's client
    connection is watched while it runs: when the client goes (killed, ``kill -9`` included) or sends
    anything more, the command and every process it started are ended within :data:`GRACE_SECONDS` or so. ``paralab serve --stop`` and ``--status`` talk to it through the socket."""
    import fcntl
    import importlib
    where = folder(create=True)
    lock = os.open(where / "serve.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("another server of this user's runs: leaving", flush=True)
        return
    me, before = identity(), dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # what importing set in the environment (torch._dynamo: TORCHINDUCTOR_CACHE_DIR), as a cold command's
    # imports would set it in its own
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    fingerprint = _fingerprint()
    path = where / "serve.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    listener.listen(16)
    os.replace(tmp, path)  # clients see the socket only once it listens
    inode = path.stat().st_ino
    started = time.time()
    leaving = None  # "stop" (--stop: the commands served end too) or "stale" (they go on to their ends)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, Served] = {}            # running commands, by pid
    pending: dict[socket.socket, Pending] = {}  # connections whose request has not all come yet
    last = time.monotonic()
    try:
        while leaving is None and (children or pending or time.monotonic() - last < idle_seconds):
            watched = [listener, *pending, *(c.conn for c in children.values() if c.ending is None)]
            ready, _, _ = select.select(watched, [], [], 0.2)
            now = time.monotonic()
            _reap(children)
            for conn in ready:
                if conn is listener:
                    accepted, _ = listener.accept()
                    if _peer_uid(accepted) != os.getuid():  # only this user's commands
                        accepted.close()
                        continue
                    accepted.setblocking(False)
                    pending[accepted] = Pending(now)
                    last = now
                elif conn in pending:
                    request = _read(conn, pending[conn])
                    if request is None:  # not whole yet
                        continue
                    del pending[conn]
                    if request is False:  # malformed, over-long, or closed early: dropped, nothing started
                        continue
                    conn.setblocking(True)
                    if request.get("control") == "status":
                        _reply(conn, {"pid": os.getpid(), "since": started,
                                      "running": {str(pid): c.argv for pid, c in children.items()}}, close=True)
                    elif request.get("control") == "stop":
                        _reply(conn, {"pid": os.getpid(), "ending": {str(pid): c.argv for pid, c in children.items()}},
                               close=True)
                        leaving = "stop"
                    elif _fingerprint() != fingerprint:  # torch or this module changed: refuse, and stop serving
                        _reply(conn, {"refused": "stale"})  # (the commands it serves go on, to their ends)
                        leaving = "stale"
                    else:
                        taken = _take(conn, request, me, added, command,
                                      [listener, conn, *pending, *(c.conn for c in children.values())])
                        if taken:
                            children[taken[0]] = Served(conn, taken[1])
                else:  # a running command's client: readable means it went away, or broke the protocol (a
                    pid = next(p for p, c in children.items() if c.conn is conn)  # client sends nothing more)
                    why = _gone(conn)
                    print(f"pid {pid}: {why}: ending `paralab {' '.join(children[pid].argv)}`", flush=True)
                    children[pid].end(pid, now)
            for conn, p in list(pending.items()):  # not whole in time: dropped, the others not held up
                if now - p.since > REQUEST_SECONDS:
                    del pending[conn]
                    p.drop(conn)
            _escalate(children, now)
    finally:
        try:
            if path.stat().st_ino == inode:  # still ours (a newer server may have replaced it)
                path.unlink()
        except OSError:
            pass
        listener.close()
        for conn, p in pending.items():
            p.drop(conn)
        now = time.monotonic()
        for pid, child in children.items() if leaving == "stop" else ():  # --stop: every command served ends with it
            print(f"pid {pid}: the server stops: ending `paralab {' '.join(child.argv)}`", flush=True)
            child.end(pid, now)
        while children:  # (stale: they end by themselves; their clients still learn the exit code)
            _reap(children)
            _escalate(children, time.monotonic())
            time.sleep(0.05)
        os.close(lock)


def _gone(conn: socket.socket) -> str:
    """Why a running command's client connection became readable: the client went away (its end closed), or
    it sent something after its request (no client of paralab's does: the command is ended all the same, so
    that a connection that keeps sending cannot keep the server busy). Reads what is there."""
    try:
        return "its client went away" if conn.recv(4096, socket.MSG_DONTWAIT) == b"" else \
            "its client sent more than its request"
    except BlockingIOError:
        return "its client sent more than its request"
    except OSError:
        return "its client went away"


def _escalate(children: dict, now: float) -> None:
    """A command asked to end that has not within :data:`GRACE_SECONDS` is made to (SIGKILL, its session)."""
    for pid, child in children.items():
        if child.ending is not None and now - child.ending > GRACE_SECONDS:
            _signal_group(pid, signal.SIGKILL)


def _reply(conn: socket.socket, message: dict, close: bool = False) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass
    if close or "pid" not in message:
        conn.close()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _read(conn: socket.socket, pending: Pending):
    """What a readable pending connection has sent so far: its request (JSON, one line, with the descriptors
    it carried under ``"fds"``) once whole; None while it is not (nothing waits for the rest); False, the
    connection dropped, where it is not JSON, not one line (bytes after its newline), over
    :data:`REQUEST_BYTES`, carries more than three descriptors, or closed before its end."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, REQUEST_BYTES, 3, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        data, fds = b"", []
    pending.fds += fds
    pending.data += data
    end = pending.data.find(b"\n")
    if data and end < 0 and len(pending.data) <= REQUEST_BYTES and len(pending.fds) <= 3:
        return None
    try:
        if end < 0 or end != len(pending.data) - 1 or len(pending.data) > REQUEST_BYTES or len(pending.fds) > 3:
            raise ValueError("not one whole request")
        request = json.loads(pending.data)
        if not isinstance(request, dict):
            raise ValueError("not a request")
    except ValueError:
        pending.drop(conn)
        return False
    request["fds"], pending.fds = pending.fds, []
    return request


def _take(conn: socket.socket, request: dict, me: dict, added: dict, command, sockets: list
          ) -> tuple[int, list[str]] | None:
    """Fork a command's child; (the child's pid, the command) or None (refused: said, closed).
    ``sockets``: the server's, which the child closes (a command must not hold the server's connections)."""
    fds = request.pop("fds")
    if request.get("identity") != me or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        differs = sorted(k for k in me if (request.get("identity") or {}).get(k) != me[k])
        print(f"refused `paralab {' '.join(request.get('argv', []))}`: {', '.join(differs) or 'descriptors'} "
              "not the server's; it runs cold", flush=True)
        _reply(conn, {"refused": "identity"})
        return None
    pid = os.fork()
    if pid == 0:  # the command
        for s in sockets:
            s.close()
        _become(request, fds, added, command)
    for fd in fds:
        os.close(fd)
    _reply(conn, {"pid": pid})
    return pid, request["argv"]


def _become(request: dict, fds: list[int], added: dict, command) -> None:
    """In the forked child: take the client's descriptors, directory and environment; run the command."""
    code = 1
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**added, **request["env"]})
        sys.stdin, sys.stdout, sys.stderr = _stream(0, "r"), _stream(1, "w"), _stream(2, "w")
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        sys.argv = ["paralab", *request["argv"]]
        code = command()
    except SystemExit as exc:
        code = exit_code(exc)
    except BrokenPipeError:  # as a cold command would (front.py): the reader stopped reading
        code = BROKEN_PIPE
    except BaseException:  # noqa: BLE001 - as a cold command would: the traceback, exit 1
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _stream(fd: int, mode: str):
    """A standard stream on ``fd`` as a cold interpreter would open it: line-buffered to a terminal
    (stderr always), unbuffered under PYTHONUNBUFFERED (from the client's environment), else buffered."""
    import io
    unbuffered = mode == "w" and bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = open(fd, mode + "b", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(raw, line_buffering=mode == "w" and (fd == 2 or os.isatty(fd)),
                            write_through=unbuffered, errors="backslashreplace" if fd == 2 else "strict")


def _reap(children: dict) -> None:
    """Tell each client whose command has ended its exit code (where the client is still there)."""
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            code = code if code >= 0 else 128 - code
            child = children.pop(pid)
            print(f"pid {pid}: `paralab {' '.join(child.argv)}` exited {code}", flush=True)  # the server's log
            _reply(child.conn, {"exit": code}, close=True)
