"""paralab plan with a mixture of experts: the workload against the real model and the saved-tensor probe,
the ep layouts against what paralab composes and refuses, the ep terms against calc moe's counts, a run's
held model states against the prediction, and bad input."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from paralab.analysis import moe as moe_analysis
from paralab.analysis.plan import PRESETS, Layout, Setting, enumerate_layouts, gpt_workload, make_plan, predict
from paralab.analysis.plan.layouts import why_none
from paralab.cli import main
from paralab.errors import UsageError

SHAPES = [dict(experts=4, top_k=2), dict(experts=8, top_k=1, expert_hidden=40), dict(experts=4, top_k=4),
          dict(experts=4, top_k=2, capacity_factor=1.25)]
H100 = PRESETS["h100-sxm"]


def cfg_of(L, h, s, kw):
    return SimpleNamespace(layers=L, embed=h, context=s, experts=kw["experts"], top_k=kw["top_k"],
                           expert_hidden=kw.get("expert_hidden", 0))


@pytest.mark.parametrize("kw", SHAPES)
def test_moe_workload_counts_the_real_model(kw):
    from paralab.models import build_model
    L, h, a, s = 3, 64, 4, 32
    w = gpt_workload(L, h, a, s, 256, **kw)
    model = build_model("gpt", layers=L, embed=h, heads=a, context=s, **kw)
    assert w.parameters == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    router = sum(p.numel() for n, p in model.named_parameters() if ".router." in n)
    assert sum(u.expert_parameters for u in w.units) == experts and sum(u.router_parameters for u in w.units) == router
    calc = moe_analysis.parameters(cfg_of(L, h, s, kw))  # what calc moe and a run's summary say
    assert (w.parameters, w.active_parameters) == (calc["parameters_total"], calc["parameters_active"])
    assert w.active_parameters < w.parameters or kw["top_k"] == kw["experts"]
    # training FLOPs per sample: the active ones, s (6 N_active + 12 L h s), calc moe's count (dropless)
    assert w.model_flops_per_sample() == pytest.approx(s * calc["flops_per_token_active"], rel=1e-12)
    # one rank of tp 2 x ep 2 holds the rest over tp (as the dense gpt) but the router whole, the experts / ep
    rest, held = w.held_parameters(0, len(w.units), 2, 2)
    assert (rest, held) == ((w.parameters - experts - router) / 2 + router, experts / 2)


def test_a_capacity_below_one_runs_fewer_expert_rows():
    full = gpt_workload(2, 64, 4, 32, 256, experts=4, top_k=2)
    half = gpt_workload(2, 64, 4, 32, 256, experts=4, top_k=2, capacity_factor=0.5)
    h, H, s = 64, 256, 32
    per_block = 2 * s * (2 * h * H + H + h)  # one expert row per token less (F K = 1 of K = 2)
    assert full.model_flops_per_sample() - half.model_flops_per_sample() == pytest.approx(3 * 2 * per_block)


@pytest.mark.parametrize("b, s, h, a, kw", [(2, 32, 64, 4, SHAPES[0]), (3, 16, 96, 6, SHAPES[1]),
                                            (2, 32, 64, 4, SHAPES[2]),
                                            (2, 32, 64, 4, dict(experts=4, top_k=2, capacity_factor=0.5))])
def test_moe_activations_are_what_its_blocks_keep(b, s, h, a, kw):
    """``activations="paralab"`` of a MoE gpt against the saved-tensor probe around a real forward (one
    process): exact, since a dropless layer keeps every token's K rows whatever the load, and the capacity
    case is at capacity on every expert (random tokens fill the half-share each expert takes)."""
    import torch

    from paralab.models import build_model
    from paralab.run.held import parameter_storages
    from paralab.training.saved import SavedActivations
    torch.manual_seed(0)
    model = build_model("gpt", layers=2, embed=h, heads=a, context=s, **kw)
    probe = SavedActivations(parameter_storages([model]))
    tokens = torch.randint(0, 256, (b, s))
    with probe.watch():
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), torch.zeros(b * s, dtype=torch.long))
    if kw.get("capacity_factor"):
        cap = -(-b * s * kw["top_k"] // (2 * kw["experts"]))
        assert all(c == cap for block in model[1:-1] for c in block.mlp.history[-1]["counts"])
    work = gpt_workload(2, h, a, s, 256, activations="paralab", **kw)
    predicted = work.activation_bytes(0, len(work.units), b, 1, False, "none", 4)
    indices = (2 * b * s + s) * 8 + 4  # the int64 tokens, positions and targets, the loss's total weight
    assert probe.peak - indices == predicted
    dense = gpt_workload(2, h, a, s, 256, activations="paralab").activation_bytes(0, 4, b, 1, False, "none", 4)
    assert predicted != dense
    del loss


def small():
    return gpt_workload(4, 64, 4, 32, 256, activations="paralab", experts=4, top_k=2)


MODEL = ["--model", "gpt", "--layers", "4", "--embed", "64", "--heads", "4", "--context", "32", "--experts", "4",
         "--top-k", "2", "--dataset", "synthetic-text", "--batch-size", "16", "--num-batches", "1"]


def accepted(command: str) -> bool:
    from paralab.run.config import RunConfig
    try:
        RunConfig.from_argv(command.split()[2:] + MODEL).validate()
        return True
    except UsageError:
        return False


def test_ep_layouts_are_what_paralab_composes():
    w = small()
    lays = enumerate_layouts(w, 8, 16, 8)
    for x in lays:
        assert x.dp % x.ep == 0 and 4 % x.ep == 0 and x.zero in (0, 1) and (x.zero == 0 or x.ep > 1)
        assert (x.cp, x.sp, x.recompute, x.replicate) == (1, False, "none", 1)
        assert x.pp > 1 or x.zero == 0 or x.microbatches == 1  # fsdp takes no --accumulate
    assert {x.ep for x in lays} == {1, 2, 4} and any(x.ep > 1 and x.tp > 1 and x.pp > 1 for x in lays)
    assert any(x.zero == 1 and x.pp > 1 for x in lays) and "--ep 2" in next(x for x in lays if x.ep == 2).command(8)
    # every kind of layout enumerated is one paralab trains
    kinds = {}
    for x in lays:
        kinds.setdefault((x.dp, x.ep, x.tp, x.pp, x.zero, x.schedule, x.microbatches > 1), x)
    for x in kinds.values():
        assert accepted(x.command(8)), x.command(8)
    # and what the planner leaves out, paralab refuses with a mixture of experts
    base = Layout(dp=4, tp=1, pp=2, schedule="1f1b", microbatch=2, microbatches=2, ep=2)
    for left_out in (dataclasses.replace(base, zero=2), dataclasses.replace(base, zero=3),
                     dataclasses.replace(base, zero=1, ep=1), dataclasses.replace(base, zero=1, replicate=2),
                     dataclasses.replace(base, ep=1, dp=2, cp=2), dataclasses.replace(base, recompute="selective"),
                     dataclasses.replace(base, dp=2, tp=2, sp=True)):
        assert left_out not in lays and not accepted(left_out.command(8)), left_out.command(8)
    assert accepted(base.command(8)) and base in lays
    assert {x.ep for x in enumerate_layouts(w, 8, 16, 8, fixed={"ep": 2})} == {2}
    assert enumerate_layouts(w, 8, 16, 8, fixed={"ep": 3}) == []
    assert "--ep 3 must divide the 4 experts" in why_none(w, 8, 16, 8, {"ep": 3})
    dense = gpt_workload(4, 64, 4, 32, 256)
    assert enumerate_layouts(dense, 8, 16, 8, fixed={"ep": 2}) == [] and not any(
        x.ep > 1 for x in enumerate_layouts(dense, 8, 16, 8))


def ring(size, n, gbps, half=False):  # bytes over a ring without latency
    return (n - 1) * (1 if half else 2) / n * size / (gbps * 1e9 / 8)


def test_ep_terms_per_rank():
    """Model states and optimizer state per rank (experts / ep, the optimizer's over edp at ZeRO-1), the
    experts' gradients reduced over edp only, the token all-to-alls as calc moe counts them, expert compute
    not divided by tp or ep, the tp collectives of the attention alone, MFU on active FLOPs."""
    w, s, h, L, E, K = small(), 32, 64, 4, 4, 2
    gbps = 8.0  # 1 GB/s, no latency, no fixed cost per unit
    slow = dataclasses.replace(H100, intra_gbps=gbps, inter_gbps=gbps, intra_latency_us=0, inter_latency_us=0,
                               unit_overhead_us=0)
    setting = Setting(16, "fp32", "sgd-momentum")
    experts = sum(u.expert_parameters for u in w.units)
    rest = w.parameters - experts
    ddp = Layout(dp=4, tp=1, pp=1, microbatch=2, microbatches=2, ep=2)
    got = predict(w, ddp, slow, setting)
    held = rest + experts / 2
    assert got.memory_parts["model_states"] == pytest.approx(12 * held + 4 * held)  # p + g + momentum, buckets
    # the rest's gradients over dp 4, the experts' over edp 2 (without latency, whatever the buckets)
    assert got.dp_total == pytest.approx(ring(4 * rest, 4, gbps) + ring(4 * experts / 2, 2, gbps))
    whole = predict(w, dataclasses.replace(ddp, ep=1), slow, setting)
    assert whole.dp_total == pytest.approx(ring(4 * w.parameters, 4, gbps)) and whole.ep_comm == 0
    # the token all-to-alls: per microbatch and layer the counts (E int64) and the dispatch and combine of
    # every kept choice forward and backward (calc moe's 4 transfers), (ep - 1) / ep of it leaving the rank
    vol = moe_analysis.step_volume(2 * s, K, E, h, L, 2, 4)
    assert got.ep_comm == pytest.approx(2 * (vol["per_step_remote"] + L * 8 * E / 2) / (gbps * 1e9 / 8))
    assert got.compute == pytest.approx(whole.compute)  # an even load: each rank computes its own tokens' rows
    # ZeRO-1 under ep: the rest's optimizer state over dp, the experts' over edp; the rest's flat gradient copy
    z1 = predict(w, dataclasses.replace(ddp, zero=1, microbatch=4, microbatches=1), slow, setting)
    assert z1.memory_parts["model_states"] == pytest.approx(8 * held + 4 * (rest / 4 + experts / 2 / 2) + 4 * rest)
    assert z1.dp_total == z1.dp_comm == pytest.approx(2 * (ring(4 * rest, 4, gbps, True)
                                                           + ring(4 * experts / 2, 2, gbps, True)))
    # a zero-bubble schedule walks back through both token all-to-alls twice
    piped = Layout(dp=2, tp=1, pp=2, schedule="1f1b", microbatch=2, microbatches=4, ep=2)
    one = moe_analysis.step_volume(2 * s, K, E, h, 1, 2, 4)["per_transfer"]
    a, zb = predict(w, piped, slow, setting), predict(w, dataclasses.replace(piped, schedule="zb-h1"), slow, setting)
    assert zb.ep_comm / a.ep_comm == pytest.approx((8 * E + 6 * one) / (8 * E + 4 * one))
    # under tp the MoE layer is whole on every rank: its FLOPs not divided, no collectives of its own
    tp2 = dataclasses.replace(ddp, dp=2, tp=2, ep=1, microbatch=4, microbatches=2)
    tp1 = dataclasses.replace(tp2, tp=1)
    moe_flops = L * 2 * s * (h * E + K * (2 * h * 256 + 256 + h))  # router and K experts per sequence
    rate = slow.rate("fp32")
    assert predict(w, tp2, slow, setting).compute == pytest.approx(
        predict(w, tp1, slow, setting).compute - 2 * 3 * 4 * (w.model_flops_per_sample() / 3 - moe_flops) / 2 / rate)
    dense = gpt_workload(4, 64, 4, 32, 256, activations="paralab")
    assert predict(w, tp2, slow, setting).tp_comm == pytest.approx(
        predict(dense, tp2, slow, setting).tp_comm * (2 * L + 4) / (4 * L + 4))  # 2 more at each end
    assert got.mfu == pytest.approx(16 * s * moe_analysis.parameters(cfg_of(L, h, s, dict(experts=E, top_k=K)))[
        "flops_per_token_active"] / got.step / (4 * slow.peak("fp32")))


@pytest.mark.parametrize("argv, message", [
    (["--experts", "6", "--ep", "4"], "--ep 4 must divide the 6 experts"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 must be at most --experts 2"),
    (["--model", "vgg11", "--experts", "4"], "--model vgg11 has none"),
    (["--model", "vgg11", "--ep", "2"], "--model vgg11 has none"),
    (["--top-k", "2"], "add --experts E"),
    (["--ep", "2"], "add --experts E"),
    (["--experts", "4", "--zero", "2"], "--zero 2: ZeRO-2/3"),
    (["--experts", "4", "--recompute", "full"], "--recompute full"),
    (["--experts", "4", "--cp", "2"], "--cp 2"),
    (["--experts", "4", "--zero", "1", "--ep", "1"], "only under --ep"),
    (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor must be above 0"),
])
def test_bad_input_exits_2(capsys, argv, message):
    code = main(["plan", "--workers", "8", "--cluster", "h100-sxm", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_plan_output_with_experts(capsys, tmp_path):
    argv = ["plan", "--layers", "4", "--embed", "256", "--heads", "8", "--context", "256", "--experts", "8",
            "--top-k", "2", "--workers", "16", "--cluster", "h100-sxm", "--global-batch", "64", "--top", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MoE E=8 top-2" in out and "active per token" in out and "ep comm" in out
    assert main(argv + ["--json", "--ep", "4", "--report", str(tmp_path / "page")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["experts"] == 8 and all(r["layout"]["ep"] == 4 and r["ep_comm"] > 0 for r in plan["ranked"])
    assert "--ep 4" in plan["command"] and "ep comm" in (tmp_path / "page" / "report.md").read_text()


def test_every_row_of_a_plan_fits_and_ranks():
    w = gpt_workload(8, 512, 8, 512, 32000, experts=8, top_k=2)
    plan = make_plan(w, H100, Setting(64), 16, top=10)
    steps = [x.step for x in plan.ranked]
    assert steps == sorted(steps) and all(x.fits for x in plan.ranked) and any(x.layout.ep > 1 for x in plan.ranked)


@pytest.mark.parametrize("strategy, extra", [(["ddp"], []), (["fsdp", "--zero-stage", "1"], []),
                                             (["ddp"], ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"])])
def test_held_model_states_of_an_ep_run_are_predicted(tmp_path, strategy, extra):
    """An fp32 ``--experts 4 --top-k 2 --ep 2`` run (ddp; ZeRO-1; ddp with ep 2 x pp 2): each rank's measured
    model states equal the planner's prediction for its layout and stage (ZeRO-1's flat copy of the rest's
    gradients while they are reduced included: the flavour's ledger reports it); without a pipeline
    its saved activations too, once the even load is replaced by the rows each rank's experts received."""
    from conftest import run_paralab
    workers = "4" if extra else "2"
    h, H, s, b = 32, 128, 16, 4
    res = run_paralab("train", *strategy, "--workers", workers, "--ep", "2", "--model", "gpt", "--layers", "2", "--embed",
                      str(h), "--heads", "4", "--context", str(s), "--experts", "4", "--top-k", "2", "--batch-size",
                      "8", "--num-batches", "1", "--dataset", "synthetic-text", *extra, out=tmp_path / "r")
    assert res.returncode == 0, res.stderr
    from paralab.analysis.runs import load_run
    details = load_run(tmp_path / "r").details  # the prediction beside what each rank measured
    steps = [json.loads(line) for line in (tmp_path / "r" / "steps.jsonl").read_text().splitlines()]
    for rank in map(str, range(int(workers))):
        held = details[rank]["held"]
        pred = held["predicted"]
        assert pred["layout"].startswith("dp2 ep2"), pred
        if strategy[0] == "fsdp":
            assert pred["layout"].endswith("zero1")
        assert held["model_states_total_bytes"] == pred["model_states_bytes"]
        if extra:
            continue
        received = sum(sum(layer["received"]) for r in steps if r["step"] == 0 and r["rank"] == int(rank)
                       for layer in r["moe"])
        even = 2 * b * s * 2  # 2 layers x the rank's tokens x top-2
        per_row = 8 * 2 + 4 * (h + 2 * H)  # its order and inverse, the row, the expert's GELU input and output
        indices = (2 * b * s + s) * 8 + 4
        assert held["saved_activations_peak_bytes"] == pred["activations_bytes"] + (received - even) * per_row + indices
