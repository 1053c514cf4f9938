"""Where the ranks meet and run: the rendezvous address, the network interface, the cores.

- :func:`under_torchrun`: whether torchrun started this process (its
  environment then names the rank, the world and the master).
- :func:`under_slurm` and :func:`slurm_place`: the same from Slurm's
  environment, for a task ``srun`` started (one rank per task); the master
  is the first host of ``SLURM_JOB_NODELIST`` (:func:`expand_nodelist`).
- :func:`free_port` and :func:`tcp_url`: a local run's rendezvous on
  127.0.0.1 at a free port; a manual run's on ``--master-addr``.
- :func:`bound_store`: the rendezvous store, served by rank 0 on that
  address alone (torch's own store listens on every interface), and
  :func:`loopback_interface`: a local run's gloo on the loopback too, so
  nothing of a local run can be reached from another host.
- :func:`choose_gloo_interface`: across hosts, gloo uses the interface that
  routes to the master unless ``GLOO_SOCKET_IFNAME`` says otherwise.
- :func:`pin`: each local rank on its own cores (``--cores-per-worker C``:
  rank r on cores [rC, rC+C), C threads), else the cores shared out evenly.
"""
from __future__ import annotations

import ipaddress
import itertools
import os
import random
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError
from .config import RunConfig


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


# ---------------------------------------------------------------------------- Slurm
SLURM_PORTS = (15000, 10000)  # a port derived from the job id: 15000 + id mod 10000 (below the ephemeral range)


def under_slurm(env=os.environ) -> bool:
    """A task of a Slurm job step with several tasks (``srun -n N``, N > 1): each task is one rank.

    The batch script itself and ``salloc``'s shell are not (no step id), nor a one-task step, where
    ``--workers`` starts local ranks as usual. torchrun under srun is torchrun's (checked first).
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return ("SLURM_PROCID" in env and step not in (None, "batch", "extern", "4294967294")
            and env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")).strip() not in ("", "0", "1"))


@dataclass(frozen=True)
class SlurmPlace:
    """Where this task sits in the job step, from Slurm's environment."""
    rank: int
    world: int
    local_rank: int
    local_world: int    # tasks on this node
    nodes: int
    master_addr: str
    master_port: int
    cpus_per_task: int = 0  # --cpus-per-task (0: not given)

    def bound(self) -> bool:
        """Slurm bound this task to its own cores (its affinity holds no more than --cpus-per-task)."""
        return bool(self.cpus_per_task) and len(os.sched_getaffinity(0)) <= self.cpus_per_task


def slurm_place(env=os.environ, master_port: int | None = None) -> SlurmPlace:
    """Read the rendezvous from Slurm's environment; UsageError (exit 2) where it cannot be read.

    Master: ``MASTER_ADDR`` if set, else the first host of ``SLURM_JOB_NODELIST``
    (``SLURM_STEP_NODELIST`` if the job's is absent). Port: ``--master-port``,
    else ``MASTER_PORT``, else derived from ``SLURM_JOB_ID`` (every task of the
    job derives the same one).
    """
    def number(name: str, *fallbacks: str) -> int:
        for key in (name, *fallbacks):
            if env.get(key, "").strip():
                try:
                    return int(env[key])
                except ValueError:
                    raise UsageError(f"Slurm's {key}={env[key]!r} is not a number") from None
        raise UsageError(f"under srun but {name} is not set: run `paralab train` as a task of `srun`")

    rank, world = number("SLURM_PROCID"), number("SLURM_NTASKS", "SLURM_NPROCS")
    if not 0 <= rank < world:
        raise UsageError(f"Slurm's SLURM_PROCID={rank} is not in [0, SLURM_NTASKS={world})")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError("under srun but SLURM_JOB_NODELIST is not set: cannot tell rank 0's host; "
                         "set MASTER_ADDR")
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError as exc:
        raise UsageError(f"cannot read Slurm's node list {nodelist!r}: {exc}; set MASTER_ADDR to rank 0's "
                         "host") from None
    addr = env.get("MASTER_ADDR") or hosts[0]
    if master_port is None:
        if env.get("MASTER_PORT"):
            master_port = number("MASTER_PORT")
        else:
            master_port = SLURM_PORTS[0] + number("SLURM_JOB_ID", "SLURM_JOBID") % SLURM_PORTS[1]
    if not 0 < master_port < 65536:
        raise UsageError(f"MASTER_PORT={master_port} is not a TCP port")
    node = int(env.get("SLURM_NODEID", "0") or 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    local_world = per_node[node] if node < len(per_node) else 1
    return SlurmPlace(rank, world, int(env.get("SLURM_LOCALID", "0") or 0), local_world,
                      int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts)), addr,
                      master_port, int(cpus) if (cpus := env.get("SLURM_CPUS_PER_TASK", "")).isdigit() else 0)


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5.

    A name may hold several bracket groups (``r[1-2]n[1-2]``: every combination); a range keeps the
    zero padding of its first number. ValueError says what is wrong.
    """
    hosts, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError("a bracket inside a bracket")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' with no '['")
        elif c == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if not item:
                raise ValueError("an empty host name")
            hosts += _expand_one(item)
    if depth:
        raise ValueError("a '[' with no ']'")
    return hosts


def _expand_one(item: str) -> list[str]:
    parts = re.split(r"(\[[^\]]*\])", item)
    choices = []
    for part in parts:
        if part.startswith("["):
            choices.append(_expand_ranges(part[1:-1]))
        elif re.search(r"[^A-Za-z0-9._-]", part):
            raise ValueError(f"{part!r} is not a host name")
        else:
            choices.append([part])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(body: str) -> list[str]:
    out = []
    for piece in body.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", piece)
        if not m:
            raise ValueError(f"[{body}]: {piece!r} is not a number or a range a-b")
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) < int(first):
            raise ValueError(f"[{body}]: the range {piece} runs backwards")
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> [2, 2, 2, 1] ([] if unreadable)."""
    counts = []
    for piece in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not m:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the rendezvous to bind a few seconds later.

    Picked below the kernel's ephemeral range where possible: outgoing connections
    take their local ports from that range, so one of them could grab a port from
    it in between (a real risk with many runs at once). 29500-29599 (torch's
    default) is avoided too.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    pick = random.SystemRandom()
    candidates = [pick.randrange(max(1024, low - 10000), low) for _ in range(20)] if low > 11024 else []
    for port in candidates + [0]:  # 0: let the kernel choose
        if 29500 <= port < 29600:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def bound_store(init_method: str, rank: int, world: int, timeout: float):
    """The rendezvous store of ``tcp://HOST:PORT``: rank 0 serves it on HOST's address only (a socket it binds
    itself, handed to the store), every other rank connects there. A store can be read and written by any
    client that reaches it, so a local run's (HOST 127.0.0.1) is reachable from this host alone, and a
    multi-host run's only on the interface that carries ``--master-addr``."""
    from datetime import timedelta

    import torch.distributed as dist
    rest = init_method.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    host, port = host.strip("[]"), int(port)
    wait = timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=wait)
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise dist.DistNetworkError(f"rank 0 cannot serve the rendezvous on {host}:{port} ({exc.strerror}): "
                                    "--master-addr must be an address of rank 0's host") from None
    listener.listen(max(128, world))
    return dist.TCPStore(host, port, world, is_master=True, timeout=wait, master_listen_fd=listener.detach())


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 (``lo`` on Linux)."""
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == "127.0.0.1":
                    return name
    except (OSError, ImportError):
        pass
    return "lo"


def tcp_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # IPv6 literal
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def pin(local_rank: int, cfg: RunConfig, local_workers: int) -> None:
    """Give each local rank its own cores (where the OS allows) and a matching thread count."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    if cfg.cores_per_worker:
        c = cfg.cores_per_worker
        mine = allowed[local_rank * c:(local_rank + 1) * c]
        if len(mine) < c:
            print(f"paralab: rank {local_rank}: only {len(allowed)} core(s) allowed here; "
                  f"cannot give {c} to each of {local_workers} worker(s); running unpinned",
                  file=sys.stderr, flush=True)
        elif hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, mine)
            except OSError as exc:
                print(f"paralab: rank {local_rank}: could not pin to cores {mine} ({exc}); running unpinned",
                      file=sys.stderr, flush=True)
        torch.set_num_threads(c)
    elif on_gpu(cfg):
        # the host only feeds the GPU (augmentation, launches): half of a rank's share of the cores, so that
        # the CUDA driver's and NCCL's threads do not preempt one of its pool's threads mid-batch, which
        # stalls the whole pool (docs/gpu.md#host-threads)
        torch.set_num_threads(max(1, len(allowed) // local_workers // 2))
    elif local_workers > 1:
        torch.set_num_threads(max(1, len(allowed) // local_workers))


def on_gpu(cfg: RunConfig) -> bool:
    """Whether the ranks will train on CUDA devices: ``--device cuda``, or ``auto`` with a GPU visible for
    each local rank (``--workers 2`` on a machine with one GPU trains on the CPU; a launch by torchrun, Slurm
    or ``--rank`` is one rank here, on the GPU of its local rank)."""
    if cfg.device != "auto":
        return cfg.device == "cuda"
    if not torch.cuda.is_available():
        return False
    return cfg.world_size is not None or cfg.launched_by != "local" or cfg.workers <= torch.cuda.device_count()


def interface_towards(host: str) -> str | None:
    """The network interface this machine uses to reach ``host`` (IPv4, Linux), or None.

    Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    """
    try:
        import fcntl
        import struct
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        if ipaddress.ip_address(addr).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except (OSError, ImportError, IndexError, ValueError):
        return None
    return None


def choose_gloo_interface(cfg: RunConfig, rank: int) -> None:
    """Multi-host gloo: use the interface that routes to the master, unless the user chose one."""
    if cfg.backend == "nccl" or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = interface_towards(cfg.master_addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        print(f"paralab: rank {rank}: gloo uses interface {name} (the route to {cfg.master_addr}); "
              "set GLOO_SOCKET_IFNAME to choose another", file=sys.stderr, flush=True)
