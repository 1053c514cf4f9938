"""Tensor parallelism from primitives: every sharded layout equals one process, in float64.

One group of spawned gloo ranks per world size runs every case: the gpt with
tp (and sequence parallelism), the VGGs' channel split; each rank compares
the loss, the gradients (its slices gathered back) and the weights with the
plain model on the same batch. A mutation (sequence parallelism without the
LayerNorm gradient sum: the classic bug) must be caught.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import spawn

from paralab.comm import Comm
from paralab.training.losses import cross_entropy
from paralab.models import build_model
from paralab.recorder import Recorder
from paralab.strategies.tensor import TensorParallelism
from paralab.strategies.tensor import group as tp_group

GPT = dict(layers=2, heads=4, embed=32, context=8)
CASES = [("gpt", False), ("gpt", True), ("vgg11", False), ("vgg16-cs1390", False)]


def _build(name):
    torch.manual_seed(0)
    kw = GPT if name == "gpt" else dict(width=0.125)
    return build_model(name, **kw).double()


def _batch(name):
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        return torch.randint(0, 256, (3, 8), generator=g), torch.randint(0, 256, (3, 8), generator=g)
    return torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def _compare(name, sp, comm):
    ref, full = _build(name), _build(name)
    tp = TensorParallelism(comm, sp, _build(name))
    model = torch.nn.Sequential(*tp.shard(dict(enumerate(full))).values())
    x, y = _batch(name)
    loss = tp.loss(model(x), y)
    loss.backward()
    expected = cross_entropy(ref(x), y)
    expected.backward()
    grads = tp.unshard({k: p.grad for k, p in model.named_parameters()})
    weights = tp.unshard(dict(model.state_dict()))
    held = sum(p.numel() for p in model.parameters())
    return {"loss": abs(loss.item() - expected.item()),
            "grad": max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()),
            "weights": max((weights[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items()),
            "held_fraction": held / sum(p.numel() for p in ref.parameters()),
            "split_tensors": len(tp.layout)}


def _rank(rank, world, out_dir, mutate):
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world)
    comm = Comm(Recorder(rank, torch.device("cpu")), rank, world)
    if mutate:  # the classic bug: replicated parameters used on sequence shards, gradients never summed
        tp_group.TPGroup.replicated = lambda self, p: p
    results = {f"{name}{'-sp' if sp else ''}": _compare(name, sp, comm) for name, sp in CASES
               if not (mutate and not sp)}
    kinds = {}
    for s in comm.recorder.spans:
        kinds[s.name] = kinds.get(s.name, 0) + 1
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"results": results, "spans": kinds}))
    dist.destroy_process_group()


def _spawn(tmp_path, world, mutate=False):
    spawn(_rank, (world, tmp_path, mutate), world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    return request.param, _spawn(tmp_path_factory.mktemp(f"tp{request.param}"), request.param)


@pytest.mark.parametrize("case", ["gpt", "gpt-sp", "vgg11", "vgg16-cs1390"])
def test_sharded_model_equals_one_process(ranks, case):
    world, results = ranks
    for r in results:
        got = r["results"][case]
        assert got["loss"] < 1e-12 and got["grad"] < 1e-12 and got["weights"] < 1e-12, got


def test_each_rank_holds_a_slice(ranks):
    world, results = ranks
    for r in results:
        gpt = r["results"]["gpt"]
        # everything but LayerNorms, position embeddings and the row-parallel biases is split
        assert 1 / world < gpt["held_fraction"] < 1 / world + 0.1, gpt
        assert r["results"]["vgg11"]["held_fraction"] < 0.6


def test_every_tp_collective_is_a_recorded_span(ranks):
    _, results = ranks
    spans = results[0]["spans"]
    for name in ("tp_f_backward", "tp_g_forward", "vocab_lse_all_gather", "vocab_target_all_reduce",
                 "sp_all_gather", "sp_reduce_scatter", "sp_all_gather_backward", "sp_reduce_scatter_backward",
                 "tp_gather_weights"):
        assert spans.get(name, 0) > 0, (name, spans)


def test_sequence_parallel_without_the_layernorm_sum_is_caught(tmp_path):
    results = _spawn(tmp_path, 2, mutate=True)
    assert results[0]["results"]["gpt-sp"]["grad"] > 1e-6
