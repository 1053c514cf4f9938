"""--network: an emulated cluster network (network.py): parsing, refusals, the links it builds, real
runs over them, and that nothing of a run is left behind however it ends."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paralab.run import network
from paralab.run.config import RunConfig
from paralab.errors import UsageError

from conftest import FAST

ROOT_AND_TOOLS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not ROOT_AND_TOOLS, reason="--network needs root and iproute2 (ip, tc): "
                                "namespaces and qdiscs cannot be created here")


# ---------------------------------------------------------------------------- parsing and refusals
def test_rates_and_latency_parse():
    assert network.parse("100mbit").rate_bps == 100e6
    assert network.parse("1gbit").rate_bps == 1e9
    assert network.parse("2.5Gbit").gbps == 2.5
    spec = network.parse("1gbit,200us")
    assert spec.rate_bps == 1e9 and spec.latency_s == pytest.approx(200e-6)
    # the bucket: one GSO packet at least, else 1 ms at the rate; the queue: 50 ms, at least 1 MiB
    assert network.parse("100mbit").burst_bytes == 64 * 1024
    assert network.parse("10gbit").burst_bytes == 1_250_000
    assert network.parse("1gbit").limit_bytes == 6_250_000
    for bad in ("fast", "100", "100mb", "0gbit", "100kbit", "1gbit,soon", "-1gbit"):
        with pytest.raises(UsageError, match="--network"):
            network.parse(bad)


def test_without_root_or_user_namespaces_it_is_refused_before_start_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    tried = []

    def refused(*args, check=True):
        tried.append(args)
        return subprocess.CompletedProcess(args, 1, "", "unshare: unshare failed: Operation not permitted")
    monkeypatch.setattr(network, "_run", refused)
    with pytest.raises(UsageError, match="not root, so it needs an unprivileged user namespace") as exc:
        network.check_can_emulate(network.parse("1gbit"))
    assert "Operation not permitted" in str(exc.value)  # the kernel's own words
    assert "drop --network" in str(exc.value) and "sudo" in str(exc.value)
    assert tried and tried[0][:3] == network.USERNS  # it asked the kernel, as this user


def test_without_root_it_goes_ahead_where_user_namespaces_are_allowed(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(network, "userns_refusal", lambda: None)
    network.check_can_emulate(network.parse("1gbit"))  # no error: the launcher will use a user namespace
    assert network.sandbox_command(["x"]) == [*network.USERNS, "--net", "--mount", "--", "x"]


def test_without_iproute2_it_is_refused(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(UsageError, match="iproute2 .*tc not found"):
        network.check_can_emulate(network.parse("1gbit"))


def test_latency_without_netem_is_refused_and_never_faked(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(network, "has_netem", lambda: False)
    with pytest.raises(UsageError, match="no netem .*only bandwidth is.*--network 1gbit\\)"):
        network.check_can_emulate(network.parse("1gbit,200us"))


@needs_root
def test_this_kernel_is_probed_for_netem_honestly():
    """has_netem really asks the kernel (in a scratch namespace it removes again)."""
    before = set(network.namespaces_of())
    probe = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
    if probe.returncode == 0:  # (the host's loopback: put it back)
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    assert network.has_netem() == (probe.returncode == 0 or "unknown" not in probe.stderr.lower())
    assert set(network.namespaces_of()) == before


def test_network_is_for_local_workers_only():
    cfg = RunConfig(strategy="ddp", world_size=2, rank=0, network="1gbit", dataset="synthetic")
    with pytest.raises(UsageError, match="--network emulates links between local workers"):
        cfg.validate()


# ---------------------------------------------------------------------------- the links
def _qdisc(namespace: str, device: str) -> str:
    return subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", device], capture_output=True,
                          text=True, check=True).stdout


@needs_root
def test_each_rank_gets_its_own_namespace_address_and_a_link_shaped_both_ways():
    with network.Network(network.parse("1gbit"), 3) as net:
        assert set(network.namespaces_of(net.tag)) == set(net.namespaces)
        for link in net.links:
            addr = subprocess.run(["ip", "-n", link.namespace, "-4", "addr", "show", "dev", "eth0"],
                                  capture_output=True, text=True, check=True).stdout
            assert f"inet {link.address}/24" in addr
            assert "tbf" in _qdisc(link.namespace, "eth0") and "rate 1Gbit" in _qdisc(link.namespace, "eth0")
            port = _qdisc(net.switch, f"r{link.rank}")  # the switch's side: traffic into the rank
            assert "tbf" in port and "rate 1Gbit" in port and "burst 125000b" in port
        assert len({link.address for link in net.links}) == 3
        # the host's own namespace holds none of it
        host = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        assert network.SUBNET not in host
    assert network.namespaces_of(net.tag) == []


@needs_root
def test_a_failure_while_building_removes_what_was_built(monkeypatch):
    calls = []

    def failing_shape(self, namespace, device):
        calls.append(namespace)
        if len(calls) == 3:
            raise network.NetworkError("injected")
    monkeypatch.setattr(network.Network, "_shape", failing_shape)
    net = network.Network(network.parse("1gbit"), 3)
    with pytest.raises(network.NetworkError, match="injected"):
        net.up()
    assert network.namespaces_of(net.tag) == []


@needs_root
def test_namespaces_of_a_dead_launcher_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{network.PREFIX}{dead.pid}-abcdef-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in network.remove_orphans()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert name not in network.namespaces_of()


# ---------------------------------------------------------------------------- runs over the links
def _interruptible() -> None:
    """In the child before exec: SIGINT handled by default, even where this test process ignores it (a
    test suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would
    every paralab it starts: Ctrl-C would then be ignored, as it should be for a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _launch(tmp_path, *args, env=None):
    """Start ``paralab train`` (its pid names its namespaces: paralab-<pid>-...)."""
    cmd = [sys.executable, "-m", "paralab", "train", *args, *FAST, "--out", str(tmp_path / "run")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, preexec_fn=_interruptible)


@needs_root
def test_ddp_over_a_100mbit_network_is_correct_link_limited_recorded_and_cleaned_up(tmp_path, capsys):
    proc = _launch(tmp_path, "ddp", "--workers", "2", "--num-batches", "4", "--network", "100mbit", "--check")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "emulated network: 2 ranks, each on its own full-duplex 100 Mbit/s link" in err
    assert network.namespaces_of(f"{network.PREFIX}{proc.pid}-") == []
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    emulated = config["network_emulated"]
    assert config["network"] == "100mbit" and emulated["rate_bps"] == 100e6
    assert [link["address"] for link in emulated["links"]] == ["10.213.0.1", "10.213.0.2"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["check"]["result"] == "PASS", summary["check"]
    # gloo really crossed the shaped link: the all-reduce's bus bandwidth is bounded by 100 Mbit/s
    # (12.5 MB/s; tbf's 64 KiB bucket lets a little more through on a small message), where the
    # loopback gives hundreds of MB/s
    busbw = summary["comm_ops"]["all_reduce"]["busbw_GBps"]
    assert 0.005 < busbw < 0.0125 * 1.2, busbw

    from paralab.analysis.runs import load_run
    from paralab.report.page import environment_rows
    rows = dict(map(tuple, environment_rows(load_run(run))))
    assert "full-duplex 100 Mbit/s link" in rows["network"]
    calc = subprocess.run([sys.executable, "-m", "paralab", "calc", "run", str(run)], capture_output=True,
                          text=True, timeout=60)
    assert calc.returncode == 0, calc.stderr
    assert "link bandwidth from the run's --network: 0.1 Gb/s" in calc.stdout
    assert "share of the link" in calc.stdout and "predicted" in calc.stdout


@needs_root
def test_a_rank_killed_mid_run_leaves_no_namespace_or_link(tmp_path):
    proc = _launch(tmp_path, "ddp", "--workers", "2", "--num-batches", "6", "--network", "1gbit",
                   env={"PARALAB_FAULT": "1:3:kill"})
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    assert "emulated network" in err and "rank 1 failed first: killed by signal SIGKILL" in err
    assert network.namespaces_of(f"{network.PREFIX}{proc.pid}-") == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"{network.PREFIX}{proc.pid}-" not in links  # (no veth of the run left in the host either)


@needs_root
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_mid_run_leaves_nothing(tmp_path, how):
    proc = _launch(tmp_path, "ddp", "--workers", "2", "--num-batches", "1000", "--network", "1gbit")
    prefix = f"{network.PREFIX}{proc.pid}-"
    try:
        deadline = time.monotonic() + 120
        while len(network.namespaces_of(prefix)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert len(network.namespaces_of(prefix)) == 3  # the switch and two ranks, while it runs
        time.sleep(4)  # the ranks are in their namespaces, starting or training
        assert proc.poll() is None
        proc.send_signal(how)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, err[-2000:]
    assert network.namespaces_of(prefix) == [], err[-2000:]


@needs_root
def test_compare_passes_network_to_its_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "paralab", "compare", "--strategies", "ddp", "--workers", "2",
                        "--network", "100mbit", "--dataset", "synthetic", "--dry-run", "--out", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "paralab train ddp --workers 2" in r.stdout and "--network 100mbit" in r.stdout


# ---------------------------------------------------------------------------- without root
def _unprivileged():
    """(a Python that an unprivileged user can run with this checkout's packages, its env) for running
    paralab as `nobody`, or skip saying why. The launcher re-runs itself with sys.executable, so the
    interpreter must be one `nobody` can start from inside its own processes (not one under /root)."""
    import site
    import sysconfig
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop to an unprivileged user")
    paths = [str(Path(__file__).resolve().parents[1] / "src"), *site.getsitepackages(),
             sysconfig.get_paths()["purelib"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"}
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch, paralab'], check=True)"
    for python in dict.fromkeys([sys.executable, f"/usr/bin/python{minor}", f"/usr/local/bin/python{minor}"]):
        if os.path.exists(python) and subprocess.run([*AS_NOBODY, python, "-c", probe], env=env,
                                                     capture_output=True).returncode == 0:
            return python, env
    pytest.skip(f"no Python {minor} that the unprivileged user can start with this checkout's packages")


AS_NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def _network_namespaces_of_nobody() -> list[str]:
    """Every network namespace that a process of uid 65534 is in (the kernel's own list)."""
    out = subprocess.run(["lsns", "-t", "net", "-n", "-o", "NS,USER"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[1:] == ["nobody"]]


def _run_unprivileged(*args, env_extra=None):
    import tempfile
    python, env = _unprivileged()
    home = Path(tempfile.mkdtemp(prefix="paralab-nobody-", dir="/tmp"))
    home.chmod(0o777)
    cmd = [*AS_NOBODY, python, "-m", "paralab", "train", *args, *FAST, "--out", str(home / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=home,
                          env={**env, "HOME": str(home), **(env_extra or {})})
    return proc, home


@needs_root
def test_without_root_a_user_namespace_gives_the_same_links_and_leaves_nothing():
    assert _network_namespaces_of_nobody() == []
    named = set(network.namespaces_of())
    proc, home = _run_unprivileged("ddp", "--workers", "2", "--num-batches", "4", "--network", "100mbit", "--check")
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not root: building the emulated network inside a user namespace" in proc.stderr
        assert "full-duplex 100 Mbit/s link" in proc.stderr and "in a user namespace (no root)" in proc.stderr
        run = home / "run"
        assert run.stat().st_uid == 65534  # written by the user, not by root
        emulated = json.loads((run / "config.json").read_text())["network_emulated"]
        assert emulated["namespaces"] == "user namespace (no root)" and emulated["rate_bps"] == 100e6
        summary = json.loads((run / "summary.json").read_text())
        assert summary["check"]["result"] == "PASS", summary["check"]
        busbw = summary["comm_ops"]["all_reduce"]["busbw_GBps"]
        assert 0.005 < busbw < 0.0125 * 1.2, busbw  # the shaped link, not the loopback
        # nothing of it in the host: no named namespace, no address; and the kernel freed its namespaces
        assert set(network.namespaces_of()) == named
        host = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        assert network.SUBNET not in host
        assert _network_namespaces_of_nobody() == []
    finally:
        shutil.rmtree(home, ignore_errors=True)


@needs_root
@pytest.mark.slow
def test_without_root_a_rank_killed_mid_run_leaves_nothing():
    proc, home = _run_unprivileged("ddp", "--workers", "2", "--num-batches", "6", "--network", "1gbit",
                                   env_extra={"PARALAB_FAULT": "1:3:kill"})
    try:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "rank 1 failed first: killed by signal SIGKILL" in proc.stderr
        assert _network_namespaces_of_nobody() == []
    finally:
        shutil.rmtree(home, ignore_errors=True)


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_without_root_ctrl_c_or_sigterm_mid_run_stops_it_and_leaves_nothing(how):
    import tempfile
    python, env = _unprivileged()
    home = Path(tempfile.mkdtemp(prefix="paralab-nobody-", dir="/tmp"))
    home.chmod(0o777)
    cmd = [*AS_NOBODY, python, "-m", "paralab", "train", "ddp", "--workers", "2", "--num-batches", "1000",
           "--network", "1gbit", *FAST, "--out", str(home / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home,
                            env={**env, "HOME": str(home)}, preexec_fn=_interruptible)
    try:
        deadline = time.monotonic() + 120
        while len(_network_namespaces_of_nobody()) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert len(_network_namespaces_of_nobody()) >= 3  # the launcher's and the two ranks', while it runs
        time.sleep(4)
        assert proc.poll() is None
        proc.send_signal(how)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0, err[-2000:]
        deadline = time.monotonic() + 10  # the kernel frees a namespace as its last process is reaped
        while _network_namespaces_of_nobody() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _network_namespaces_of_nobody() == [], err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def test_with_latency_each_link_gets_netem_half_the_delay_in_front_of_tbf(monkeypatch):
    """The netem path as commands (this kernel has no netem to run them on): one-way latency L is L/2 on
    each of the two links a packet crosses, netem at the root, the rate's tbf as its child."""
    issued = []
    monkeypatch.setattr(network, "_run", lambda *args, check=True: issued.append(args))
    net = network.Network(network.parse("1gbit,200us"), 2)
    net._shape("ns", "eth0")
    assert issued[0] == ("tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
                         "netem", "delay", "100us", "limit", "100000")
    assert issued[1][:10] == ("tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle") \
        and issued[1][11:14] == ("tbf", "rate", "1000000000bit")
    issued.clear()
    network.Network(network.parse("1gbit"), 2)._shape("ns", "eth0")  # without latency: tbf alone at the root
    assert len(issued) == 1 and issued[0][7:11] == ("root", "handle", "1:", "tbf")
