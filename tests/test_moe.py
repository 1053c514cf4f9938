"""A mixture-of-experts gpt and expert parallelism (--experts, --ep): routing, the dispatchers, --check end to end."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paralab.analysis import moe as moe_analysis
from paralab.models import build_model, count_parameters
from paralab.models.moe import MoE, route, scores, take_aux_loss

GPT = ["--model", "gpt", "--layers", "2", "--embed", "32", "--heads", "2", "--context", "16", "--batch-size", "16",
       "--dataset", "synthetic-text", "--experts", "4", "--check"]
FP64 = ["--precision", "fp64", "--lr", "0.1", "--momentum", "0.9", "--num-batches", "20"]
COURSE = ["--lr", "1e-3", "--num-batches", "2", "--precision", "fp32"]  # the course setting


# ---------------------------------------------------------------- the model, in one process
def test_parameters_and_flops_active_vs_total():
    cfg = SimpleNamespace(layers=2, embed=32, context=16, experts=4, top_k=2, expert_hidden=48)
    model = build_model("gpt", layers=2, heads=2, embed=32, context=16, experts=4, top_k=2, expert_hidden=48)
    p = moe_analysis.parameters(cfg)
    assert p["parameters_total"] == count_parameters(model)
    one_expert = 2 * 32 * 48 + 48 + 32
    assert p["parameters_total"] - p["parameters_active"] == 2 * (4 - 2) * one_expert
    assert p["flops_per_token_total"] - p["flops_per_token_active"] == 6 * 2 * (4 - 2) * one_expert


def test_capacity_drops_second_choices_first_and_counts_them():
    # 4 tokens, 2 experts, top-1 -> every token wants expert 0; capacity ceil(0.5 * 4 * 1 / 2) = 1
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]], dtype=torch.float64)
    r = route(probs, 1, 0.5, torch.float64)
    assert r.kept[:, 0].tolist() == [True, False, False, False] and r.stats["dropped"] == 3
    assert r.stats["counts"].tolist() == [1, 0]
    # top-2, capacity ceil(1.0 * 4 * 2 / 2) = 4 per expert: all first choices (expert 0) and all second ones fit
    r2 = route(probs, 2, 1.0, torch.float64)
    assert r2.stats["dropped"] == 0
    # capacity 0.5 -> 2 per expert: the first choices of tokens 0, 1 on expert 0, second choices of 0, 1 on expert 1
    r3 = route(probs, 2, 0.5, torch.float64)
    assert r3.kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert r3.stats["min_margin"] == math.inf  # k == E: no choice left out, nothing to flip


def test_aux_loss_is_one_when_balanced_and_trains_the_router():
    probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    probs[:, 0] += torch.tensor([1e-3, -1e-3, 1e-3, -1e-3], dtype=torch.float64)  # tokens split 2 / 2
    assert float(route(probs, 1, None, torch.float64).aux) == pytest.approx(1.0)
    torch.manual_seed(0)
    layer = MoE(8, 4, 1, 16, None, aux_loss_coef=0.5)
    layer(torch.randn(2, 5, 8)).sum().backward()
    main_grad = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    layer(torch.randn(2, 5, 8))
    aux = take_aux_loss(nn_sequential(layer))
    aux.backward()
    assert aux.item() > 0 and layer.router.weight.grad.abs().sum() > 0 and main_grad.abs().sum() > 0
    assert take_aux_loss(nn_sequential(layer)) is None  # taken once


def nn_sequential(layer):
    return torch.nn.Sequential(layer)


def test_router_gates_are_the_probabilities_and_the_choice_is_top_k():
    torch.manual_seed(1)
    layer = MoE(8, 4, 2, 16, None, 0.01).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    probs = F.softmax(x @ layer.router.weight.t(), -1)
    expected = torch.zeros_like(x)
    for n in range(6):
        for e in probs[n].topk(2).indices.tolist():
            expected[n] += probs[n, e] * layer.experts[e](x[n:n + 1])[0]
    assert torch.allclose(layer(x[None])[0], expected, atol=1e-14)


def test_sigmoid_gating_normalises_the_chosen_scores():
    """--gating sigmoid: the K largest sigmoid scores chosen, their gates summing to 1 over the K; the same
    logits under softmax give other gates (the same experts: both are increasing in the logits)."""
    torch.manual_seed(2)
    logits = torch.randn(7, 5, dtype=torch.float64) * 2
    sig = scores(logits, "sigmoid")
    assert torch.equal(sig, torch.sigmoid(logits)) and not torch.allclose(sig.sum(-1), torch.ones(7, dtype=torch.float64))
    r = route(sig, 2, None, torch.float64, "sigmoid")
    assert torch.allclose(r.gate.sum(-1), torch.ones(7, dtype=torch.float64), atol=1e-15)
    assert r.expert.tolist() == sig.topk(2, dim=-1).indices.tolist()
    chosen = sig.gather(1, r.expert)
    assert torch.allclose(r.gate, chosen / chosen.sum(-1, keepdim=True), atol=1e-15)
    assert r.stats["min_margin"] == pytest.approx(float((sig.topk(3).values[:, 1] - sig.topk(3).values[:, 2]).min()))
    soft = route(scores(logits, "softmax"), 2, None, torch.float64, "softmax")
    assert soft.expert.tolist() == r.expert.tolist()
    assert (soft.gate - r.gate).abs().max() > 0.1  # softmax's gates are the probabilities, < 1 in sum
    # the aux loss: P is each token's scores over all E, normalised, so an even load still gives 1
    even = torch.tensor([[0.9, 0.2], [0.2, 0.9], [0.8, 0.3], [0.3, 0.8]], dtype=torch.float64)
    assert float(route(even, 1, None, torch.float64, "sigmoid").aux) == pytest.approx(1.0)
    share = sig / sig.sum(-1, keepdim=True)
    f = torch.bincount(r.expert.reshape(-1), minlength=5).double() / 14
    assert float(r.aux) == pytest.approx(float(5 * (f * share.mean(0)).sum()), abs=1e-15)
    assert float(r.aux) != pytest.approx(float(soft.aux), abs=1e-6)


def test_sigmoid_layer_output_and_gradients():
    """A sigmoid-gated layer's output is the normalised-gate sum of its top-2 experts; the router gets gradients
    from the output and from the aux loss; with top-1 every gate is 1 (only the aux loss trains the router)."""
    torch.manual_seed(1)
    layer = MoE(8, 4, 2, 16, None, 0.01, gating="sigmoid").double()
    x = torch.randn(6, 8, dtype=torch.float64)
    sig = torch.sigmoid(x @ layer.router.weight.t())
    expected = torch.zeros_like(x)
    for n in range(6):
        top = sig[n].topk(2)
        for s_, e in zip(top.values.tolist(), top.indices.tolist()):
            expected[n] += s_ / top.values.sum() * layer.experts[e](x[n:n + 1])[0]
    out = layer(x[None])[0]
    assert torch.allclose(out, expected, atol=1e-14)
    softmax_layer = MoE(8, 4, 2, 16, None, 0.01).double()
    softmax_layer.load_state_dict(layer.state_dict())
    assert (softmax_layer(x[None])[0] - out).abs().max() > 1e-3
    out.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    one = MoE(8, 4, 1, 16, None, 0.01, gating="sigmoid").double()
    one(x[None]).sum().backward()
    assert one.router.weight.grad is None or one.router.weight.grad.abs().max() < 1e-12
    with pytest.raises(ValueError, match="unknown gating"):
        MoE(8, 4, 1, 16, None, 0.01, gating="relu")


# ---------------------------------------------------------------- the two dispatchers against all experts local
def _dispatch_rank(rank, world, store, results):
    from paralab.comm import Comm
    from paralab.recorder import Recorder
    from paralab.strategies.expert import AllGatherDispatch, AllToAllDispatch
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    comm = Comm(Recorder(rank), rank, world)
    E, local = 4, 2

    def build():
        torch.manual_seed(0)
        return MoE(8, E, 2, 16, 0.75, 0.01).double()

    def tokens(r):
        torch.manual_seed(100 + r)
        return torch.randn(1, 12, 8, dtype=torch.float64), torch.randn(1, 12, 8, dtype=torch.float64)

    # the reference: every rank's tokens through all experts in one process, gradients summed over ranks
    ref = build()
    ref_out = {}
    for r in range(world):
        x, w = tokens(r)
        x.requires_grad_(True)
        out = ref(x)
        (out * w).sum().backward()
        ref_out[r] = (out.detach(), x.grad)
    report = {}
    for name, cls in (("all-to-all", AllToAllDispatch), ("all-gather", AllGatherDispatch)):
        layer = build()
        layer.experts = torch.nn.ModuleList(list(layer.experts)[rank * local:(rank + 1) * local])
        layer.dispatch = cls(comm, E)
        x, w = tokens(rank)
        x.requires_grad_(True)
        out = layer(x)
        (out * w).sum().backward()
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        dev = {"outputs": (out - ref_out[rank][0]).abs().max().item(),
               "input_grads": (x.grad - ref_out[rank][1]).abs().max().item(),
               "router_grad": (router - ref.router.weight.grad).abs().max().item(),
               "expert_grads": max((p.grad - q.grad).abs().max().item() for j in range(local)
                                   for p, q in zip(layer.experts[j].parameters(),
                                                   ref.experts[rank * local + j].parameters()))}
        report[name] = dev
    torch.save(report, f"{results}.{rank}")
    dist.destroy_process_group()


def test_both_dispatchers_equal_all_experts_local(tmp_path):
    from spawn_ranks import spawn
    spawn(_dispatch_rank, (2, tmp_path / "store", str(tmp_path / "r")), 2)
    for rank in range(2):
        report = torch.load(f"{tmp_path / 'r'}.{rank}", weights_only=True)
        for name, dev in report.items():
            assert max(dev.values()) < 1e-13, (rank, name, dev)


# ---------------------------------------------------------------- end to end: --check against one process
def _passed(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.summary["check"]["result"] == "PASS"
    assert r.stdout.count(": PASS  weights: PASS") == r.summary["workers"], r.stdout
    return r.summary


def test_ep2_fp64_top2_capacity_records(paralab):
    s = _passed(paralab("train", "allreduce", "--workers", "2", "--ep", "2", "--top-k", "2",
                        "--capacity-factor", "1.0", *GPT, *FP64, fast=False))
    assert s["check"]["max_weight_dev"] <= 1e-9
    moe = s["moe"]
    assert moe["ep"] == 2 and moe["parameters_total"] == s["parameters"]
    assert moe["load"]["dropped"] > 0  # a capacity factor of 1 drops something over 20 steps
    layer = moe["load"]["layers"][0]
    assert len(layer["tokens_per_expert"]) == 4 and len(layer["aux_per_step"]) == 20
    ops = s["comm_ops"]
    assert ops["all_to_all"]["calls"] > 0 and ops["all_to_all"]["bytes"] > 0


def test_ep2_dispatch_bytes_are_routed_rows(paralab, capsys, tmp_path):
    """The token all-to-all of a layer sends exactly its kept choices' rows (the counts say how many)."""
    r = paralab("train", "ddp", "--workers", "2", "--ep", "2", "--top-k", "1", *GPT, *COURSE, fast=False)
    _passed(r)
    rows = {(row["step"], row["rank"]): row for row in r.rows("steps.jsonl")}
    spans = [sp for sp in r.rows("spans.jsonl") if sp["name"] == "moe_dispatch" and sp["step"] == 1]
    per_rank = {}
    for sp in spans:
        per_rank.setdefault(sp["rank"], []).append(sp["bytes"])
    for rank, sent in per_rank.items():
        kept = [sum(layer["counts"]) for layer in rows[(1, rank)]["moe"]]
        assert sent == [k * 32 * 4 for k in kept], (rank, sent, kept)  # rows x embed x fp32
    # calc moe puts the bytes its measured load predicts beside those recorded: the same on every rank
    from paralab.cli import main
    assert main(["calc", "moe", str(r.out)]) == 0
    table = capsys.readouterr().out.split("predicted (even load)")[1].splitlines()[2:]
    assert len(table) == 2 and all(line.split("]")[1].split()[0:2] == line.split("]")[1].split()[2:4]
                                   for line in table), table
    # plot moe-load (its table): each rank's tokens per expert, summed over steps and layers, as recorded
    assert main(["plot", "moe-load", str(r.out)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    for rank in (0, 1):
        counts = [sum(layer["counts"][e] for row in r.rows("steps.jsonl") if row["rank"] == rank
                      for layer in row["moe"]) for e in range(4)]
        assert [int(c) for c in lines[rank][-5:-1]] == counts, (lines, counts)
    assert main(["plot", "moe-load", str(r.out), "-o", str(r.out / "load.png")]) == 0
    assert (r.out / "load.png").stat().st_size > 0
    # the compare report gives a mixture of experts its own section: the load figure and the same table
    import shutil

    from paralab.report.page import build_compare_report
    report = tmp_path / "report"
    shutil.copytree(r.out, report / "ep2")
    entry = {"strategy": "ddp", "workers": 2, "status": "ok", "error": None, "command": "", "run_dir": "ep2",
             "log": None, "seconds": 1.0}
    build_compare_report(report, [entry], [], "paralab compare", {}, 1.0)
    md = (report / "report.md").read_text()
    assert "Mixture of experts: load" in md and (report / "plots" / "moe_load.png").stat().st_size > 0


def test_ep2_pp2_1f1b_records_each_layer_and_routed_bytes(paralab, capsys):
    """--ep 2 --pp 2 (fp32, the course setting, 1f1b, top-2): --check passes; each MoE layer's load is
    recorded once, by the stage holding it (every token's top-k choices, every step), and the token
    all-to-all of each rank sends its layers' kept rows (fp32: 4 bytes, embed 32)."""
    r = paralab("train", "ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule",
                "1f1b", "--top-k", "2", *GPT, *COURSE, fast=False)
    s = _passed(r)
    layers = s["moe"]["load"]["layers"]
    assert len(layers) == 2 and all(sum(layer["tokens_per_expert"]) == 2 * 16 * 16 * 2 for layer in layers)
    assert all(len(layer["aux_per_step"]) == 2 for layer in layers)
    rows = {(row["step"], row["rank"]): row for row in r.rows("steps.jsonl")}
    assert {rows[(1, rank)]["moe"][0]["layer"] for rank in range(4)} == {0, 1}  # stage 0: block 0, stage 1: 1
    sent: dict = {}
    for sp in r.rows("spans.jsonl"):
        if sp["name"] == "moe_dispatch" and sp["step"] == 1:
            sent.setdefault(sp["rank"], []).append(sp["bytes"])
    for rank in range(4):  # one dispatch per microbatch; the records sum the step's forwards
        assert sum(sent[rank]) == sum(sum(layer["counts"]) for layer in rows[(1, rank)]["moe"]) * 32 * 4, rank
    details = s["strategy_details"]
    assert [details[str(rank)]["data_parallel"]["experts_held"] for rank in range(4)] == [[0, 1], [2, 3]] * 2
    # calc moe: per rank, the bytes of its layers' measured load = recorded = an even load's (dropless top-2)
    from paralab.cli import main
    assert main(["calc", "moe", str(r.out)]) == 0
    table = capsys.readouterr().out.split("predicted (even load)")[1].splitlines()[2:]
    assert len(table) == 4 and all(len({tuple(line.split("]")[1].split()[i:i + 2]) for i in (0, 2, 4)}) == 1
                                   for line in table), table


def test_sigmoid_gating_ep2_fp64_top2_records_the_gating(paralab):
    """--gating sigmoid under ep 2, top-2, fp64 at lr 0.1 for 20 steps: --check passes; the records name it."""
    r = paralab("train", "allreduce", "--workers", "2", "--ep", "2", "--top-k", "2", "--gating", "sigmoid",
                *GPT, *FP64, fast=False)
    s = _passed(r)
    assert s["check"]["max_weight_dev"] <= 1e-9
    assert s["moe"]["gating"] == "sigmoid"
    assert json.loads((r.out / "config.json").read_text())["gating"] == "sigmoid"


def test_sigmoid_gating_fp32_course_setting(paralab):
    r = paralab("train", "ddp", "--workers", "2", "--ep", "2", "--top-k", "2", "--gating", "sigmoid", *GPT, *COURSE,
                fast=False)
    _passed(r)
    assert r.summary["moe"]["gating"] == "sigmoid"


def test_calc_moe_even_load():
    """Parameters active vs total, and the token all-to-all bytes per rank and step under an even load."""
    from paralab.analysis import moe as m
    v = m.step_volume(tokens=2048, top_k=2, experts=8, embed=128, layers=4, ep=4, element=4)
    assert v["choices"] == 4096 and v["per_transfer"] == 4096 * 128 * 4 and v["per_step"] == 16 * 4096 * 128 * 4
    assert v["per_step_remote"] == v["per_step"] * 3 / 4
    capped = m.step_volume(tokens=100, top_k=1, experts=4, embed=8, layers=1, ep=2, element=4, capacity_factor=0.5)
    assert capped["choices"] == 4 * math.ceil(0.5 * 100 / 4)


def test_calc_moe_model_state_per_rank(capsys):
    """calc moe --ep: the parameters a rank holds (the rest whole, its experts 1/ep) and their model state,
    as the planner counts them; every expert on one rank without --ep."""
    from paralab.analysis.plan import gpt_workload
    from paralab.cli import main
    w = gpt_workload(4, 128, 4, 64, 256, experts=8, top_k=1)
    rest, experts = w.held_parameters(0, len(w.units), 1, 4)
    held = int(rest + experts)
    assert main(["calc", "moe", "--experts", "8", "--top-k", "1", "--ep", "4", "--optimizer", "sgd-momentum"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "model state per rank" in x)
    assert f"({held:,} parameters held)" in line and f"{held * 4 * 3 / 1e6:.4g} MB" in line, (line, held)


@pytest.mark.parametrize("args", [
    ["single"],
    ["torch-ddp", "--workers", "2"],
    ["allreduce", "--workers", "2", "--ep", "2", "--top-k", "2"],
    ["gather-scatter", "--workers", "2", "--ep", "2", "--dispatcher", "all-gather", "--capacity-factor", "1.25"],
    ["ddp", "--workers", "4", "--ep", "2", "--top-k", "2"],
    ["allreduce", "--workers", "4", "--ep", "4", "--top-k", "1", "--capacity-factor", "1.0"],
    ["ddp", "--workers", "4", "--tp", "2", "--ep", "2", "--top-k", "2"],
    ["pipeline", "--workers", "2", "--microbatches", "2", "--top-k", "2", "--layers", "4"],
    ["ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule", "gpipe", "--top-k", "1",
     "--partition", "1,3"],  # stage 0 holds no MoE layer
    ["fsdp", "--zero-stage", "1", "--workers", "2", "--ep", "2", "--top-k", "2"],
    pytest.param(["ddp", "--workers", "8", "--ep", "2", "--pp", "2", "--microbatches", "2", "--top-k", "1"],
                 marks=pytest.mark.slow),  # dp 4 = edp 2 x ep 2, x pp 2
], ids=["single", "torch-ddp", "ep2-top2", "ep2-all-gather-capacity", "dp2xep2", "ep4-capacity", "tp2xep2", "pp2",
        "ep2xpp2-gpipe-no-moe-stage", "zero1-ep2", "dp2xep2xpp2"])
def test_fp32_course_setting(paralab, args):
    _passed(paralab("train", *args, *GPT, *COURSE, fast=False))


@pytest.fixture(scope="module")
def slow_runs(request, tmp_path_factory):
    """The 20-step fp64 runs the selected tests need, two at a time: argv -> Result."""
    from conftest import selected, side_by_side
    jobs = [(*p["args"], *GPT, *FP64) for p in selected(request, "test_fp64_lr0_1_20_steps")]
    return side_by_side({argv: argv for argv in jobs}, tmp_path_factory.mktemp("moe"), fast=False)


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["single", "--top-k", "2", "--capacity-factor", "1.0"],
    ["gather-scatter", "--workers", "2", "--top-k", "1"],
    ["ddp", "--workers", "2", "--top-k", "2", "--accumulate", "2"],
    ["torch-ddp", "--workers", "2", "--top-k", "2", "--capacity-factor", "1.25"],
    ["allreduce", "--workers", "2", "--ep", "2", "--top-k", "1"],
    ["ddp", "--workers", "2", "--ep", "2", "--top-k", "2", "--capacity-factor", "1.25", "--accumulate", "2"],
    ["allreduce", "--workers", "2", "--ep", "2", "--top-k", "2", "--dispatcher", "all-gather"],
    ["allreduce", "--workers", "4", "--ep", "4", "--top-k", "1", "--capacity-factor", "1.0"],
    ["ddp", "--workers", "4", "--ep", "2", "--top-k", "2"],                                   # dp 2 x ep 2
    ["gather-scatter", "--workers", "4", "--ep", "2", "--top-k", "1", "--capacity-factor", "1.25"],
    ["tp", "--workers", "2", "--top-k", "2", "--capacity-factor", "1.25"],                 # experts whole per tp rank
    ["ddp", "--workers", "4", "--tp", "2", "--top-k", "1"],                                   # dp 2 x tp 2
    ["ddp", "--workers", "4", "--tp", "2", "--ep", "2", "--top-k", "2", "--capacity-factor", "1.25"],  # tp x ep
    ["allreduce", "--workers", "4", "--tp", "2", "--ep", "2", "--top-k", "1", "--dispatcher", "all-gather"],
    # pipelines: the aux loss rides on each stage's output (stage.py), whole and split (zero-bubble) backward
    ["pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "1f1b", "--layers", "4", "--top-k", "2",
     "--capacity-factor", "1.25"],
    ["pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "zb-h1", "--layers", "4", "--top-k", "1"],
    ["ddp", "--workers", "4", "--pp", "2", "--microbatches", "2", "--layers", "4", "--top-k", "2"],
    ["pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "zb-h2", "--layers", "4", "--top-k", "2"],
    ["pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
     "--layers", "4", "--top-k", "2", "--capacity-factor", "1.25"],
    ["model", "--workers", "2", "--layers", "4", "--top-k", "2"],
    ["ddp", "--workers", "4", "--pp", "2", "--tp", "2", "--microbatches", "2", "--top-k", "2"],
    # --ep with --pp: each stage's experts split over its ep group, its flavour twice (over dp and over edp)
    ["ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--top-k", "1",
     "--layers", "4", "--capacity-factor", "1.25"],
    ["allreduce", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule", "gpipe",
     "--top-k", "2"],
    ["gather-scatter", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b",
     "--top-k", "2", "--dispatcher", "all-gather"],
    ["ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--top-k", "2",
     "--layers", "4"],
    ["allreduce", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "4", "--schedule", "interleaved-1f1b",
     "--virtual-stages", "2", "--layers", "4", "--top-k", "1", "--capacity-factor", "1.25"],
    ["ddp", "--workers", "8", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b", "--top-k", "2"],
    ["ddp", "--workers", "8", "--tp", "2", "--ep", "2", "--pp", "2", "--microbatches", "2", "--top-k", "1"],
    # ZeRO-1 as the flavour: the non-expert optimizer state sharded over dp, the experts' over edp
    ["fsdp", "--zero-stage", "1", "--workers", "4", "--ep", "2", "--top-k", "1", "--capacity-factor", "1.25"],
    ["fsdp", "--zero-stage", "1", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2", "--schedule",
     "1f1b", "--top-k", "2"],
    ["fsdp", "--zero-stage", "1", "--workers", "4", "--ep", "2", "--tp", "2", "--top-k", "2"],
], ids=["single", "gs-dp2", "ddp-dp2-acc", "torch-ddp-dp2", "ep2-top1", "ep2-top2-cap-acc", "ep2-all-gather",
        "ep4-cap", "dp2xep2-top2", "dp2xep2-cap", "tp2", "dp2xtp2", "tp2xep2-cap", "tp2xep2-all-gather",
        "pp2-1f1b-cap", "pp2-zb-h1", "pp2-zb-h2", "pp2-interleaved-cap", "dp2xpp2", "model", "pp2xtp2",
        "ep2xpp2-1f1b-top1-cap", "ep2xpp2-gpipe-top2", "ep2xpp2-all-gather", "ep2xpp2-zb-h1",
        "ep2xpp2-interleaved-cap", "dp2xep2xpp2", "tp2xep2xpp2", "zero1-edp2xep2", "zero1-ep2xpp2",
        "zero1-tp2xep2"])
def test_fp64_lr0_1_20_steps(slow_runs, args):
    s = _passed(slow_runs[(*args, *GPT, *FP64)])
    assert s["check"]["max_weight_dev"] <= 1e-9


@pytest.mark.parametrize("args,message", [
    (["ddp", "--workers", "2", "--experts", "4"], "--model gpt"),                         # MoE on a CNN
    (["single", "--model", "gpt", "--experts", "2", "--top-k", "3"], "--top-k 3 must be at most"),
    (["single", "--model", "gpt", "--experts", "2", "--capacity-factor", "0"], "--capacity-factor"),
    (["single", "--model", "gpt", "--top-k", "2"], "add --experts"),
    (["ddp", "--workers", "2", "--model", "gpt", "--experts", "3", "--ep", "2"], "divisible by --ep 2"),
    (["ddp", "--workers", "2", "--model", "gpt", "--experts", "4", "--ep", "4"], "--ep 4 must divide"),
    (["torch-ddp", "--workers", "2", "--model", "gpt", "--experts", "4", "--ep", "2"], "not one"),
    (["fsdp", "--workers", "2", "--model", "gpt", "--experts", "4", "--ep", "2"], "only --zero-stage 1"),
    (["ddp", "--workers", "4", "--model", "gpt", "--experts", "4", "--tp", "2", "--sequence-parallel"],
     "drop --sequence-parallel"),
    (["ddp", "--workers", "4", "--model", "gpt", "--experts", "4", "--tp", "2", "--ep", "2", "--sequence-parallel"],
     "drop --sequence-parallel"),
    (["torch-pipeline", "--workers", "2", "--model", "gpt", "--experts", "4"], "not yet under"),
    (["fsdp", "--workers", "2", "--model", "gpt", "--experts", "4"], "not yet under"),
    (["single", "--model", "gpt", "--gating", "sigmoid"], "--gating shape a mixture of experts: add --experts E"),
    (["ddp", "--workers", "2", "--gating", "sigmoid"], "--gating: a mixture of experts replaces the gpt's MLPs"),
    (["single", "--model", "gpt", "--experts", "2", "--gating", "relu"], "--gating"),
])
def test_bad_moe_input_exits_2_before_start(paralab, tmp_path, args, message):
    out = tmp_path / "refused"
    r = paralab("train", *args, "--num-batches", "1", out=out, fast=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not out.exists()


def test_ep_resumes_and_exports_the_data_parallel_weights(paralab, tmp_path):
    """An ep 2 run stopped at step 2 and resumed passes --check at step 4 (each rank's experts and both
    optimizers restored); `paralab export` puts its expert slices back together into the weights that
    the same run without --ep reaches (fp64)."""
    from paralab.cli import main
    common = ["allreduce", "--workers", "2", "--top-k", "2", *GPT[:-1], "--precision", "fp64", "--lr", "0.1",
              "--momentum", "0.9"]
    first = paralab("train", *common, "--ep", "2", "--num-batches", "2", fast=False)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = paralab("train", *common, "--ep", "2", "--num-batches", "4", "--resume", str(first.out), "--check",
                      fast=False)
    _passed(resumed)
    plain = paralab("train", *common, "--num-batches", "4", fast=False)
    assert plain.returncode == 0, plain.stderr[-2000:]
    weights = {}
    for name, run in (("ep", resumed.out), ("dp", plain.out)):
        target = tmp_path / f"{name}.pt"
        assert main(["export", str(run), "-o", str(target)]) == 0
        weights[name] = torch.load(target, weights_only=True)
    assert weights["ep"].keys() == weights["dp"].keys()
    assert max((weights["ep"][k] - weights["dp"][k]).abs().max().item() for k in weights["dp"]) < 1e-12


def test_router_skew_sends_expert_0_more_tokens():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 8)
    counts = {}
    for skew in (0.0, 3.0):
        torch.manual_seed(1)
        layer = MoE(8, 4, 1, 16, None, 0.01, router_skew=skew)
        layer(x)
        counts[skew] = layer.history[-1]["counts"]
    assert counts[3.0][0] > counts[0.0][0] and sum(counts[3.0]) == sum(counts[0.0]) == 128


def test_mesh_ep_and_edp_groups():
    from paralab.mesh import MeshShape
    shape = MeshShape.for_world(4, ep=2)
    assert shape.groups("ep") == [[0, 1], [2, 3]] and shape.groups("edp") == [[0, 2], [1, 3]]
    assert shape.groups("dp") == [[0, 1, 2, 3]] and shape.coords(3) == {"pp": 0, "dp": 3, "tp": 0, "ep": 1, "edp": 1}
    assert shape.dims() == ("pp", "dp", "tp", "ep", "edp") and MeshShape.for_world(4).dims() == ("pp", "dp", "tp")
    # under tp the ep neighbours are consecutive dp indices, tp innermost
    wide = MeshShape.for_world(8, tp=2, ep=2)
    assert wide.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]] and wide.group_of(0, "edp") == [0, 4]
    assert wide.to_dict()["shape"] == {"pp": 1, "dp": 4, "tp": 2, "ep": 2, "edp": 2}


@pytest.mark.slow
def test_tp_x_ep_exports_the_data_parallel_weights(paralab, tmp_path):
    """dp 2 = ep 2 with tp 2 on 4 ranks: `paralab export` gathers the tp slices and the ep experts into the
    weights plain data parallelism over the same 2 shards reaches (fp64)."""
    from paralab.cli import main
    common = ["--top-k", "2", *GPT[:-1], "--precision", "fp64", "--lr", "0.1", "--num-batches", "3"]
    runs = {"tpxep": paralab("train", "ddp", "--workers", "4", "--tp", "2", "--ep", "2", *common, fast=False),
            "dp": paralab("train", "allreduce", "--workers", "2", *common, fast=False)}
    weights = {}
    for name, r in runs.items():
        assert r.returncode == 0, r.stderr[-2000:]
        assert main(["export", str(r.out), "-o", str(tmp_path / f"{name}.pt")]) == 0
        weights[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert weights["tpxep"].keys() == weights["dp"].keys()
    assert max((weights["tpxep"][k] - weights["dp"][k]).abs().max().item() for k in weights["dp"]) < 1e-12


def test_compare_leaves_out_strategies_without_moe(capsys, tmp_path):
    from paralab.cli import main
    assert main(["compare", "--model", "gpt", "--dataset", "synthetic-text", "--dry-run", "--out", str(tmp_path / "c"),
                 "--train-args", "--experts 4 --layers 2 --embed 32 --heads 2 --context 16"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "fsdp at 2 workers: does not train a mixture of experts" in text
    assert "paralab train ddp --workers 2" in text and "--experts 4" in text


# ---------------------------------------------------------------- resuming into another --ep (resharded)
RESHARD = [*GPT[:-1], "--top-k", "2", "--precision", "fp64", "--lr", "0.1", "--momentum", "0.9"]


def _resharded(paralab, first, second, steps=(5, 10), check=True):
    """Layout ``first`` for steps[0] steps, then ``second`` resumed from it to steps[1] (with --check: the
    reference replays all the steps from the start, one process, the same split)."""
    a = paralab("train", *first, *RESHARD, "--num-batches", str(steps[0]), fast=False)
    assert a.returncode == 0, a.stderr[-2000:]
    b = paralab("train", *second, *RESHARD, "--num-batches", str(steps[1]), "--resume", str(a.out),
                *(["--check"] if check else []), fast=False)
    assert "resharded" in b.stdout, b.stdout[-2000:] + b.stderr[-2000:]
    return a, b


def test_ep2_then_ep1_is_one_process(paralab):
    """5 steps at ep 2 (each rank 2 of the 4 experts and their momentum), then 5 as plain ddp: --check
    against one process trained 10 steps passes (fp64, momentum 0.9); and the reverse, ddp then ep 2."""
    a, b = _resharded(paralab, ["allreduce", "--workers", "2", "--ep", "2"], ["ddp", "--workers", "2"])
    _passed(b)
    assert "ep 2" in b.stdout
    _, c = _resharded(paralab, ["ddp", "--workers", "2"], ["gather-scatter", "--workers", "2", "--ep", "2"])
    _passed(c)


@pytest.mark.slow
def test_ep_resume_without_the_experts_momentum_fails_the_check(paralab, tmp_path):
    """The control: the same resume with the experts' optimizer state taken out of the ep 2 checkpoint
    fails the check, so the test above does see the experts' slices carried."""
    from conftest import recommit
    a = paralab("train", "allreduce", "--workers", "2", "--ep", "2", *RESHARD, "--num-batches", "5", fast=False)
    assert a.returncode == 0
    for rank in range(2):  # as a writer that left the experts' optimizer state out would have committed it
        recommit(a.out, rank, lambda saved: saved["state"]["experts"]["optimizer"].update(state={}))
    b = paralab("train", "ddp", "--workers", "2", *RESHARD, "--num-batches", "10", "--resume", str(a.out),
                "--check", fast=False)
    assert "resharded" in b.stdout and b.summary["check"]["result"] == "FAIL", b.stdout[-2000:]
    assert b.summary["check"]["max_weight_dev"] > 1e3 * 1e-9


@pytest.mark.slow
def test_ep2_pp2_reshards_to_and_from_other_layouts(paralab):
    """ep 2 x pp 2 (microbatches 2) -> ddp w2 --accumulate 2 (the same split) -> ep 2 x pp 2 (1f1b) -> ep 2
    --accumulate 2: each resumed run passes --check against one process trained from the start."""
    _, b = _resharded(paralab, ["ddp", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2"],
                      ["ddp", "--workers", "2", "--accumulate", "2"])
    _passed(b)
    c = paralab("train", "allreduce", "--workers", "4", "--ep", "2", "--pp", "2", "--microbatches", "2",
                "--schedule", "1f1b", *RESHARD, "--num-batches", "15", "--resume", str(b.out), "--check", fast=False)
    assert "resharded" in c.stdout
    _passed(c)
    d = paralab("train", "allreduce", "--workers", "2", "--ep", "2", "--accumulate", "2", *RESHARD,
                "--num-batches", "20", "--resume", str(c.out), "--check", fast=False)
    assert "resharded" in d.stdout
    _passed(d)


@pytest.mark.slow
def test_zero1_ep_reshards(paralab):
    """ZeRO-1 as the flavour under --ep: its shards (over dp for the non-expert parameters, over edp for
    the experts) put together and cut again: fsdp ZeRO-1 ep 2 (dp 4 = edp 2 x ep 2) -> ddp w4; and fsdp
    ZeRO-1 ep 2 x pp 2 -> allreduce ep 2 --accumulate 2 (the same split): --check passes from step 0."""
    _, b = _resharded(paralab, ["fsdp", "--zero-stage", "1", "--workers", "4", "--ep", "2"], ["ddp", "--workers", "4"])
    _passed(b)
    _, c = _resharded(paralab, ["fsdp", "--zero-stage", "1", "--workers", "4", "--ep", "2", "--pp", "2",
                                "--microbatches", "2"], ["allreduce", "--workers", "2", "--ep", "2", "--accumulate", "2"])
    _passed(c)


@pytest.mark.slow
def test_tp_ep_pp_reshards_to_ddp(paralab):
    """tp 2 x ep 2 x pp 2 on 8 ranks (its tp slices, ep slices and stages) -> ddp w2 --accumulate 2."""
    _, b = _resharded(paralab, ["ddp", "--workers", "8", "--tp", "2", "--ep", "2", "--pp", "2", "--microbatches", "2"],
                      ["ddp", "--workers", "2", "--accumulate", "2"])
    _passed(b)
