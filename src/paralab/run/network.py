"""An emulated cluster network on one machine: one shaped link per local rank.

``paralab train ... --workers N --network 1gbit`` puts every local rank in a
Linux network namespace of its own, as if each were a host of a small
cluster on one switch::

    namespace <run>-r0          namespace <run>-sw           namespace <run>-r1
    eth0 10.213.0.1 ──veth── r0 ┐                       ┌ r1 ──veth── eth0 10.213.0.2
         (tbf RATE)   (tbf RATE)└────── bridge br0 ─────┘(tbf RATE)   (tbf RATE)

- **The switch** is a bridge in a namespace of its own (``<run>-sw``).
- **A link** is a veth pair: ``eth0`` inside the rank's namespace, ``r<i>``
  on the bridge, each end's egress shaped by ``tbf`` to RATE (full duplex).
  tbf: ``burst`` max(64 KiB, 1 ms at RATE), ``limit`` max(1 MiB, 50 ms at
  RATE), MTU 1500. Latency (``--network 1gbit,200us``, one-way) is ``netem``,
  half on each link a packet crosses; refused where ``netem`` is missing.
- **The ranks** enter their namespace (``setns``) before torch.distributed
  starts; gloo uses ``eth0`` (``GLOO_SOCKET_IFNAME``), the rendezvous is
  rank 0's address.

Permissions: as root the namespaces are named ones (``ip netns``). Without
root the launcher runs the rest of the run inside a user namespace of its
own (:func:`sandbox_command`), mounts a private tmpfs where ``ip netns``
keeps names (:func:`private_netns_dir`), then builds the same network; where
the kernel refuses unprivileged user namespaces the run is refused.

Cleanup: :meth:`Network.down` deletes the run's namespaces, with their links
and qdiscs; after a SIGKILLed launcher, as root, the next network run
removes the orphans (:func:`remove_orphans`). Names carry the launcher's pid
and a random tag.

Why each setting, and what it leaves out: docs/network.md#why-each-setting
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from dataclasses import asdict, dataclass

from ..errors import UsageError

PREFIX = "paralab-"                 # every namespace of every run starts with this
SUBNET = "10.213.0"                 # rank i has SUBNET.(i+1)/24; private to the run's namespaces
INTERFACE = "eth0"                  # the rank's end of its link (what gloo is told to use)
RENDEZVOUS_PORT = 29400             # rank 0's store: free in a namespace that was just created
MIN_BURST = 64 * 1024               # one veth GSO super-packet
BURST_S = 0.001                     # the bucket holds this much time at RATE
QUEUE_S = 0.050                     # the queue holds this much time at RATE ...
MIN_LIMIT = 1 << 20                 # ... and at least this many bytes
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
NETNS_DIR = "/run/netns"            # where `ip netns` keeps a namespace's name (compiled into iproute2)
SANDBOX_ENV = "PARALAB_NETWORK_USERNS"  # set in the launcher's user namespace (the no-root path)
USERNS = ("unshare", "--user", "--map-root-user")  # a user namespace where this user is root


class NetworkError(Exception):
    """Setting up the emulated network failed (the message says which command and why)."""


@dataclass(frozen=True)
class Spec:
    """What ``--network`` asks for: a link rate and, optionally, a one-way latency."""
    text: str
    rate_bps: float                 # bits per second, each direction of each rank's link
    latency_s: float | None = None  # one-way, rank to rank

    @property
    def gbps(self) -> float:
        return self.rate_bps / 1e9

    @property
    def burst_bytes(self) -> int:
        return int(max(MIN_BURST, self.rate_bps / 8 * BURST_S))

    @property
    def limit_bytes(self) -> int:
        return int(max(MIN_LIMIT, self.rate_bps / 8 * QUEUE_S))


def parse(text: str) -> Spec:
    """``100mbit``, ``1gbit``, ``2.5gbit``, ``1gbit,200us`` -> Spec (UsageError otherwise)."""
    rate_text, _, latency_text = text.strip().lower().partition(",")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)", rate_text.strip())
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--network {text!r}: give a link rate such as 100mbit, 1gbit or 10gbit "
                         "(optionally ,LATENCY such as ,200us where the kernel has netem)")
    rate = float(m.group(1)) * UNITS[m.group(2)]
    if rate < 1e6:
        raise UsageError(f"--network {text!r}: at least 1mbit (a slower link would take minutes per step)")
    latency = None
    if latency_text:
        t = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|ms|us)", latency_text.strip())
        if not t:
            raise UsageError(f"--network {text!r}: the latency after the comma must be like 200us or 1ms")
        latency = float(t.group(1)) * TIME_UNITS[t.group(2)]
    return Spec(text.strip(), rate, latency)


# ---------------------------------------------------------------------------- can we?
def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def privileged() -> bool:
    """Root (or root of the run's own user namespace): namespaces can be made with ``ip netns``."""
    return os.geteuid() == 0


def in_sandbox() -> bool:
    """This process is the no-root launcher inside its user namespace (see :func:`sandbox_command`)."""
    return os.environ.get(SANDBOX_ENV) == "1"


def sandbox_command(argv: list[str]) -> list[str]:
    """``argv`` run inside a new user namespace (this user mapped to root), with its own network and
    mount namespaces: the no-root path. The kernel frees all of it with the last process inside."""
    return [*USERNS, "--net", "--mount", "--", *argv]


def has_netem() -> bool:
    """Whether the kernel offers the netem qdisc (tried on the loopback of a scratch namespace)."""
    probe = ["unshare", "--net"] if privileged() else [*USERNS, "--net"]
    if shutil.which("unshare") is None:
        return False
    return _run(*probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                check=False).returncode == 0


def userns_refusal() -> str | None:
    """Why this user cannot make a user namespace with its own network here (None: it can)."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) was not found"
    proc = _run(*sandbox_command(["true"]), check=False)
    if proc.returncode != 0:
        return f"the kernel refused `{' '.join(sandbox_command(['true']))}`: " \
               f"{(proc.stderr or proc.stdout).strip() or f'exit {proc.returncode}'}"
    return None


def check_can_emulate(spec: Spec) -> None:
    """UsageError (exit 2, before any rank starts) where this machine cannot give these links."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"--network needs the iproute2 tools ({', '.join(missing)} not found): install them "
                         "(Debian/Ubuntu: apt-get install iproute2), or drop --network")
    if not privileged():
        why = userns_refusal()
        if why:
            raise UsageError(f"--network creates a network namespace per rank; this process is not root, so it "
                             f"needs an unprivileged user namespace, and {why}. Run the command as root (e.g. with "
                             "sudo), or let users create namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1, "
                             "user.max_user_namespaces > 0, or the AppArmor setting "
                             "kernel.apparmor_restrict_unprivileged_userns=0), or drop --network")
    if spec.latency_s is not None and not has_netem():
        raise UsageError(f"--network {spec.text}: this kernel has no netem qdisc, so latency cannot be emulated "
                         "(only bandwidth is); drop the latency part (e.g. --network "
                         f"{spec.text.split(',')[0]})")


def private_netns_dir() -> None:
    """No-root path, inside the user namespace: a tmpfs of this mount namespace where ``ip netns`` keeps
    names (on /run/netns where it exists, else on /run, which the unprivileged user cannot write to).
    The mount namespace is private (``unshare --mount``): the host never sees it."""
    target = NETNS_DIR if os.path.isdir(NETNS_DIR) else os.path.dirname(NETNS_DIR)
    _run("mount", "-t", "tmpfs", "-o", "mode=0755", "paralab-netns", target)
    os.makedirs(NETNS_DIR, exist_ok=True)


# ---------------------------------------------------------------------------- the network of one run
@dataclass
class Link:
    """One rank's place on the emulated network (recorded in config.json)."""
    rank: int
    namespace: str
    address: str
    interface: str = INTERFACE


class Network:
    """The namespaces, links and qdiscs of one run: ``up()`` builds them, ``down()`` removes them.

    Use as a context manager; ``down()`` runs however the block ends.
    """

    def __init__(self, spec: Spec, ranks: int):
        self.spec, self.ranks = spec, ranks
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.links = [Link(r, f"{self.tag}-r{r}", f"{SUBNET}.{r + 1}") for r in range(ranks)]
        self.created: list[str] = []  # namespaces made so far (removed by down())

    def __enter__(self) -> "Network":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def namespaces(self) -> list[str]:
        return [self.switch] + [link.namespace for link in self.links]

    def up(self) -> None:
        """Create the switch, then each rank's namespace and its shaped link to the switch."""
        if in_sandbox():
            private_netns_dir()
        else:
            remove_orphans()
        try:
            self._add_namespace(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for link in self.links:
                self._add_namespace(link.namespace)
                port = f"r{link.rank}"
                _run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                     "peer", "name", INTERFACE, "netns", link.namespace)
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
                _run("ip", "-n", link.namespace, "addr", "add", f"{link.address}/24", "dev", INTERFACE)
                _run("ip", "-n", link.namespace, "link", "set", INTERFACE, "up")
                _run("ip", "-n", link.namespace, "link", "set", "lo", "up")
                self._shape(link.namespace, INTERFACE)   # out of the rank
                self._shape(self.switch, port)           # into the rank
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)

    def _shape(self, namespace: str, device: str) -> None:
        """Egress of ``device``: tbf at RATE (and, with a latency, netem's half of it in front)."""
        s = self.spec
        tbf = ["tbf", "rate", f"{int(s.rate_bps)}bit", "burst", str(s.burst_bytes), "limit", str(s.limit_bytes)]
        if s.latency_s is None:
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", *tbf)
        else:  # one-way latency L: each of the two links a packet crosses delays it L/2
            half_us = max(1, round(s.latency_s / 2 * 1e6))
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:",
                 "netem", "delay", f"{half_us}us", "limit", "100000")
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf)

    def down(self) -> None:
        """Delete the run's namespaces (their links and qdiscs go with them); safe to call twice."""
        for name in reversed(self.created):
            _run("ip", "netns", "del", name, check=False)
        self.created = []

    def init_method(self, port: int | None = None) -> str:
        return f"tcp://{self.links[0].address}:{port or RENDEZVOUS_PORT}"

    def record(self) -> dict:
        """What config.json keeps (``network_emulated``): the link and every rank's place on it."""
        s = self.spec
        return {"rate_bps": s.rate_bps, "gbps": s.gbps, "latency_s": s.latency_s, "qdisc": "tbf",
                "burst_bytes": s.burst_bytes, "limit_bytes": s.limit_bytes, "mtu": 1500, "duplex": "full",
                "topology": "one bridge; each rank's veth shaped on both ends",
                "namespaces": "user namespace (no root)" if in_sandbox() else "root (ip netns)",
                "links": [asdict(link) for link in self.links]}


def describe(record: dict | None, asked: str | None = None) -> str:
    """One line for people: what the emulated network of a run was (``asked``: its --network)."""
    if not record:
        if asked:
            return f"--network {asked} asked for, but one rank has no link to emulate"
        return "none (loopback: the ranks shared this machine's own network stack)"
    rate = record["rate_bps"]
    text = f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"
    latency = (f", {record['latency_s'] * 1e6:g} us one-way latency (netem)" if record.get("latency_s")
               else ", no added latency (bandwidth only)")
    where = "; in a user namespace (no root)" if str(record.get("namespaces", "")).startswith("user") else ""
    return (f"{len(record['links'])} ranks, each on its own full-duplex {text} link to one switch (tbf, burst "
            f"{record['burst_bytes']} B, queue {record['limit_bytes']} B, MTU {record['mtu']}){latency}{where}")


# ---------------------------------------------------------------------------- inside a rank
def join(record: dict, rank: int) -> None:
    """Move this process (a rank, before torch.distributed starts) into its namespace; point gloo at eth0."""
    import ctypes
    link = record["links"][rank]
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNET = 0x40000000
    fd = os.open(f"{NETNS_DIR}/{link['namespace']}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {link['namespace']}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = link["interface"]


# ---------------------------------------------------------------------------- leftovers
def namespaces_of(tag: str | None = None) -> list[str]:
    """The network namespaces whose names start with ``tag`` (default: any paralab run's)."""
    proc = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(tag or PREFIX)]


def remove_orphans() -> list[str]:
    """Delete the namespaces of runs whose launcher process no longer exists (one killed by SIGKILL)."""
    removed = []
    for name in namespaces_of():
        m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed
