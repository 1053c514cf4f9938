"""`python -m paralab` from a process that has imported torch, but not paralab: for a copy of the package.

tests/test_mutants.py runs about seventy commands, each against its own copy of the package (one line changed),
which the session's warm forkserver cannot run: it has imported paralab from the source tree. A fresh
interpreter per command spent most of each on importing torch and ``torch._dynamo`` (2.7 s of about 3.6 s on
a 2-core VM). A zygote imports those once; each command is a child forked from it that puts its copy of the
package first on ``sys.path``, takes its own arguments, environment, folder and output files, and runs
``paralab``'s entry as ``python -m paralab`` would (the ranks it starts are forked from that child, as a
cold command's are). paralab is never imported in the zygote itself, so every child imports the copy it is
given, from disk.

Protocol (one JSON line each way, one command at a time): the request ``{"path", "argv", "env", "cwd",
"stdout", "stderr"}``; the replies the child's pid, then its exit code.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def serve() -> None:
    import torch  # noqa: F401 - what every paralab command imports first, once for all the children
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    assert "paralab" not in sys.modules
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()  # its own session, as a fresh process's: killed with its ranks on a timeout
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(os.devnull)
        sys.dont_write_bytecode = True  # a copy is compiled afresh by each command, as with PYTHONDONTWRITEBYTECODE
        sys.path.insert(0, request["path"])
        sys.argv = ["paralab", *request["argv"]]
        import runpy
        runpy.run_module("paralab", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's traceback, as a fresh interpreter would print it
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Zygote:
    """The test side: ``run(path, argv, env, cwd, timeout)`` -> ``subprocess.CompletedProcess``."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def _reply(self, deadline: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        return json.loads(self.proc.stdout.readline()) if ready else None

    def run(self, path: Path, argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        out, err = cwd / f".zygote-{os.getpid()}.out", cwd / f".zygote-{os.getpid()}.err"
        request = {"path": str(path), "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out),
                   "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._reply(deadline)["pid"]
        done = self._reply(deadline)
        if done is None:
            os.killpg(pid, signal.SIGKILL)
            self._reply(time.monotonic() + 30)
            raise subprocess.TimeoutExpired(["paralab", *argv], timeout)
        stdout, stderr = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess(["paralab", *argv], done["exit"], stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
