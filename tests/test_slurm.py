"""Slurm: the rendezvous read from a task's environment, and (slow, as root) a real one-host cluster.

The unit tests feed made-up environments to the parser; the launch tests start ranks with the
environment srun would give them; the slow test installs Debian's slurmd/slurmctld/munge, starts a
one-host cluster in a temporary folder, submits `train ddp --check` as a 2-task job and reads the run.
"""
from __future__ import annotations

import json
import shlex
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST
from paralab.errors import UsageError
from paralab.run.rendezvous import expand_nodelist, free_port, slurm_place, tasks_per_node, under_slurm

CHECK = ["--num-batches", "2", "--check", "--lr", "1e-3"]


# ------------------------------------------------------------------ the node list
@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("localhost", ["localhost"]),
    ("a1,b[9-11]", ["a1", "b9", "b10", "b11"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("n[007]", ["n007"]),
    ("c[1,3],d.example.org", ["c1", "c3", "d.example.org"]),
])
def test_node_lists_expand(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, says", [
    ("node[01-03", "'[' with no ']'"), ("node]", "']' with no '['"), ("a,,b", "empty host name"),
    ("n[3-1]", "runs backwards"), ("n[a-b]", "not a number or a range"), ("n[[1]]", "bracket inside"),
    ("no de", "not a host name"), ("", "empty host name"),
])
def test_bad_node_lists_say_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        expand_nodelist(text)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    assert tasks_per_node("") == [] and tasks_per_node("two") == []


# ------------------------------------------------------------------ the environment
def task(procid: int, ntasks: int = 4, **extra) -> dict:
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(procid % 2),
           "SLURM_NODEID": str(procid // 2), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2"}
    return {**env, **extra}


def test_a_task_reads_its_place_and_the_master_from_slurm():
    place = slurm_place(task(3))
    assert (place.rank, place.world, place.local_rank, place.local_world, place.nodes) == (3, 4, 1, 2, 2)
    assert place.master_addr == "node07"
    assert place.master_port == 15000 + 123456 % 10000 == 18456  # every task derives the same port


def test_the_port_and_address_given_win():
    assert slurm_place(task(0, MASTER_PORT="29411")).master_port == 29411
    assert slurm_place(task(0, MASTER_PORT="29411"), master_port=30001).master_port == 30001  # --master-port
    assert slurm_place(task(0, MASTER_ADDR="10.0.0.9")).master_addr == "10.0.0.9"


@pytest.mark.parametrize("change, says", [
    ({"SLURM_JOB_NODELIST": "node[07-"}, "cannot read Slurm's node list 'node\\[07-'"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_PROCID": "4"}, "not in \\[0, SLURM_NTASKS=4\\)"),
    ({"SLURM_NTASKS": "four"}, "SLURM_NTASKS='four' is not a number"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
    ({"MASTER_PORT": "70000"}, "not a TCP port"),
])
def test_an_unreadable_environment_is_refused(change, says):
    with pytest.raises(UsageError, match=says):
        slurm_place(task(0, **change))


def test_which_processes_are_slurm_ranks():
    assert under_slurm(task(0))
    assert not under_slurm({**task(0), "SLURM_NTASKS": "1"})           # one task: --workers as usual
    assert not under_slurm({k: v for k, v in task(0).items() if k != "SLURM_STEP_ID"})  # the batch script
    assert not under_slurm({**task(0), "SLURM_STEP_ID": "batch"})
    assert not under_slurm({})


# ------------------------------------------------------------------ launching with srun's environment
def paralab_env(**slurm) -> dict:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MASTER_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**keep, "PYTHONUNBUFFERED": "1", **slurm}


def train(out: Path, env: dict, *extra: str, timeout: float = 180) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paralab", "train", "ddp", *CHECK, *FAST, "--out", str(out),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_bad_node_list_exits_2_before_start(tmp_path):
    env = paralab_env(**task(0, ntasks=2, SLURM_JOB_NODELIST="node[01-"))
    p = train(tmp_path / "run", env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err[-2000:]
    assert "cannot read Slurm's node list 'node[01-': a '[' with no ']'; set MASTER_ADDR" in err
    assert not (tmp_path / "run").exists()
    p = train(tmp_path / "run", paralab_env(**task(0, ntasks=2)), "--workers", "2")
    assert p.wait(timeout=120) == 2 and "each task is one rank: drop --workers" in p.stderr.read()


def test_two_tasks_with_srun_s_environment_train_and_check(tmp_path):
    """What srun gives two tasks on one host, by hand: they meet on the node list's first host."""
    port = free_port()
    procs = [train(tmp_path / "run", paralab_env(**task(r, ntasks=2, SLURM_JOB_NODELIST="localhost",
                                                        SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                                                        SLURM_NNODES="1", MASTER_PORT=str(port))))
             for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["check"]["result"] == "PASS"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["launched_by"] == "slurm"


def test_torchrun_under_srun_is_torchrun_s(tmp_path):
    """Both environments set (srun + torchrun): torchrun's rank and master are the ones used."""
    env = paralab_env(**task(0, ntasks=2, SLURM_JOB_NODELIST="node[01-"),  # unreadable: not read at all
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-m", "paralab", "train", "ddp", "--num-batches", "1", *FAST,
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["launched_by"] == "torchrun"


# ------------------------------------------------------------------ a real cluster of one host
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo")
PACKAGES = ["munge", "slurmctld", "slurmd", "slurm-client"]

SLURM_CONF = """ClusterName=paralab
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def install_slurm() -> str | None:
    """Debian's Slurm and munge, installed if missing; the reason they cannot be, or None."""
    if all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS):
        return None
    if shutil.which("apt-get") is None:
        return "needs Debian's slurmd/slurmctld/munge and apt-get is not here"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], ["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        p = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode == 0 and command[1] == "install":
            return None
    return f"apt-get could not install {' '.join(PACKAGES)}: {(p.stderr or p.stdout).strip()[-300:]}"


def wait_idle(env: dict, within: float = 60) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        p = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env, timeout=30)
        if p.stdout.strip() == "idle":
            return True
        time.sleep(1)
    return False


@pytest.mark.slow
def test_a_real_slurm_cluster_of_one_host_runs_srun_and_srun_torchrun_jobs(tmp_path):
    """munged, slurmctld and slurmd started here (root), on ports of their own, state in tmp_path; a
    2-task sbatch + srun job and a srun + torchrun job each run `train ddp --check`; daemons stopped."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs root on Linux: installs Debian's slurmd/slurmctld/munge and starts the daemons")
    reason = install_slurm()
    if reason:
        pytest.skip(reason)
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count()))
    env = {**paralab_env(), "SLURM_CONF": str(conf)}
    daemons = []
    try:
        daemons.append(subprocess.Popen(["munged", "-F", "--force", f"--socket={d}/munge.sock",
                                         f"--key-file={key}", f"--pid-file={d}/munged.pid",
                                         f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for _ in range(50):
            if (d / "munge.sock").exists():
                break
            time.sleep(0.1)
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        time.sleep(1)
        daemons.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        if not wait_idle(env):
            logs = "\n".join(f"{name}: " + (d / name).read_text()[-600:] for name in ("slurmctld.log", "slurmd.log")
                             if (d / name).exists())
            pytest.skip(f"the one-host Slurm cluster did not come up (sinfo never said idle):\n{logs}")

        common = ["--num-batches", "2", "--check", "--lr", "1e-3", *FAST]
        python = shlex.quote(sys.executable)
        jobs = {
            "srun": f"srun {python} -m paralab train ddp {shlex.join(common)} --out {d}/run-srun",
            "torchrun": (f"srun {python} -m torch.distributed.run --nnodes 1 --nproc-per-node 2 "
                         f"--rdzv-backend c10d --rdzv-endpoint localhost:{free_port()} "
                         f"-m paralab train ddp {shlex.join(common)} --out {d}/run-torchrun"),
        }
        for name, command in jobs.items():
            script = d / f"{name}.sbatch"
            script.write_text(f"#!/bin/bash\nset -e\n{command}\n")
            tasks = ["-n", "2"] if name == "srun" else ["-n", "1", "-c", str(min(2, os.cpu_count() or 1))]
            p = subprocess.run(["sbatch", "--wait", *tasks, "-o", str(d / f"{name}.out"), str(script)],
                               capture_output=True, text=True, env=env, timeout=600, cwd=d)
            output = (d / f"{name}.out").read_text() if (d / f"{name}.out").exists() else ""
            assert p.returncode == 0, f"{name}: {p.stdout}{p.stderr}\n{output[-3000:]}"
            run = d / f"run-{name}"
            summary = json.loads((run / "summary.json").read_text())
            assert summary["workers"] == 2 and summary["check"]["result"] == "PASS", name
            launched = json.loads((run / "config.json").read_text())["launched_by"]
            assert launched == ("slurm" if name == "srun" else "torchrun")
            assert not (run / "oplog").exists()
    finally:
        for p in reversed(daemons):
            p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
