"""The cp attention cores alone, against one process's causal attention, in float64.

Spawned gloo ranks (2 and 4) each hold their tokens of the same random q, k, v
(balanced and contiguous layouts), run ring attention or Ulysses forward and
backward, and compare their output and their slices of dq, dk, dv with
``scaled_dot_product_attention`` over the whole sequence. A mutation (the ring
backward without its last dK/dV hop, so each rank keeps its neighbour's
gradient) must be caught.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn_ranks import spawn

from paralab.comm import Comm
from paralab.recorder import Recorder
from paralab.strategies.context import ring
from paralab.strategies.context.layout import Layout
from paralab.strategies.context.ring import ring_attention
from paralab.strategies.context.ulysses import ulysses_attention

B, H, T, D = 2, 4, 16, 8


def _case(comm, method, balanced):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True)
    expected.backward(dout)
    layout = Layout(T, comm.world, balanced)
    mine = [layout.take(t, comm.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    core = ring_attention if method == "ring" else ulysses_attention
    out = core(*mine, comm=comm, layout=layout, recorder=comm.recorder)
    out.backward(layout.take(dout, comm.rank, dim=2))
    worst = {"out": (out - layout.take(expected, comm.rank, dim=2)).abs().max().item()}
    for name, m, w in zip("qkv", mine, whole):
        worst["d" + name] = (m.grad - layout.take(w.grad, comm.rank, dim=2)).abs().max().item()
    return worst


def _rank(rank, world, out_dir, mutate):
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world)
    comm = Comm(Recorder(rank, torch.device("cpu")), rank, world)
    if mutate:  # the last hop of the dK/dV buffer left out: each rank keeps the buffer it holds
        real = ring._rotate
        calls = {"n": 0}

        def rotate(c, t, name):
            if name == "cp_ring_dkv_backward":
                calls["n"] += 1
                if calls["n"] % c.world == 0:  # the C-th hop of a backward
                    return t.clone(), []
            return real(c, t, name)
        ring._rotate = rotate
    results = {f"{m}-{'balanced' if b else 'contiguous'}": _case(comm, m, b)
               for m in (("ring",) if mutate else ("ring", "all-to-all")) for b in (True, False)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _spawn(tmp_path, world, mutate=False):
    spawn(_rank, (world, tmp_path, mutate), world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_one_process(tmp_path, world):
    for rank, results in enumerate(_spawn(tmp_path, world)):
        assert len(results) == 4
        for case, worst in results.items():
            assert max(worst.values()) < 1e-12, (rank, case, worst)


def test_ring_backward_without_its_last_hop_is_caught(tmp_path):
    results = _spawn(tmp_path, 2, mutate=True)
    assert max(w["dk"] for r in results for w in r.values()) > 1e-3
