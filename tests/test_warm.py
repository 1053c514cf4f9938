"""Warm starts: ranks forked from a launcher that has imported what they need, or from a preloaded
forkserver, or spawned as before; the same arithmetic whichever way they start, and the failure
paths unchanged."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from paralab.run import warm
from paralab.run.config import RunConfig

CHECKED = ["--num-batches", "3", "--check", "--lr", "1e-3"]


def losses(run_dir) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return sorted((r["rank"], r["step"], r["loss"]) for r in rows)


def started_by(run_dir) -> str:
    return json.loads((run_dir / "config.json").read_text())["started_by"]


@pytest.mark.parametrize("args", [  # ddp in the default selection; the other two in the slow one
    pytest.param(["ddp", "--workers", "2"], id="ddp"),
    pytest.param(["pipeline", "--workers", "2", "--microbatches", "2"], id="pipeline", marks=pytest.mark.slow),
    pytest.param(["fsdp", "--workers", "2", "--zero-stage", "3", "--model", "gpt", "--dataset", "synthetic-text"],
                 id="fsdp3-gpt", marks=pytest.mark.slow),
])
def test_every_start_method_gives_the_same_losses_bit_for_bit(paralab, args):
    """``spawn`` is how ranks started before warm starts: the forked ranks must compute exactly what
    those did (every rank's loss at every step, and the check against one process)."""
    runs = {how: paralab("train", *args, *CHECKED, "--start", how) for how in ("auto", "forkserver", "spawn")}
    for how, r in runs.items():
        assert r.returncode == 0, (how, r.stderr[-3000:])
        assert r.summary["check"]["result"] == "PASS"
    assert [started_by(r.out) for r in runs.values()] == ["fork", "forkserver", "spawn"]
    first = losses(runs["auto"].out)
    assert len(first) == 6 and {step for _, step, loss in first if loss is not None} == {0, 1, 2}
    assert losses(runs["forkserver"].out) == first and losses(runs["spawn"].out) == first


@pytest.mark.parametrize("how", ["forkserver", "spawn"])
def test_a_killed_rank_is_named_and_nothing_left_running_however_ranks_start(paralab, how):
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "4", "--start", how,
                env={"PARALAB_FAULT": "1:1:kill"})
    assert r.returncode == 1
    assert "paralab: rank 1 failed first: killed by signal SIGKILL" in r.stderr, r.stderr[-3000:]
    assert not r.left_running()


def test_the_launcher_forks_only_when_it_is_safe(monkeypatch):
    cpu = RunConfig(device="cpu")
    monkeypatch.setattr(warm, "_threads_when_fresh", warm._os_threads())
    assert warm.may_use_cuda(RunConfig(device="cuda")) and warm.may_use_cuda(RunConfig(backend="nccl"))
    assert not warm.may_use_cuda(cpu)
    assert warm.may_use_cuda(RunConfig(device="auto")) == (torch.version.cuda is not None)
    assert warm.fork_hazard(RunConfig(device="cuda")) == "the run may use CUDA"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert warm.fork_hazard(cpu) == "this process runs other Python threads"
        assert warm.rank_context(RunConfig(device="cpu"))[1] == "forkserver"
    finally:
        stop.set()
        thread.join()
    assert warm.rank_context(RunConfig(device="cpu", start="spawn"))[1] == "spawn"
    assert warm.rank_context(RunConfig(device="cpu", start="forkserver"))[1] == "forkserver"


def test_only_a_process_known_to_have_run_nothing_forks(monkeypatch):
    """This test process has run kernels (an OpenMP pool would be orphaned in a forked rank): it is not
    marked fresh, so its ranks would come from the forkserver; one that started threads since it was
    marked fresh does not fork either."""
    cpu = RunConfig(device="cpu")
    monkeypatch.setattr(warm, "_threads_when_fresh", None)
    assert "not paralab's command line" in warm.fork_hazard(cpu)
    warm.mark_fresh()
    assert warm.fork_hazard(cpu) is None
    monkeypatch.setattr(warm, "_threads_when_fresh", warm._os_threads() - 1)
    assert "started threads" in warm.fork_hazard(cpu)


def test_the_runner_child_has_the_callers_environment_and_folder(tmp_path, monkeypatch):
    """A child of the warm forkserver sees the environment and working folder of the moment it starts,
    not those the forkserver started with."""
    from multiprocessing.connection import wait
    monkeypatch.setenv("PARALAB_TEST_WARM", "now")
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "output"
    proc = warm.start(_print_environment, ("PARALAB_TEST_WARM",), output=str(output),
                      env={"PARALAB_TEST_WARM": "now", "PATH": "/usr/bin"}, cwd=str(tmp_path))
    assert wait([proc.sentinel], timeout=60)
    proc.join()
    assert proc.exitcode == 3
    assert output.read_text().splitlines() == ["now", str(tmp_path), "own session: True"]


def _print_environment(name: str) -> int:
    import os
    print(os.environ.get(name))
    print(os.getcwd())
    print(f"own session: {os.getsid(0) == os.getpid()}")
    return 3


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_ends_the_forked_ranks_too(tmp_path, how):
    """A terminal's Ctrl-C reaches the launcher's whole process group (SIGINT); ``compare`` or ``kill``
    sends the launcher alone SIGTERM. Either way every forked rank ends and the launcher exits non-zero."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from conftest import FAST, session_processes
    cmd = [sys.executable, "-m", "paralab", "train", "ddp", "--workers", "2", *FAST, "--num-batches", "100000",
           "--log-every", "1", "--checkpoint-every", "2", "--out", str(tmp_path / "run")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in p.stdout:  # the ranks are training, past their first checkpoint
            if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 3:
                break
        assert len(session_processes(p.pid)) >= 3  # the launcher and its two forked ranks
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode != 0
        if how == "ctrl-c":  # what was committed, and the command that continues from it
            assert "is complete" in err and f"--resume {tmp_path / 'run'}" in err, err
        deadline = time.monotonic() + 30
        while session_processes(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_processes(p.pid) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


LEAVE = """
import atexit, sys
from paralab.front import main
class Teardown:
    def __del__(self):
        print("torn down", flush=True)
kept = Teardown()  # a module global: freed (and heard) only when the interpreter tears down
atexit.register(lambda: print("exit handler ran"))
sys.argv = ["paralab", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_cold_command_ends_without_the_interpreters_teardown(tmp_path):
    """The command line exits straight after its exit handlers and a flush
    (front.leave): block-buffered output arrives whole, the exit code is the command's, and no module
    object is freed (what cost more than half a second with torch._dynamo loaded)."""
    import os
    import subprocess
    import sys
    from conftest import FAST
    env = {**os.environ, "PARALAB_SERVE": "off"}
    ok = subprocess.run([sys.executable, "-c", LEAVE, "train", "single", *FAST, "--out", str(tmp_path / "run")],
                        capture_output=True, text=True, timeout=240, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "records written to" in ok.stdout and ok.stdout.rstrip().endswith("exit handler ran"), ok.stdout
    assert "torn down" not in ok.stdout
    again = subprocess.run([sys.executable, "-c", LEAVE, "train", "single", *FAST, "--out", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=240, env=env)
    assert again.returncode == 2 and "already holds a run" in again.stderr, again.stderr
    assert "exit handler ran" in again.stdout and "torn down" not in again.stdout


@pytest.mark.parametrize("argv,early", [(["compare"], True), (["sweep", "--workers", "2"], True),
                                        (["compare", "--dry-run"], False), (["compare", "--help"], False),
                                        (["compare", "--train-args=--start spawn"], False),
                                        (["train", "ddp"], False), ([], False)])
def test_commands_of_many_runs_start_their_forkserver_before_importing_torch(argv, early):
    """`compare` and `sweep` start the warm forkserver first thing (it imports while they do); help, a dry
    run, fresh-interpreter runs and single commands start none; nothing here has imported torch."""
    code = ("import sys; from paralab import front; front.warm_early(sys.argv[1:]); "
            "from multiprocessing import forkserver as s; "
            "print(s._forkserver._forkserver_pid is not None, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(early), "False"]
