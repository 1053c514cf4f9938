"""``model`` and ``pipeline``: the per-unit backward, refusals, and --check end to end."""
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


@pytest.mark.parametrize("split", [False, True])
def test_stage_backward_is_one_autograd_call_per_stage_or_per_unit_and_exact(monkeypatch, split):
    """A whole backward is one autograd call per stage; a forward cut for a split backward (zero-bubble)
    makes one per unit; both give one process's gradients."""
    torch.manual_seed(0)
    model = build_model("vgg11", width=0.125)
    ref = build_model("vgg11", width=0.125)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    F.cross_entropy(ref(x), y).backward()

    calls = []
    real_backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(1) or real_backward(*a, **k))
    front, back = make_stage(model, 0, 5, True, False), make_stage(model, 5, 14, False, True)
    h = front.forward(0, x, split=split)
    out = back.forward(0, h.detach(), split=split)
    assert front.alive() == back.alive() == 1 and front.peak_bytes > 0
    g = back.backward(0, loss=F.cross_entropy(out, y))
    assert len(calls) == (9 if split else 1)  # one per unit of the back stage, or one for the stage
    assert g.shape == h.shape
    assert front.backward(0, grad_output=g) is None  # the first stage has no input gradient to send
    assert len(calls) == (14 if split else 2)
    assert front.alive() == back.alive() == 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0), name
    assert set(front.state_dict()) | set(back.state_dict()) == set(model.state_dict())


def config(strategy, **kw):
    base = dict(strategy=strategy, dataset="synthetic", width=0.125, batch_size=32, workers=2, num_batches=1)
    return RunConfig(**(base | kw))


@pytest.mark.parametrize("strategy,kw,message", [
    ("pipeline", dict(microbatches=5), "--microbatches 5 does not divide the batch of 32"),
    ("pipeline", dict(schedule="zigzag"), "--schedule must be one of"),
    ("pipeline", dict(workers=15), "cannot split a model of 14 units over 15 stages"),
    ("pipeline", dict(partition="3,4"), "adds up to 7 units"),
    ("model", dict(partition="1,2,11"), "gives 3 stage(s) but there are 2 workers"),
    ("model", dict(microbatches=4), "use 'pipeline --microbatches 4'"),
    ("pipeline", dict(accumulate=2), "--accumulate does not apply to a pipeline"),
    ("pipeline", dict(workers=4, pp=2), "name the data-parallel flavour instead"),
    ("ddp", dict(workers=4, pp=2, microbatches=3), "does not divide the batch of 16 per data-parallel replica"),
    ("ddp", dict(workers=3, pp=2), "must be a multiple of 2"),
    ("single", dict(workers=2, pp=2), "cannot be composed with pipeline stages"),
    ("ddp", dict(workers=4, pp=2, accumulate=2), "--accumulate does not apply to a pipeline"),
])
def test_refused_before_workers_start(strategy, kw, message):
    with pytest.raises(UsageError) as err:
        config(strategy, **kw).validate()
    assert message in str(err.value)


def test_accepted():
    config("pipeline", microbatches=8, schedule="1f1b", workers=3).validate()
    config("pipeline", microbatches=2, schedule="1f1b", workers=3, partition="params").validate()  # M < W
    config("model", workers=3, partition="4,5,5").validate()


CHECKS = [
    ("model", 2, "batch", []),
    ("model", 3, "none", []),
    ("pipeline", 2, "none", ["--schedule", "gpipe", "--microbatches", "4"]),
    ("pipeline", 3, "batch", ["--schedule", "gpipe", "--microbatches", "4"]),
    ("pipeline", 2, "batch", ["--schedule", "1f1b", "--microbatches", "4"]),
    ("pipeline", 3, "none", ["--schedule", "1f1b", "--microbatches", "2", "--partition", "params"]),  # M < W
]


@pytest.mark.parametrize("strategy,workers,norm,extra", CHECKS,
                         ids=[f"{s}-w{w}-{n}-{'-'.join(e[1::2])}" for s, w, n, e in CHECKS])
def test_check_end_to_end(paralab, strategy, workers, norm, extra):
    r = paralab("train", strategy, "--workers", str(workers), "--norm", norm, "--num-batches", "2",
                "--lr", "1e-3", "--check", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout
    s = r.summary
    assert s["check"]["result"] == "PASS"
    m = int(extra[extra.index("--microbatches") + 1]) if "--microbatches" in extra else 1
    schedule = extra[extra.index("--schedule") + 1] if "--schedule" in extra else "naive"
    details = s["strategy_details"]
    assert sorted(details) == [str(r) for r in range(workers)]
    ranges = details["0"]["ranges"]
    assert ranges[0][0] == 0 and ranges[-1][1] == 14 and len(ranges) == workers
    for rank in range(workers):
        d = details[str(rank)]
        assert d["units"] == ranges[rank] and d["schedule"] == schedule and d["microbatches"] == m
        assert d["bubble_theory"] == pytest.approx((workers - 1) / (m + workers - 1))
        assert 0 <= d["bubble"] < 1
        bound = min(m, workers - rank) if schedule == "1f1b" else m
        assert d["peak_microbatches_alive"] == bound == d["in_flight_bound"]
        assert d["peak_activation_bytes"] > 0
    spans = r.rows("spans.jsonl")
    train = [sp for sp in spans if sp["step"] >= 0]
    for rank in range(workers):
        for kind in ("forward", "backward"):
            mbs = sorted(sp["args"]["mb"] for sp in train
                         if sp["rank"] == rank and sp["step"] == 1 and sp["name"] == kind)
            assert mbs == list(range(m)), (rank, kind)
    idle = [sp for sp in train if sp["category"] == "idle"]
    assert {sp["rank"] for sp in idle} == set(range(workers))  # every stage waits for a neighbour
    assert all(sp["name"].startswith("wait:recv") for sp in idle)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_short_last_batch_with_fewer_samples_than_microbatches(paralab, schedule):
    # 40 samples, batch 32, 16 microbatches: the epoch's second batch has 8 samples, so 8 microbatches
    r = paralab("train", "pipeline", "--workers", "2", "--schedule", schedule, "--microbatches", "16",
                "--synthetic-size", "40", "--num-batches", "2", "--lr", "1e-3", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.summary["check"]["result"] == "PASS"
    steps = [row for row in r.rows("steps.jsonl") if row["rank"] == 1]
    assert [row["samples"] for row in steps] == [32, 8]
