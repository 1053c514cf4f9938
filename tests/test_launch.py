"""The launcher: local workers, manual --rank (one host, and two network namespaces), torchrun,
batch splitting, core pinning, and what happens when a rank fails."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import FAST, commit_generation
from paralab.cli import main
from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.run.rendezvous import free_port

CHECK = ["--num-batches", "2", "--check", "--lr", "1e-3"]


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries the marker (the launcher's descendants)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"PARALAB_TEST_MARK={marker}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def gone(marker: str, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while marked_processes(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def rank_cmd(rank: int, port: int, out: Path, *extra: str, addr: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "paralab", "train", "ddp", "--world-size", "2", "--rank", str(rank),
            "--master-addr", addr, "--master-port", str(port), *CHECK, *FAST, "--out", str(out), *extra]


def run_ranks(cmds: list[list[str]], env: dict | None = None, timeout: float = 180) -> list[tuple[int, str, str]]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}) for c in cmds]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


# ------------------------------------------------------------------ batch splitting
def test_global_batch_must_divide_over_workers(capsys, tmp_path):
    with pytest.raises(UsageError, match="--batch-size 32 must divide evenly over 3"):
        RunConfig(strategy="ddp", workers=3, batch_size=32, dataset="synthetic").validate()
    with pytest.raises(UsageError, match="over 3 data-parallel replicas"):  # the manual form counts ranks
        RunConfig(strategy="allreduce", world_size=3, rank=1, batch_size=100, dataset="synthetic").validate()
    cfg = RunConfig(strategy="ddp", workers=3, batch_size=32, per_worker_batch=16, dataset="synthetic").validate()
    from paralab.strategies import get_strategy
    assert cfg.global_batch(get_strategy("ddp")) == 48
    out = tmp_path / "never"
    assert main(["train", "gather-scatter", "--workers", "3", "--batch-size", "32", "--dataset", "synthetic",
                 "--out", str(out)]) == 2
    assert "use --per-worker-batch" in capsys.readouterr().err and not out.exists()


def test_per_worker_batch_and_core_pinning(paralab):
    r = paralab("train", "allreduce", "--workers", "2", "--per-worker-batch", "8", "--cores-per-worker", "1",
                "--num-batches", "2")
    assert r.returncode == 0, r.stderr
    assert r.summary["global_batch"] == 16 and r.summary["workers"] == 2
    rows = r.rows("steps.jsonl")
    assert sorted((row["rank"], row["samples"]) for row in rows) == [(0, 8), (0, 8), (1, 8), (1, 8)]
    config = json.loads((r.out / "config.json").read_text())
    assert config["launched_by"] == "local" and config["cores_per_worker"] == 1
    assert config["environment"]["torch_threads"] == 1  # rank 0 writes the record
    if hasattr(os, "sched_setaffinity"):
        assert config["environment"]["cores_available"] == 1


def test_a_gpu_rank_leaves_half_its_cores_to_the_driver():
    """On CUDA a rank's host threads only feed the GPU: half its share of the cores (the CUDA driver's and
    NCCL's threads get the rest); on CPU a lone worker keeps torch's own count."""
    import torch
    from paralab.run.rendezvous import pin
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    before = torch.get_num_threads()
    try:
        pin(0, RunConfig(device="cuda"), 1)
        assert torch.get_num_threads() == max(1, cores // 2)
        torch.set_num_threads(before)
        pin(0, RunConfig(device="cpu"), 1)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_peer_that_never_joins_is_named_and_nothing_is_left(tmp_path):
    """A manual launch whose other rank never starts: rank 0 says the group did not form and who to start;
    a lone rank 1 says rank 0's rendezvous did not answer. One line each, no traceback, no run folder."""
    ports = [free_port(), free_port()]
    outs = [tmp_path / "alone0", tmp_path / "alone1"]
    results = run_ranks([rank_cmd(r, ports[r], outs[r], "--timeout", "3") for r in (0, 1)], timeout=120)
    for (code, _, err), out in zip(results, outs):
        assert code == 1 and "Traceback" not in err, err[-2000:]
        assert not out.exists()
    assert ("paralab: rank 0: the group of 2 did not form within --timeout 3 s" in results[0][2]
            and f"127.0.0.1:{ports[0]}: start every other rank (--rank 1 to 1" in results[0][2]), results[0][2][-1500:]
    assert ("paralab: rank 1: could not join the group within --timeout 3 s: rank 0's rendezvous at "
            f"127.0.0.1:{ports[1]} did not answer" in results[1][2]), results[1][2][-1500:]


# ------------------------------------------------------------------ failures
def consequences(stderr: str) -> dict[int, str]:
    """The launcher's list of ranks that failed because of the first one: rank -> how."""
    listed = stderr.split("paralab: then, as a consequence:\n", 1)[1] if "as a consequence" in stderr else ""
    found = {}
    for line in listed.splitlines():
        if not line.startswith("paralab:   rank "):
            break
        rank, how = line.removeprefix("paralab:   rank ").split(": ", 1)
        found[int(rank)] = how
    return found


def caused_by_the_first(how: str) -> bool:
    """A consequence: the rank lost its peer, or was still running and the launcher stopped it."""
    return how.startswith("lost its peer: ") or how == "still running: stopped by the launcher"


def test_a_failing_rank_stops_every_rank(paralab):
    r = paralab("train", "ddp", "--workers", "3", "--per-worker-batch", "8", "--num-batches", "4",
                env={"PARALAB_FAULT": "1:1"})
    assert r.returncode == 1
    first = "paralab: rank 1 failed first: RuntimeError: injected fault on rank 1 at step 1 (PARALAB_FAULT); " \
            "all ranks stopped."
    assert first in r.stderr, r.stderr[-3000:]
    traceback_text = r.stderr.split(first, 1)[1].split("paralab: then", 1)[0]
    assert 'File "' in traceback_text and "faults.py" in traceback_text  # that rank's traceback
    others = consequences(r.stderr)
    assert sorted(others) == [0, 2] and all(caused_by_the_first(how) for how in others.values()), r.stderr[-3000:]
    assert "to resume" not in r.stderr  # no checkpoint was written before the failure
    assert not (r.out / "summary.json").exists()
    assert not r.left_running(), "worker processes outlived the launcher"


def test_a_rank_killed_by_sigkill_is_named_and_the_run_says_how_to_resume(paralab, tmp_path):
    """Rank 1 SIGKILLs itself at step 2 (no traceback, as the out-of-memory killer does): the launcher
    names rank 1 and the signal, not rank 0's "Connection reset by peer", and prints the command that
    resumes from the checkpoint of step 2, which works."""
    events = tmp_path / "events.jsonl"
    r = paralab("train", "ddp", "--workers", "2", "--num-batches", "4", "--checkpoint-every", "1",
                env={"PARALAB_FAULT": "1:2:kill", "PARALAB_EVENTS": str(events)})
    assert r.returncode == 1
    assert "paralab: rank 1 failed first: killed by signal SIGKILL (no traceback: killed from outside the " \
           "process, by the kernel's out-of-memory killer" in r.stderr, r.stderr[-3000:]
    others = consequences(r.stderr)
    assert list(others) == [0] and caused_by_the_first(others[0]), r.stderr[-3000:]
    assert "rank 0 failed first" not in r.stderr
    error = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "error"]
    assert len(error) == 1 and error[0]["rank"] == 1 and error[0]["signal"] == 9
    assert error[0]["message"] == "rank 1 killed by signal SIGKILL"
    assert [c["rank"] for c in error[0]["consequences"]] == [0]

    assert f"paralab: the checkpoint of step 2 is complete ({r.out / 'checkpoint'}); to resume:" in r.stderr
    command = r.stderr.split("to resume:\n", 1)[1].splitlines()[0].strip()
    assert command == error[0]["resume"]
    words = shlex.split(command)
    assert words[:3] == ["paralab", "train", "ddp"] and words[words.index("--workers") + 1] == "2"
    assert words[words.index("--checkpoint-every") + 1] == "1" and words[words.index("--num-batches") + 1] == "4"
    assert words[words.index("--resume") + 1] == str(r.out) and words[words.index("--out") + 1] == str(r.out)
    p = subprocess.run([sys.executable, "-m", *words], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {r.out} at step 2" in p.stdout
    from paralab.run.checkpoint import load
    assert load(r.out, 0)["step"] == load(r.out, 1)["step"] == 4


def test_an_out_of_memory_style_exit_is_named_with_its_exit_code(paralab):
    """PARALAB_FAULT's ``oom``: rank 0 ends at once with exit code 137 (128 + SIGKILL) and no Python
    error, as a wrapper reports a process the out-of-memory killer took; rank 0 is blamed, not rank 1."""
    r = paralab("train", "allreduce", "--workers", "2", "--num-batches", "3", env={"PARALAB_FAULT": "0:1:oom"})
    assert r.returncode == 1
    assert "paralab: rank 0 failed first: exited with code 137 and no Python error (137 = 128 + 9: how a shell " \
           "or container runtime reports a process killed by SIGKILL, most often by the out-of-memory killer" \
           in r.stderr, r.stderr[-3000:]
    others = consequences(r.stderr)
    assert list(others) == [1] and caused_by_the_first(others[1]), r.stderr[-3000:]


def test_a_single_process_run_that_fails_says_how_to_resume(paralab):
    r = paralab("train", "single", "--num-batches", "3", "--checkpoint-every", "1", "--seed", "3",
                env={"PARALAB_FAULT": "0:2"})
    assert r.returncode == 1 and "RuntimeError: injected fault on rank 0 at step 2" in r.stderr
    assert f"paralab: the checkpoint of step 2 is complete ({r.out / 'checkpoint'}); to resume:" in r.stderr
    words = shlex.split(r.stderr.split("to resume:\n", 1)[1].splitlines()[0])
    assert words[:3] == ["paralab", "train", "single"] and "--workers" not in words
    for flag, value in (("--seed", "3"), ("--num-batches", "3"), ("--resume", str(r.out)), ("--out", str(r.out))):
        assert words[words.index(flag) + 1] == value, words


def test_a_save_that_stopped_half_way_is_ignored_and_the_last_committed_one_offered(tmp_path):
    """A run stopped between two ranks' saves of step 4 leaves a torn generation: it is never read; step 2's,
    committed, is what a resume continues from and what the hint offers."""
    from paralab.run import checkpoint
    from paralab.run.failures import resume_hint
    cfg = RunConfig(strategy="ddp", workers=2, dataset="synthetic", batch_size=32, num_batches=10).validate()
    ident = checkpoint.identity(cfg)
    with pytest.raises(UsageError, match="no complete checkpoint"):
        RunConfig(**{**cfg.to_dict(), "resume": str(tmp_path)}).validate()
    assert resume_hint(cfg, tmp_path) is None  # no complete checkpoint: no command offered
    commit_generation(tmp_path, 2, ident, {r: {"step": 2, "identity": ident, "state": {"model": {}}} for r in (0, 1)}, 2)
    torn = commit_generation(tmp_path, 4, ident, {0: {"step": 4, "identity": ident, "state": {"model": {}}}}, 2)
    (torn / "manifest.json").unlink()  # rank 1 never wrote its file: no commit
    assert checkpoint.resumable_step(tmp_path, cfg) == 2
    assert "step-00000004" in checkpoint.torn_note(tmp_path) and "step 2's" in checkpoint.torn_note(tmp_path)
    RunConfig(**{**cfg.to_dict(), "resume": str(tmp_path)}).validate()  # resumes, from step 2
    command, lines = resume_hint(cfg, tmp_path)
    assert lines[0] == f"paralab: the checkpoint of step 2 is complete ({tmp_path / 'checkpoint'}); to resume:"
    words = shlex.split(command)
    assert words[words.index("--resume") + 1] == words[words.index("--out") + 1] == str(tmp_path)


# ------------------------------------------------------------------ what the launcher says, without processes
def ending(rank, code, seen, report=None, stopped=False):
    from paralab.run.failures import Ending
    return Ending(rank, code, seen, report, stopped)


def exception(rank, at, last_line):
    return {"rank": rank, "kind": "exception", "time": at, "summary": last_line,
            "traceback": f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{last_line}\n"}


def test_the_first_failure_is_blamed_even_when_a_lost_peer_reports_earlier():
    """A survivor's "Connection closed by peer" can reach the launcher before it sees the killed rank
    end (the rank's clock vs the launcher's): a lost peer is never the cause while a death explains it."""
    from paralab.run.failures import explain
    lost = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:4242: Connection closed by peer"
    cause, lines = explain([ending(0, 1, 10.5, exception(0, 10.1, lost)), ending(1, -9, 10.2),
                            ending(2, -15, 12.6, stopped=True)])
    assert cause.rank == 1 and lines[0].startswith("paralab: rank 1 failed first: killed by signal SIGKILL")
    assert lines[1] == "paralab: then, as a consequence:"
    assert lines[2] == f"paralab:   rank 0: lost its peer: {lost}"
    assert lines[3] == "paralab:   rank 2: still running: stopped by the launcher"
    # two ranks fail on their own account: the earlier is the cause, the other is listed, not hidden
    cause, lines = explain([ending(0, 1, 9.0, exception(0, 8.0, "ValueError: bad")), ending(1, -11, 8.5)])
    assert cause.rank == 0 and lines[-1].startswith("paralab: rank 1 also failed: killed by signal SIGSEGV "
                                                    "(a crash in native code")
    # every error a lost connection: the earliest is named, and said to be only that
    cause, lines = explain([ending(0, 1, 5.0, exception(0, 4.0, lost)), ending(1, 1, 5.0, exception(1, 3.0, lost))])
    assert cause.rank == 1 and "every rank's error is a lost connection" in lines[1]
    # orderly exits every rank takes together (check FAIL, diverged loss) are not failures
    orderly = {"kind": "exit", "code": 1, "time": 1.0, "summary": "an orderly exit (code 1)"}
    assert explain([ending(0, 1, 2.0, {**orderly, "rank": 0}), ending(1, 1, 2.0, {**orderly, "rank": 1})]) is None
    assert explain([ending(0, 0, 2.0), ending(1, 0, 2.0)]) is None
    # an exit code nobody explained is a failure, and a code above 128 is read as 128 + a signal
    cause, lines = explain([ending(0, 0, 2.0), ending(1, 137, 1.0)])
    assert cause.rank == 1 and "137 = 128 + 9" in lines[0] and "SIGKILL" in lines[0]
    cause, lines = explain([ending(0, 1, 2.0)])
    assert "exited with code 1 and no Python error (its own output above may say why)" in lines[0]


def test_the_resume_command_gives_back_the_same_config():
    """to_argv spells a config as the train parser reads it: parsed back, it is the same config."""
    from paralab.cli import build_parser, config_from_args
    cfg = RunConfig(strategy="fsdp", workers=3, batch_size=48, lr=1e-3, num_batches=7, dataset="synthetic",
                    augment=False, progress=False, check=True, zero_stage=2, step_in_backward=False,
                    checkpoint_every=2, save_init=True, width=0.125, timeout=12.5, eval_batches=1)
    words = ["paralab", "train", *cfg.to_argv(out="runs/x y", resume="runs/x y", save_init=False)]
    assert words[:3] == ["paralab", "train", "fsdp"] and "--save-init" not in words
    assert "--no-step-in-backward" in words and "--no-augment" in words and "--check" in words
    back = config_from_args(build_parser().parse_args(words[1:]))
    assert back == RunConfig(**{**cfg.to_dict(), "out": "runs/x y", "resume": "runs/x y", "save_init": False})


def test_workers_die_with_the_launcher(tmp_path):
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "paralab", "train", "ddp", "--workers", "2", *FAST, "--num-batches", "100000",
           "--log-every", "1", "--out", str(tmp_path / "run")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "PARALAB_TEST_MARK": marker})
    try:
        for line in p.stdout:  # wait until the ranks are training
            if line.startswith("step"):
                break
        assert len(marked_processes(marker)) >= 3  # launcher + 2 ranks
        p.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel must take the ranks down
        p.wait()
        assert gone(marker), "ranks outlived a killed launcher"
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ manual --rank and torchrun
@pytest.mark.parametrize("fault", [False, True], ids=["ok", "rank1-fails"])
def test_manual_ranks_on_one_host(tmp_path, fault):
    port = free_port()
    env = {"PARALAB_FAULT": "1:1"} if fault else {}
    (rc0, out0, err0), (rc1, out1, err1) = run_ranks(
        [rank_cmd(r, port, tmp_path / f"rank{r}", "--accumulate", "2", "--bucket-mb", "0.1") for r in (0, 1)],
        env=env)
    if not fault:
        assert (rc0, rc1) == (0, 0), err0 + err1
        assert "check: PASS" in out0 and "2 shard(s) x 2 microbatch(es)" in out0
        summary = json.loads((tmp_path / "rank0" / "summary.json").read_text())
        assert summary["workers"] == 2 and summary["check"]["result"] == "PASS"
        assert all(len(d["buckets"]) > 1 for d in summary["strategy_details"].values())  # --bucket-mb arrived
        config = json.loads((tmp_path / "rank0" / "config.json").read_text())
        assert config["launched_by"] == "manual" and config["rank"] == 0 and config["world_size"] == 2
        from paralab.run.checkpoint import checkpoint_path
        assert checkpoint_path(tmp_path / "rank1", 1).exists()  # each rank keeps its own state (and manifest)
    else:
        why = f"rank 0 (exit {rc0}):\n{err0[-2000:]}\nrank 1 (exit {rc1}):\n{err1[-2000:]}"
        assert rc1 == 1 and "RuntimeError: injected fault on rank 1 at step 1" in err1, why
        assert "paralab: rank 1 failed" in err1, why
        assert rc0 == 1 and "paralab: rank 0 failed" in err0, why  # it lost its peer and stopped too
        assert not (tmp_path / "rank0" / "summary.json").exists()


def test_torchrun(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "paralab", "train", "ddp", *CHECK, *FAST, "--out", str(out)],
                       capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "check: PASS" in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["check"]["result"] == "PASS"
    assert json.loads((out / "config.json").read_text())["launched_by"] == "torchrun"


# ------------------------------------------------------------------ two hosts: two network namespaces
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def test_two_hosts_in_network_namespaces(tmp_path):
    """One rank per namespace, joined by a veth pair; the addresses exist only inside them."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        pytest.skip("needs Linux and iproute2 (`ip`) for network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = {0: (f"plab{tag}a", f"pl{tag}a", "10.123.0.1"), 1: (f"plab{tag}b", f"pl{tag}b", "10.123.0.2")}
    created: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        try:
            for ns, _, _ in hosts.values():
                _ip("netns", "add", ns)
                created.append(ns)
            (ns0, if0, addr0), (ns1, if1, addr1) = hosts[0], hosts[1]
            # both ends are created inside the namespaces: nothing appears in the host's network
            _ip("link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
            for ns, ifname, addr in hosts.values():
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"network namespaces are not permitted here (`{' '.join(exc.cmd)}` says: "
                        f"{exc.stderr.strip() or exc.returncode}); needs root or CAP_NET_ADMIN/CAP_SYS_ADMIN")
        assert "10.123.0." not in _ip("-4", "addr").stdout  # the host itself has no such address

        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("GLOO_SOCKET_IFNAME", None)
        for rank, (ns, _, _) in hosts.items():
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *rank_cmd(rank, port, tmp_path / f"host{rank}",
                                                                             addr=addr0)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        results = [p.communicate(timeout=180) for p in procs]
        for rank, (p, (out, err)) in enumerate(zip(procs, results)):
            assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
            assert f"gloo uses interface {hosts[rank][1]}" in err  # the veth, found from the route
        summary = json.loads((tmp_path / "host0" / "summary.json").read_text())
        assert summary["workers"] == 2 and summary["check"]["result"] == "PASS"
        # the gradients really crossed the veth: at least one model's worth of bytes each way
        for ns, ifname, _ in hosts.values():
            stats = _ip("-n", ns, "-s", "-j", "link", "show", ifname).stdout
            counters = json.loads(stats)[0]["stats64"]
            assert counters["rx"]["bytes"] > 4 * summary["parameters"]
            assert counters["tx"]["bytes"] > 4 * summary["parameters"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in created:  # deleting a namespace removes its end of the veth pair, and so the pair
            _ip("netns", "del", ns, check=False)
