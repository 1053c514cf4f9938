"""Where the ranks meet and run: the rendezvous address, the network interface, the cores.

- :func:`under_torchrun`: whether torchrun started this process (its
  environment then names the rank, the world and the master).
- :func:`free_port` and :func:`tcp_url`: a local run's rendezvous on
  127.0.0.1 at a free port; a manual run's on ``--master-addr``.
- :func:`choose_gloo_interface`: across hosts, gloo uses the interface that
  routes to the master unless ``GLOO_SOCKET_IFNAME`` says otherwise.
- :func:`pin`: each local rank on its own cores (``--cores-per-worker C``:
  rank r on cores [rC, rC+C), C threads), else the cores shared out evenly.
"""
from __future__ import annotations

import ipaddress
import os
import random
import socket
import sys
from pathlib import Path

import torch

from .config import RunConfig


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


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
    elif local_workers > 1:
        torch.set_num_threads(max(1, len(allowed) // local_workers))


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
