"""zb-h1, zb-h2 and interleaved-1f1b end to end: --check against one process, records, refusals, dp x pp.

The default suite keeps a handful (p = 2, m = 4, both norms, both schedules, one dp 2 x pp 2);
the matrix the issue asks for (p = 2, 3, 4; m = 4 and 8; BatchNorm and none) is marked slow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.models import build_model
from paralab.strategies.base import Context
from paralab.strategies.pipeline.stage import Stage


def make_stage(model, a, b, first, last):
    ctx = Context(rank=0, world=1, device=torch.device("cpu"), comm=None, recorder=None)
    return Stage({i: model[i] for i in range(a, b)}, first=first, last=last, in_shape=(), out_shape=(), ctx=ctx)


def test_split_backward_equals_whole_backward():
    """I then W gives the whole backward's input gradient and weight gradients; I alone touches no .grad."""
    torch.manual_seed(0)
    model = build_model("vgg11", width=0.125)
    ref = build_model("vgg11", width=0.125)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    F.cross_entropy(ref(x), y).backward()

    front, back = make_stage(model, 0, 5, True, False), make_stage(model, 5, 14, False, True)
    h = front.forward(0, x, split=True)
    out = back.forward(0, h.detach(), split=True)
    assert len(back.saved[0]) == 9  # the graph is cut at every unit, so I stops at each unit's input
    g = back.backward_input(0, loss=F.cross_entropy(out, y))
    assert all(p.grad is None for p in model.parameters())  # I computes no weight gradient
    assert back.alive() == 1  # the activations stay until W
    assert front.backward_input(0, grad_output=g) is None
    back.backward_weight(0)
    front.backward_weight(0)
    assert front.alive() == back.alive() == 0 and not back.weight_work
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0), name


def config(strategy, **kw):
    base = dict(strategy=strategy, dataset="synthetic", width=0.125, batch_size=32, workers=2, num_batches=1)
    return RunConfig(**(base | kw))


@pytest.mark.parametrize("strategy,kw,message", [
    ("pipeline", dict(schedule="interleaved-1f1b"), "give --virtual-stages 2 or more"),
    ("pipeline", dict(schedule="interleaved-1f1b", virtual_stages=2, workers=3, microbatches=4),
     "--microbatches 4 must be a multiple of the 3 pipeline stages"),
    ("pipeline", dict(schedule="interleaved-1f1b", virtual_stages=8, microbatches=4),
     "cuts the model into 2 x 8 = 16 stages, but it has only 14 units"),
    ("pipeline", dict(schedule="interleaved-1f1b", virtual_stages=2, microbatches=4, partition="3,4"),
     "gives 2 stage(s)"),
    ("pipeline", dict(workers=4, partition="1,1,1,11"), "leaves stage 1 (maxpool) without parameters"),
    ("torch-pipeline", dict(workers=4, partition="3,3,1,7", schedule="gpipe", microbatches=4),
     "leaves stage 2 (maxpool) without"),
    ("ddp", dict(workers=4, pp=2, partition="1,1,1,11"), "gives 4 stage(s) but there are 2"),
    ("ddp", dict(workers=8, pp=4, partition="1,1,2,10"), "leaves stage 1 (maxpool) without"),
    ("pipeline", dict(workers=10, batch_size=40), "9 units with parameters, fewer than the 10 pipeline stages"),
    ("pipeline", dict(schedule="1f1b", virtual_stages=2, microbatches=4), "applies to interleaved-1f1b only"),
    ("ddp", dict(workers=4, pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=6),
     "does not divide the batch of 16"),
])
def test_impossible_layouts_refused_before_start(strategy, kw, message):
    with pytest.raises(UsageError) as err:
        config(strategy, **kw).validate()
    assert message in str(err.value)


def test_accepted_layouts():
    config("pipeline", schedule="zb-h1", microbatches=2, workers=3).validate()  # m < p: allowed, idles more
    config("pipeline", schedule="interleaved-1f1b", virtual_stages=3, microbatches=4, workers=4).validate()
    config("pipeline", schedule="interleaved-1f1b", virtual_stages=2, microbatches=4, partition="2,2,5,5").validate()


def test_bad_virtual_stages_exit_2(paralab):
    r = paralab("train", "pipeline", "--workers", "3", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
                "--microbatches", "4")
    assert r.returncode == 2
    assert "must be a multiple of the 3 pipeline stages" in r.stderr + r.stdout
    assert not (r.out / "summary.json").exists()


SPLIT = ("zb-h1", "zb-h2")  # backward split into I and W


def check_argv(strategy, workers, norm, schedule, m, virtual=1, extra=()) -> tuple:
    """A ``train`` command's options (after ``train``) checking ``schedule`` over 2 steps."""
    args = (strategy, "--workers", str(workers), "--norm", norm, "--num-batches", "2", "--lr", "1e-3",
            "--check", "--schedule", schedule, "--microbatches", str(m), *extra)
    return args + (("--virtual-stages", str(virtual)) if virtual > 1 else ())


def run_check(paralab, strategy, workers, norm, schedule, m, virtual=1, extra=()):
    return passed(paralab("train", *check_argv(strategy, workers, norm, schedule, m, virtual, extra)))


def passed(r):
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout
    assert r.summary["check"]["result"] == "PASS"
    return r


def assert_records(r, stages, schedule, m, virtual=1, dp=1):
    from paralab.analysis.cost import in_flight, schedule_bubble
    details = r.summary["strategy_details"]
    # the executor's spans (a flavour may record compute spans of its own inside them, without a stage)
    spans = [sp for sp in r.rows("spans.jsonl") if sp["step"] == 1 and sp["category"] == "compute"
             and "stage" in sp["args"]]
    for rank in range(stages * dp):
        d = details[str(rank)]
        k = d["stage"]
        assert d["schedule"] == schedule and d["microbatches"] == m
        assert d["bubble_theory"] == pytest.approx(schedule_bubble(schedule, stages, m, virtual).parts["fraction"])
        assert d["peak_microbatches_alive"] == d["in_flight_bound"] == in_flight(schedule, stages, m, virtual)[k]
        mine = [sp for sp in spans if sp["rank"] == rank]
        held = d.get("held_stages", [k])
        assert len(held) == virtual
        for kind in (("forward", "backward_input", "backward_weight") if schedule in SPLIT
                     else ("forward", "backward")):
            for s in held:  # every microbatch, once per stage, in this step
                got = sorted(sp["args"]["mb"] for sp in mine if sp["name"] == kind and sp["args"]["stage"] == s)
                assert got == list(range(m)), (rank, kind, s)
        if schedule in SPLIT:
            assert not [sp for sp in mine if sp["name"] == "backward"]


# BN-free runs of these are in the slow matrix (test_check_matrix, which also checks p2 m4)
DEFAULT = [("zb-h1", "batch"), ("zb-h2", "batch"), ("interleaved-1f1b", "batch")]


@pytest.mark.parametrize("schedule,norm", DEFAULT, ids=[f"{s}-{n}" for s, n in DEFAULT])
def test_check_p2_m4(paralab, schedule, norm):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    r = run_check(paralab, "pipeline", 2, norm, schedule, 4, virtual)
    assert_records(r, 2, schedule, 4, virtual)
    # the ideal timeline beside the measured one: the same schedule on the measured stage times
    from paralab.analysis.runs import load_run
    from paralab.report.plots import ideal_schedule_boxes, timeline_table
    panel, why = ideal_schedule_boxes(load_run(r.out))
    assert why is None
    boxes, desc = panel
    kinds = {b[3] for b in boxes}
    if schedule in SPLIT:
        assert {"backward_input", "backward_weight"} <= kinds and "backward" not in kinds
        assert {b[4] for b in boxes if b[0] == 1} >= {"I3", "W3"}
    else:
        assert "2 stages x 2 virtual" in desc and {b[4] for b in boxes if b[0] == 0} >= {"F0s0", "F0s2", "B3s0"}
    measured_kinds = {row[6] for row in timeline_table([load_run(r.out)])[1]}
    assert ({"backward_input", "backward_weight"} if schedule in SPLIT else {"backward"}) <= measured_kinds


def test_check_dp2_x_pp2_ddp_zb_h1(paralab):
    """Our ddp's buckets launch inside the last W of each stage (gradients complete only there):
    each stage's replicas end equal to one process's run (the check also asserts bit-identity)."""
    r = run_check(paralab, "ddp", 4, "batch", "zb-h1", 4, extra=("--pp", "2"))
    assert_records(r, 2, "zb-h1", 4, dp=2)
    for rank in range(4):
        assert r.summary["strategy_details"][str(rank)]["data_parallel"]["flavour"] == "ddp"
    buckets = [sp for sp in r.rows("spans.jsonl") if sp["category"] == "comm" and sp["name"].startswith("ddp_bucket")
               and sp["step"] == 1]
    weights = {sp["rank"]: sp for sp in r.rows("spans.jsonl") if sp["step"] == 1 and sp["name"] == "backward_weight"}
    for sp in buckets:  # launched after the stage's last W began, never during an earlier microbatch
        assert sp["t0"] >= weights[sp["rank"]]["t0"] - 1e-6


# ---------------------------------------------------------------- the matrix (slow)
def matrix():
    cases = []
    for p in (2, 3, 4):
        for norm in ("batch", "none"):
            for m in (4, 8):
                cases += [(name, p, m, 1, norm, ()) for name in SPLIT]
            # interleaved needs m a multiple of p: p = 3 takes m = 3 and 6 (batch 48 so they divide it)
            for m in ((3, 6) if p == 3 else (4, 8)):
                cases.append(("interleaved-1f1b", p, m, 2, norm, ("--batch-size", "48") if p == 3 else ()))
    return cases


def dp_x_pp_argv(flavour, schedule) -> tuple:
    extra = ("--pp", "2") + (("--zero-stage", "1") if flavour == "fsdp" else ())
    return check_argv(flavour, 4, "batch", schedule, 4, 2 if schedule == "interleaved-1f1b" else 1, extra)


def torch_argv(schedule, p, m, norm) -> tuple:
    return check_argv("torch-pipeline", p, norm, schedule, m, 2 if schedule == "interleaved-1f1b" else 1)


@pytest.fixture(scope="module")
def slow_runs(request, tmp_path_factory):
    """The slow matrices' runs (those the selected tests need), two at a time: argv -> Result."""
    from conftest import selected, side_by_side
    jobs = [check_argv("pipeline", w["p"], w["norm"], w["schedule"], w["m"], w["virtual"], w["extra"])
            for w in selected(request, "test_check_matrix")]
    jobs += [dp_x_pp_argv(w["flavour"], w["schedule"]) for w in selected(request, "test_check_dp_x_pp_every_flavour")]
    jobs += [torch_argv(w["schedule"], w["p"], w["m"], w["norm"])
             for w in selected(request, "test_torch_pipeline_check_matrix") if not dualpipev_too_few(w["schedule"],
                                                                                                    w["p"], w["m"])]
    return side_by_side({argv: argv for argv in jobs}, tmp_path_factory.mktemp("schedules"))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,virtual,norm,extra", matrix(),
                         ids=[f"{s}-p{p}-m{m}-v{v}-{n}" for s, p, m, v, n, _ in matrix()])
def test_check_matrix(slow_runs, schedule, p, m, virtual, norm, extra):
    r = passed(slow_runs[check_argv("pipeline", p, norm, schedule, m, virtual, extra)])
    assert_records(r, p, schedule, m, virtual)


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["ddp", "torch-ddp", "allreduce", "fsdp"])
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "interleaved-1f1b"])
def test_check_dp_x_pp_every_flavour(slow_runs, flavour, schedule):
    r = passed(slow_runs[dp_x_pp_argv(flavour, schedule)])
    assert_records(r, 2, schedule, 4, 2 if schedule == "interleaved-1f1b" else 1, dp=2)


# ---------------------------------------------------------------- torch-pipeline (PyTorch's schedules)
def assert_torch_records(r, p, schedule, m):
    details = r.summary["strategy_details"]
    spans = [sp for sp in r.rows("spans.jsonl") if sp["step"] == 1]
    per_rank = 2 if schedule in ("zbv", "dualpipev", "interleaved-1f1b") else 1
    for rank in range(p):
        d = details[str(rank)]
        assert d["schedule"] == schedule and d["torch_schedule"].startswith("Schedule")
        held = d.get("held_stages", [rank])
        assert len(held) == per_rank
        if schedule in ("zbv", "dualpipev"):
            assert held == sorted([rank, 2 * p - 1 - rank])  # the V
        mine = [sp for sp in spans if sp["rank"] == rank and sp["category"] == "compute"]
        for s in held:  # every microbatch forwarded once per stage, and its weights' gradients done once
            assert sorted(sp["args"]["mb"] for sp in mine if sp["name"] == "forward" and sp["args"]["stage"] == s) \
                == list(range(m))
            done = [sp["args"]["mb"] for sp in mine if sp["name"] in ("backward", "backward_weight")
                    and sp["args"]["stage"] == s]
            assert sorted(done) == list(range(m)), (rank, s)
        assert 0 <= d["bubble"] < 1
        assert [sp for sp in spans if sp["rank"] == rank and sp["category"] == "idle"]


def test_torch_pipeline_1f1b_check(paralab):
    """PyTorch's 1F1B on our cut equals one process, BatchNorm included: no shape-inference forward ran
    (it would update every BatchNorm's running statistics once more than the reference)."""
    r = run_check(paralab, "torch-pipeline", 2, "batch", "1f1b", 4)
    assert_torch_records(r, 2, "1f1b", 4)
    d = r.summary["strategy_details"]["0"]
    assert d["bubble_theory"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("kw,message", [
    (dict(schedule="zb-h1", microbatches=4), "zb-h1 and zb-h2 are ours"),
    (dict(schedule="zb-h2", microbatches=4), "zb-h1 and zb-h2 are ours"),
    (dict(schedule="interleaved-1f1b", microbatches=4), "give --virtual-stages 2 or more"),
    (dict(schedule="zbv", virtual_stages=2, microbatches=4), "hold two stages per rank, in a V"),
    (dict(schedule="interleaved-1f1b", virtual_stages=2, microbatches=3, workers=2), "multiple of the 2"),
])
def test_torch_pipeline_refusals(kw, message):
    with pytest.raises(UsageError) as err:
        config("torch-pipeline", **kw).validate()
    assert message in str(err.value)


def test_ours_refuse_torch_only_schedules():
    with pytest.raises(UsageError, match="run by torch-pipeline only"):
        config("pipeline", schedule="dualpipev", microbatches=4).validate()


TORCH = ([(s, p, m, "batch") for s in ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev") for p in (2, 4)
          for m in (4, 8)]
         + [(s, 2, 4, "none") for s in ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")])


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,norm", TORCH, ids=[f"{s}-p{p}-m{m}-{n}" for s, p, m, n in TORCH])
def test_torch_pipeline_check_matrix(slow_runs, schedule, p, m, norm):
    if dualpipev_too_few(schedule, p, m):
        pytest.skip("dualpipev needs m >= 2p")
    r = passed(slow_runs[torch_argv(schedule, p, m, norm)])
    assert_torch_records(r, p, schedule, m)


def dualpipev_too_few(schedule, p, m) -> bool:
    return schedule == "dualpipev" and m < 2 * p
