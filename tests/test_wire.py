"""Nothing a peer sends is unpickled, and a local run listens on the loopback alone (issue 36).

- ``wire.py`` carries what ranks exchange besides tensors (records, verdicts, a
  partition, states to compare) as JSON and raw tensor bytes: every kind it
  sends comes back equal, and a pickle (or anything else) is refused without
  running a line of it;
- ``Comm``'s structure collectives use it: a rank that receives a crafted
  pickle where a message belongs refuses it, and its payload never runs;
- a plain local ``--workers 2`` run: every socket its processes listen on is
  bound to 127.0.0.1 (the rendezvous store, which torch would bind to every
  interface, and gloo's pairs), read from ``/proc/net/tcp``.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paralab import wire
from spawn_ranks import spawn


class Payload:
    """Unpickling this creates ``marker``: what a crafted message would do instead of carrying data."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_every_kind_a_rank_sends_comes_back_equal():
    obj = {"rank": 1, "lines": ["a", "b"], 3: (1, 2.5, None), (0, "k"): {"nested": [True, False]},
           "nan": float("nan"), "inf": float("-inf"), "empty": torch.empty(0, 4),
           "tensors": [torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor(1.5, dtype=torch.bfloat16),
                       torch.randn(3, dtype=torch.float64), torch.tensor([True, False])]}
    back = wire.decode(wire.encode(obj))
    assert back["rank"] == 1 and back["lines"] == ["a", "b"] and back[3] == (1, 2.5, None)
    assert back[(0, "k")] == {"nested": [True, False]} and back["inf"] == float("-inf") and back["nan"] != back["nan"]
    assert back["empty"].shape == (0, 4)
    for a, b in zip(obj["tensors"], back["tensors"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_what_cannot_be_sent_is_refused_when_sent():
    for thing in (object(), {1, 2}, b"bytes", Payload("x")):
        with pytest.raises(TypeError):
            wire.encode({"x": thing})


def test_a_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    crafted = [pickle.dumps(Payload(marker)), pickle.dumps({"a": Payload(marker)}),
               (40).to_bytes(8, "little") + pickle.dumps(Payload(marker))[:40]]
    for message in crafted:
        with pytest.raises(ValueError):
            wire.decode(message)
    assert not marker.exists()


@pytest.mark.parametrize("doc,payload", [
    ({"t": ["float32", [4], 0, 16]}, b"\0" * 8),          # fewer bytes than the tensor needs
    ({"t": ["object", [1], 0, 8]}, b"\0" * 8),            # no such dtype
    ({"t": ["float32", [2], 0, 12]}, b"\0" * 12),         # bytes that do not match the shape
    ({"x": 1}, b""),                                      # an unknown kind
    ({"d": [[["a"], 1]]}, b""),                           # a list as a dict key
])
def test_a_malformed_message_is_refused(doc, payload):
    text = json.dumps(doc).encode()
    with pytest.raises(ValueError):
        wire.decode(len(text).to_bytes(8, "little") + text + payload)


def _gather_a_crafted_pickle(rank, world, root):
    from paralab.comm import Comm
    from paralab.recorder import Recorder
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=world)
    try:
        comm = Comm(Recorder(rank), rank, world)
        if rank == 1:  # what gather_objects sends (a size, then the bytes), but a pickle instead of a message
            crafted = torch.frombuffer(bytearray(pickle.dumps(Payload(root / "ran"))), dtype=torch.uint8)
            dist.send(torch.tensor([crafted.numel()]), 0)
            dist.send(crafted, 0)
            return
        try:
            comm.gather_objects({"mine": 0})
            outcome = "accepted"
        except ValueError as exc:
            outcome = f"refused: {exc}"
        (root / "rank0.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_a_rank_refuses_a_crafted_pickle_in_a_gather(tmp_path):
    spawn(_gather_a_crafted_pickle, (2, tmp_path), 2)
    assert (tmp_path / "rank0.txt").read_text().startswith("refused: wire:")
    assert not (tmp_path / "ran").exists()


def _listening(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                found.append(parts[1])
    return found


def test_a_local_run_listens_on_the_loopback_alone(tmp_path):
    from conftest import session_processes
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "paralab", "train", "ddp", "--workers", "2", "--dataset",
                          "synthetic", "--synthetic-size", "256", "--width", "0.125", "--batch-size", "16",
                          "--num-batches", "100000", "--no-progress", "--out", str(out)],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PARALAB_SERVE": "off"})
    try:
        deadline, addresses = time.monotonic() + 120, []
        while time.monotonic() < deadline:  # until both ranks have formed the group (rank 1's op log exists)
            if (out / "oplog").is_dir() and len(list((out / "oplog").iterdir())) >= 2:
                time.sleep(2)
                addresses = _listening(session_processes(p.pid))
                break
            time.sleep(0.5)
        assert addresses, "the run formed no group, or listens on nothing"
        loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
        assert all(a.split(":")[0] in loopback for a in addresses), addresses
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
