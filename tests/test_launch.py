"""The launcher: local workers, manual --rank (one host, and two network namespaces), torchrun,
batch splitting, core pinning, and what happens when a rank fails."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import FAST
from paralab.cli import main
from paralab.config import RunConfig
from paralab.errors import UsageError
from paralab.launch import free_port

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


# ------------------------------------------------------------------ failures
def test_a_failing_rank_stops_every_rank(paralab):
    marker = uuid.uuid4().hex
    r = paralab("train", "ddp", "--workers", "3", "--per-worker-batch", "8", "--num-batches", "4",
                env={"PARALAB_FAULT": "1:1", "PARALAB_TEST_MARK": marker})
    assert r.returncode == 1
    assert "paralab: rank 1 failed; all ranks stopped" in r.stderr
    assert "RuntimeError: injected fault on rank 1 at step 1" in r.stderr  # that rank's traceback
    assert 'File "' in r.stderr.split("rank 1 failed", 1)[1]
    assert not (r.out / "summary.json").exists()
    assert gone(marker), "worker processes outlived the launcher"


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
        assert (tmp_path / "rank1" / "checkpoint" / "rank1.pt").exists()  # each rank keeps its own state
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
