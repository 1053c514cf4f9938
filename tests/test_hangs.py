"""Naming the rank that hangs: each rank's op log (oplog.py) and the diagnosis (run/hangs.py).

The diagnosis is tested on logs written by the real writer with made-up operations; then real runs where a
rank stalls in compute, skips a collective or calls one with another shape (a strategy file of the tests',
tests/data/hanging_allreduce.py) must be named by the launcher within the timeout, with no process left behind.
"""
from __future__ import annotations

import time
from pathlib import Path
import uuid

import pytest
import torch

from conftest import run_paralab
from paralab import oplog
from paralab.oplog import DONE, FAILED, IN_FLIGHT, WAITING
from paralab.run.hangs import diagnose, explain_hang, log_path, members, read_log, read_logs
from test_launch import gone

T = torch.zeros(16, 3)


class Rank:
    """A rank writing its op log in a run directory, as comm.py does."""

    def __init__(self, run_dir, rank: int, world: int = 2, capacity: int = oplog.CAPACITY):
        self.log = oplog.OpLog(log_path(run_dir, rank), rank, world, capacity)
        self.me = rank

    def collective(self, op="all_reduce", tensor=T, group="world", key="0-1", state=DONE):
        slot = self.log.enter(op, group, key, tensor.numel() * tensor.element_size(), tensor)
        self.log.set_state(slot, state)

    def send(self, dst, state=DONE):
        self.log.set_state(self.log.enter("send", "pp 0", f"{self.me}>{dst}", 192, T, dst), state)

    def recv(self, src, state=DONE):
        self.log.set_state(self.log.enter("recv", "pp 0", f"{src}>{self.me}", 192, T, src, IN_FLIGHT), state)


# ------------------------------------------------------------------ the diagnosis, on synthetic logs
def test_a_rank_stalled_in_compute_is_named_with_its_last_op(tmp_path):
    r0, r1 = Rank(tmp_path, 0), Rank(tmp_path, 1)
    for r in (r0, r1):
        for _ in range(3):
            r.collective()
    r1.send(0)
    r0.recv(1)
    r0.collective(tensor=torch.zeros(3_000_000), state=oplog.ENTERED)  # rank 0 blocks; rank 1 computes
    lines = diagnose(read_logs(tmp_path), now=time.time() + 12)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rank 0 is waiting in all_reduce #4 on group world (12 MB, (3000000,), float32); "
                               "rank 1 never reached it: its last op was send #3 to rank 0 (192 B, (16, 3), float32)"), lines
    assert "and it has been computing since" in lines[0]
    assert float(lines[0].split("done ")[1].split(" s ago")[0]) >= 12


def test_a_dead_rank_is_not_said_to_be_computing(tmp_path):
    r0, r1 = Rank(tmp_path, 0), Rank(tmp_path, 1)
    r1.collective()
    r0.collective()
    r0.collective(state=FAILED)
    [line] = diagnose(read_logs(tmp_path), ended={1: "killed by signal SIGKILL"})
    assert line.startswith("rank 0 was waiting in all_reduce #1 on group world")
    assert "rank 1 never reached it: its last op was all_reduce #0 on group world" in line
    assert line.endswith("then it ended: killed by signal SIGKILL") and "computing" not in line


def test_a_shape_mismatch_is_the_first_disagreement(tmp_path):
    r0, r1 = Rank(tmp_path, 0), Rank(tmp_path, 1)
    r0.collective(tensor=torch.zeros(12), state=WAITING)
    r1.collective(tensor=torch.zeros(10, dtype=torch.float64), state=WAITING)
    lines = diagnose(read_logs(tmp_path))
    assert lines == ["they disagree: rank 0 called all_reduce #0 on group world (48 B, (12,), float32); "
                     "rank 1 called all_reduce #0 on group world (80 B, (10,), float64) (the same place in "
                     "the group's sequence)"]


def test_a_recv_whose_sender_waits_elsewhere_and_a_rank_without_a_log(tmp_path):
    """Three ranks: rank 2 waits for rank 1's send, rank 1 waits in an all-reduce of group {0, 1} that
    rank 0 never reached; rank 3 of a four-rank group left no log."""
    r0, r1, r2 = (Rank(tmp_path, r, world=4) for r in range(3))
    r2.recv(1, state=WAITING)
    r0.collective(group="dp 0", key="0,1")
    r1.collective(group="dp 0", key="0,1")
    r1.collective(group="dp 0", key="0,1", state=oplog.ENTERED)
    r0.collective(group="world", key="0-3", state=oplog.ENTERED)
    lines = diagnose(read_logs(tmp_path))
    assert lines[0].startswith("rank 0 is waiting in all_reduce #1 on group world") and \
           "rank 2 never reached it: it is waiting in recv #0 from rank 1" in lines[0] and \
           lines[0].endswith("rank 3 left no op log"), lines
    assert lines[1].startswith("rank 1 is waiting in all_reduce #1 on group dp 0") and \
           "rank 0 never reached it: it is waiting in all_reduce #1 on group world" in lines[1], lines
    assert lines[2] == ("rank 2 is waiting in recv #0 from rank 1 (192 B, (16, 3), float32); rank 1 never sent "
                        "it: it is waiting in all_reduce #1 on group dp 0 (192 B, (16, 3), float32)"), lines


def test_nothing_to_say_when_every_rank_finished_its_ops(tmp_path):
    for r in (Rank(tmp_path, 0), Rank(tmp_path, 1)):
        r.collective()
        r.collective(op="broadcast")
    assert diagnose(read_logs(tmp_path)) == [] and explain_hang(tmp_path) == []
    (tmp_path / "oplog" / "rank7.bin").write_bytes(b"not a log")
    assert sorted(read_logs(tmp_path)) == [0, 1]


def test_the_ring_keeps_the_last_ops_in_order(tmp_path):
    r = Rank(tmp_path, 0, capacity=8)
    for _ in range(21):
        r.collective()
    log = read_log(log_path(tmp_path, 0))
    assert log.count == 21 and [o.seq for o in log.ops] == list(range(13, 21))
    assert [o.number for o in log.ops] == list(range(14, 22))  # the group's count starts at 1


def test_group_keys_round_trip():
    for ranks in ([0, 1, 2, 3], [1, 3, 5], [4], [2, 3]):
        assert members(oplog.members_key(ranks)) == ranks


# ------------------------------------------------------------------ real runs: a rank that hangs
#: allreduce, with one rank misbehaving at step 1 as the test's HANG says (the suite's hook lives in the tests)
HANGING = str(Path(__file__).parent / "data" / "hanging_allreduce.py")
RUN = ["train", HANGING, "--workers", "2", "--num-batches", "3", "--timeout", "5"]


def hang(tmp_path, kind: str, run=RUN, rank: int = 1):
    t0 = time.monotonic()
    r = run_paralab(*run, out=tmp_path / "run", timeout=120, env={"HANG": f"{rank}:{kind}"})
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-3000:]
    assert not r.left_running(within=5), "a rank outlived the launcher"
    assert not (r.out / "summary.json").exists()
    said = r.stderr.split("where the ranks disagree", 1)
    assert len(said) == 2, r.stderr[-3000:]
    return said[1], took


def test_a_rank_stalled_in_compute_is_named_within_the_timeout(tmp_path):
    said, took = hang(tmp_path, "stall")
    # both ranks made the same ops up to here; rank 0 waits in the first all-reduce of step 1
    assert "rank 0 was waiting in all_reduce #" in said and "rank 1 never reached it: its last op was " in said
    assert "and it has been computing since" in said, said
    assert took < 60, f"{took:.0f} s"  # startup + the 5 s timeout + the launcher's grace, not the 3600 s stall


@pytest.mark.slow
def test_a_rank_stalled_in_a_mesh_group_is_named_within_the_timeout(tmp_path):
    """dp 2 x pp 2: rank 2 stalls before its stage's data-parallel all-reduce. Rank 3 times out in it (the
    mesh's groups wait --timeout, not new_group's default 30 minutes), stage 0's ranks in their receives."""
    said, took = hang(tmp_path, "stall", RUN[:3] + ["4", "--pp", "2", "--microbatches", "2"] + RUN[4:], rank=2)
    assert "rank 3 was waiting in all_reduce #" in said and " on group dp 1 " in said, said
    assert "rank 2 never reached it: its last op was send #" in said, said
    assert "rank 0 was waiting in recv #" in said and "rank 2 never sent it" in said, said
    assert took < 90, f"{took:.0f} s"


def shapes(first: str) -> tuple[tuple, tuple]:
    """Rank 0's and rank 1's shapes in the line that says where they disagree."""
    import ast
    r0 = first.split("rank 0 called all_reduce #")[1].split(", ", 1)[1].split("), ")[0] + ")"
    r1 = first.split("rank 1 called all_reduce #")[1].split(", ", 1)[1].split("), ")[0] + ")"
    return ast.literal_eval(r0), ast.literal_eval(r1)


@pytest.mark.slow
def test_a_skipped_collective_is_named(tmp_path):
    said, _ = hang(tmp_path, "skip")
    first = said.splitlines()[1]
    assert first.startswith("paralab:   they disagree: rank 0 called all_reduce #"), said
    number = first.split("rank 0 called all_reduce #")[1].split()[0]
    assert f"rank 1 called all_reduce #{number} " in first, said
    # rank 1 skipped the first weight's all-reduce, so its next op (that layer's bias) met rank 0's
    weight, bias = shapes(first)
    assert len(weight) == 4 and bias == (weight[0],), said


@pytest.mark.slow
def test_a_collective_called_with_another_shape_is_named(tmp_path):
    said, _ = hang(tmp_path, "shape")
    first = said.splitlines()[1]
    assert first.startswith("paralab:   they disagree: rank 0 called all_reduce #"), said
    mine, other = shapes(first)
    assert other == (torch.Size(mine).numel() + 1,), said


def test_a_run_that_ends_in_order_leaves_no_op_log(tmp_path):
    r = run_paralab("train", "allreduce", "--workers", "2", "--num-batches", "1", out=tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (r.out / "summary.json").exists() and not (r.out / "oplog").exists()


@pytest.mark.slow
def test_a_manual_rank_that_times_out_names_the_stalled_one(tmp_path):
    """--world-size/--rank with one --out: rank 0 times out and reads rank 1's log from the run directory.
    Nobody supervises manual ranks, so the stalled rank 1 is stopped here once rank 0 has spoken."""
    import subprocess
    from test_launch import rank_cmd
    from paralab.run.rendezvous import free_port
    port, marker = free_port(), uuid.uuid4().hex
    env = {**__import__("os").environ, "PYTHONUNBUFFERED": "1", "HANG": "1:stall",
           "PARALAB_TEST_MARK": marker}
    cmds = [[c if c != "ddp" else HANGING for c in rank_cmd(r, port, tmp_path / "run", "--timeout", "5")]
            for r in range(2)]
    procs = [subprocess.Popen(cmds[r], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        _, err0 = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err0[-3000:]
    said = err0.split("where the ranks disagree", 1)[-1]
    assert "rank 0 was waiting in all_reduce #" in said, err0[-3000:]
    assert "rank 1 never reached it: its last op was " in said and "computing since" in said, err0[-3000:]
    assert gone(marker, within=5)
