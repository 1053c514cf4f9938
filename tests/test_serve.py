"""`paralab serve`: commands forked from a warm server behave as cold ones (output, exit code, losses,
Ctrl-C), the server refuses what it would run differently, and it stops in order."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import FAST


def served_env(folder: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PARALAB_SERVE"}  # conftest turns the server off
    return {**env, "XDG_RUNTIME_DIR": str(folder), "PYTHONUNBUFFERED": "1", **extra}


def paralab(folder: Path, *args: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paralab", *args], capture_output=True, text=True, timeout=180,
                          env=served_env(folder, **extra))


def log_lines(folder: Path) -> list[str]:
    path = folder / f"paralab-serve-{os.getuid()}" / "serve.log"
    return path.read_text().splitlines() if path.exists() else []


def losses(run: Path) -> list:
    rows = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    return sorted((r["step"], r["rank"], r["loss"]) for r in rows)


def test_a_served_command_is_a_cold_one_and_the_server_refuses_what_it_would_change(tmp_path):
    folder = tmp_path / "xdg"
    folder.mkdir(mode=0o700)
    r = paralab(folder, "serve", "--idle", "5")
    assert r.returncode == 0 and "paralab serve: ready" in r.stdout, r.stderr
    try:
        assert paralab(folder, "serve", "--status").returncode == 0
        assert "already running" in paralab(folder, "serve").stdout

        # a run through the server: its output, records and losses are a cold run's
        args = ["train", "ddp", "--workers", "2", "--num-batches", "3", *FAST]
        served = paralab(folder, *args, "--out", str(tmp_path / "served"))
        assert served.returncode == 0, served.stderr[-2000:]
        assert "records written to" in served.stdout
        assert any("`paralab train ddp" in line and line.endswith("exited 0") for line in log_lines(folder))
        cold = paralab(folder, *args, "--out", str(tmp_path / "cold"), PARALAB_SERVE="off")
        assert cold.returncode == 0 and len(log_lines(folder)) == 1
        assert losses(tmp_path / "served") == losses(tmp_path / "cold")

        # bad input: the cold command's exit code and message
        bad = paralab(folder, "train", "ddp", "--workers", "0", "--out", str(tmp_path / "bad"))
        assert bad.returncode == 2 and "paralab: error:" in bad.stderr and not (tmp_path / "bad").exists()
        assert log_lines(folder)[-1].endswith("exited 2")

        # a reader that stops early (`| head`): the served command ends as the cold one, 141 and no traceback
        head = subprocess.Popen([sys.executable, "-m", "paralab", "plan", "--workers", "8", "--global-batch", "8",
                                 "--cluster", "h100-sxm", "--top", "200", "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=served_env(folder))
        head.stdout.readline()
        head.stdout.close()
        err = head.stderr.read().decode()
        assert head.wait(timeout=120) == 141 and "Traceback" not in err, err
        assert log_lines(folder)[-1].endswith("exited 141"), log_lines(folder)[-1]

        # an environment variable torch reads while it loads, set otherwise: refused, so it runs cold
        other = paralab(folder, *args, "--out", str(tmp_path / "other"), OMP_NUM_THREADS="1")
        assert other.returncode == 0 and "refused `paralab train ddp" in log_lines(folder)[-1]

        # Ctrl-C at the client reaches the command and its ranks; the client exits with its code
        proc = subprocess.Popen([sys.executable, "-m", "paralab", "train", "ddp", "--workers", "2",
                                 "--num-batches", "100000", *FAST, "--out", str(tmp_path / "long")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=served_env(folder))
        deadline = time.monotonic() + 60
        while not (tmp_path / "long" / "oplog").exists() and time.monotonic() < deadline:  # the ranks run
            time.sleep(0.1)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode not in (0, None), err[-2000:]
        last = log_lines(folder)[-1]
        assert "--num-batches 100000" in last and last.endswith(f"exited {proc.returncode}"), last
        assert paralab(folder, "serve", "--status").returncode == 0
    finally:
        stop = paralab(folder, "serve", "--stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert paralab(folder, "serve", "--status").returncode == 1


def test_a_server_whose_code_changed_refuses_and_leaves(tmp_path):
    """The server's own module newer than the server (an edit, a pull): the command runs cold, the server
    exits and takes its socket with it."""
    from paralab.run import serve
    folder = tmp_path / "xdg"
    folder.mkdir(mode=0o700)
    assert paralab(folder, "serve", "--idle", "5").returncode == 0
    try:
        os.utime(serve.__file__)  # as an edit would (the content stays)
        r = paralab(folder, "calc", "--help")
        assert r.returncode == 0 and "usage: paralab calc" in r.stdout
        deadline = time.monotonic() + 30
        while paralab(folder, "serve", "--status").returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert paralab(folder, "serve", "--status").returncode == 1
    finally:
        paralab(folder, "serve", "--stop")
    assert not (folder / f"paralab-serve-{os.getuid()}" / "serve.sock").exists()


def test_a_folder_open_to_others_is_refused(tmp_path):
    """The socket's folder must be this user's alone: one open to others gets exit 2 and what to do."""
    folder = tmp_path / "xdg"
    (folder / f"paralab-serve-{os.getuid()}").mkdir(parents=True, mode=0o755)
    os.chmod(folder / f"paralab-serve-{os.getuid()}", 0o755)
    r = paralab(folder, "serve")
    assert r.returncode == 2 and "is not a folder of this user's alone" in r.stderr, r.stderr
    assert not (folder / f"paralab-serve-{os.getuid()}" / "serve.sock").exists()


def test_asking_or_stopping_a_server_imports_no_torch(tmp_path):
    """`paralab serve --status`, `--stop` and bad arguments are answered by a process that never imports torch
    (front.py parses `serve` from its own declaration), with the command line's exit codes and messages."""
    folder = tmp_path / "xdg"
    folder.mkdir(mode=0o700)
    for args, code, said in ((["--status"], 1, "not running"), (["--stop"], 0, "not running"),
                             (["--idle", "nan"], 2, "'nan' is not a finite number"),
                             (["--status", "--stop"], 2, "not allowed with argument"), (["--help"], 0, "--idle MINUTES")):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "paralab", "serve", *args], capture_output=True,
                           text=True, timeout=60, env=served_env(folder))
        imported = [line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
        assert r.returncode == code and said in r.stdout + r.stderr, (args, r.stdout, r.stderr[-2000:])
        assert not [m for m in imported if m == "torch" or m.startswith("torch.")], (args, "imported torch")


def _session_alive(pid: int) -> list[int]:
    from conftest import session_processes
    return session_processes(pid)


def test_a_served_run_lives_as_long_as_its_client_and_stop_ends_what_it_serves(tmp_path):
    """kill -9 of the client: the command and its ranks end within seconds; `--status` lists what is served;
    `--stop` ends the server and every command it serves, saying which; one server per user."""
    folder = tmp_path / "xdg"
    folder.mkdir(mode=0o700)
    starts = [subprocess.Popen([sys.executable, "-m", "paralab", "serve", "--idle", "5"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=served_env(folder)) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in starts]
    assert sum("ready in" in o for o in outs) == 1 and sum("already running" in o for o in outs) == 1, outs
    long = ["train", "ddp", "--workers", "2", "--num-batches", "100000", *FAST]
    try:
        client = subprocess.Popen([sys.executable, "-m", "paralab", *long, "--out", str(tmp_path / "a")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=served_env(folder))
        deadline = time.monotonic() + 60
        while not (tmp_path / "a" / "oplog").exists() and time.monotonic() < deadline:  # its ranks run
            time.sleep(0.1)
        status = paralab(folder, "serve", "--status")
        assert "serving 1 command(s)" in status.stdout and str(tmp_path / "a") in status.stdout
        served = int(status.stdout.split("serving 1 command(s): pid ")[1].split(":")[0])
        assert _session_alive(served)  # the command, its launcher's ranks
        client.kill()  # kill -9: no word to the server
        client.wait()
        deadline = time.monotonic() + 20
        while _session_alive(served) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session_alive(served)
        assert any("its client went away: ending" in line for line in log_lines(folder))

        second = subprocess.Popen([sys.executable, "-m", "paralab", *long, "--out", str(tmp_path / "b")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=served_env(folder))
        deadline = time.monotonic() + 60
        while not (tmp_path / "b" / "oplog").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop = paralab(folder, "serve", "--stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert "ended the 1 command(s) it served" in stop.stdout and str(tmp_path / "b") in stop.stdout
    assert second.wait(timeout=30) not in (0, None)  # its client learnt the command was ended
    assert paralab(folder, "serve", "--status").returncode == 1


def test_slow_silent_and_malformed_connections_hold_up_nothing_and_stop_returns_when_the_server_is_gone(tmp_path):
    """A connection that says nothing, one that sends its request a byte at a time and one that sends a byte
    more than its request: another client's command is served at once meanwhile; the malformed one is
    dropped and starts nothing; `--stop` returns once the server's process is gone."""
    import socket as sockets
    import threading
    folder = tmp_path / "xdg"
    folder.mkdir(mode=0o700)
    assert paralab(folder, "serve", "--idle", "5").returncode == 0
    where = str(folder / f"paralab-serve-{os.getuid()}" / "serve.sock")
    pid = int(paralab(folder, "serve", "--status").stdout.split("(pid ")[1].split(",")[0])
    silent, slow, malformed = (sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) for _ in range(3))
    trickled = threading.Event()

    def trickle():  # a valid-looking request, a byte every 20 ms (about 2 s for its first 100 bytes)
        try:
            for byte in json.dumps({"argv": ["calc", "--help"], "cwd": "/", "env": {}}).encode():
                slow.send(bytes([byte]))
                time.sleep(0.02)
        except OSError:  # dropped by the server after REQUEST_SECONDS: what it should do
            pass
        trickled.set()
    try:
        silent.connect(where)  # and says nothing
        slow.connect(where)
        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        malformed.connect(where)
        malformed.sendall(json.dumps({"argv": ["calc", "--help"], "cwd": "/", "env": {}}).encode() + b"\nX")
        malformed.settimeout(10)
        assert malformed.recv(1) == b""  # dropped at once: no reply, closed
        r = paralab(folder, "calc", "--help")
        assert r.returncode == 0 and "usage: paralab calc" in r.stdout
        assert not trickled.is_set()  # served while the slow one was still sending
        assert log_lines(folder)[-1].endswith("exited 0")  # served, not run cold after a timeout
        assert sum("exited" in line for line in log_lines(folder)) == 1  # the malformed one started nothing
        silent.setblocking(False)
        try:
            assert silent.recv(1) != b""  # not closed yet: the command did not wait for it to be dropped
        except BlockingIOError:
            pass
    finally:
        for conn in (silent, slow, malformed):
            conn.close()
        stop = paralab(folder, "serve", "--stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
