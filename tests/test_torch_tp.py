"""torch-tp: PyTorch's DTensor tensor parallelism on the gpt equals one process (``--check``), really shards,
and refuses what it does not lay out (exit 2)."""
from __future__ import annotations

import json

import pytest

# a tiny gpt on generated text: a few seconds of compute per run on 2 cores
GPT = ["--model", "gpt", "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16", "--batch-size", "8",
       "--dataset", "synthetic-text", "--synthetic-size", "64", "--eval-batches", "1", "--eval-batch-size", "8"]


def _check_passes_on_every_rank(r, workers):
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout, r.stdout
    for rank in range(workers):
        assert f"check rank {rank}: PASS" in r.stdout, r.stdout
    assert r.summary["check"]["result"] == "PASS", r.summary["check"]


def _sharded(r, workers, sequence_parallel=False):
    """Each rank holds DTensor slices: the split tensors counted from their placements, about 1/T of the
    parameters held (LayerNorms, position embeddings and row-parallel biases stay whole)."""
    details = r.summary["strategy_details"]
    assert len(details) == workers
    layers = 2
    for rank, d in details.items():
        tp = d["tensor_parallel"]
        assert tp["size"] == workers and tp["rank"] == int(rank) and tp["sequence_parallel"] == sequence_parallel
        # tokens, head output, and per block: q, k, v (weight, bias), attn.proj.weight, fc (weight, bias), mlp.proj.weight
        assert tp["split_tensors"] == 2 + 10 * layers, tp
        assert 1 / workers < tp["local_parameters"] / tp["parameters"] < 1 / workers + 0.1, tp
        assert d["collectives_timed"] is False


def test_torch_tp_check_passes_at_tp2(paralab):
    r = paralab("train", "torch-tp", "--workers", "2", *GPT, "--num-batches", "2", "--check")
    _check_passes_on_every_rank(r, 2)
    _sharded(r, 2)
    assert json.loads((r.out / "config.json").read_text())["mesh"]["shape"] == {"pp": 1, "dp": 1, "tp": 2}


@pytest.mark.parametrize("args, says", [
    (["--model", "vgg11"], "paralab train tp --model vgg11"),
    (["--model", "gpt", "--workers", "4", "--pp", "2"], "pure tensor parallelism"),
    (["--model", "gpt", "--workers", "4", "--tp", "2"], "pure tensor parallelism"),
    (["--model", "gpt", "--heads", "3", "--embed", "24"], "--heads 3 must be divisible by tp 2"),
])
def test_torch_tp_refuses_what_it_does_not_lay_out(paralab, args, says):
    r = paralab("train", "torch-tp", "--workers", "2", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr, r.stderr
    assert not r.out.exists()  # refused before anything was written


@pytest.mark.slow
@pytest.mark.parametrize("workers, extra", [(2, ["--sequence-parallel"]), (4, []),
                                            (4, ["--sequence-parallel", "--precision", "fp64"])])
def test_torch_tp_check_passes(paralab, workers, extra):
    r = paralab("train", "torch-tp", "--workers", str(workers), *GPT, "--num-batches", "3", "--check", *extra,
                timeout=400)
    _check_passes_on_every_rank(r, workers)
    _sharded(r, workers, sequence_parallel="--sequence-parallel" in extra)


@pytest.mark.slow
def test_torch_tp_trains_as_our_tp(paralab):
    """Same layout, same arithmetic: the per-step losses of tp and torch-tp agree to float32 rounding."""
    runs = [paralab("train", name, "--workers", "2", *GPT, "--num-batches", "3") for name in ("tp", "torch-tp")]
    losses = []
    for r in runs:
        assert r.returncode == 0, r.stdout + r.stderr
        losses.append([row["loss"] for row in r.rows("steps.jsonl") if row.get("rank") == 0])
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-5)


@pytest.mark.slow
def test_torch_tp_resumes_and_exports(paralab, tmp_path):
    # fp64 from the start: the resumed run's --check runs in fp64 (its default), and a checkpoint continues
    # only in its own precision
    first = paralab("train", "torch-tp", "--workers", "2", *GPT, "--num-batches", "2", "--optimizer", "adam",
                    "--lr", "0.001", "--precision", "fp64")
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = paralab("train", "torch-tp", "--workers", "2", *GPT, "--num-batches", "4", "--optimizer", "adam",
                      "--lr", "0.001", "--resume", str(first.out), "--check", "--precision", "fp64")
    _check_passes_on_every_rank(resumed, 2)
    out = tmp_path / "model.pt"
    exported = paralab("export", str(resumed.out), "-o", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    import torch

    from paralab.models import build_model
    model = build_model("gpt", layers=2, embed=32, heads=4, context=16)
    model.load_state_dict(torch.load(out, weights_only=True))  # whole tensors under the plain keys


@pytest.mark.slow
def test_tp_bench_runs_at_a_toy_size(tmp_path):
    """bench/tp.py end to end at a toy shape: every variant ran, the ratios it reports are there (no timing
    is asserted: figures at this size mean nothing)."""
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "tp.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "tp.py"
    r = subprocess.run([sys.executable, str(script), "--layers", "1", "--embed", "32", "--heads", "4", "--context",
                        "16", "--batch-size", "8", "--steps", "2", "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    d = json.loads(out.read_text())
    assert set(d["best"]) == {"single", "tp2", "torch-tp2", "tp2-sp"}
    assert {"tp2_over_torch_tp2", "tp2_over_single", "tp2_sp_over_tp2"} <= set(d["ratios"])
    assert d["best"]["tp2"]["comm_bytes_per_step"] > 0 and d["cpu"]


def _step_with_foreach_optimizer(rank, out):
    """One rank of tp 1: torch-tp built with an optimizer factory that defaults to the multi-tensor
    ("foreach") kernels, as torch does on CUDA; training steps before and after a resume."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from paralab.comm import Comm
    from paralab.models import build_model
    from paralab.recorder import Recorder
    from paralab.strategies.base import Context
    from paralab.strategies.torch_tp import TorchTP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        rec = Recorder(0)
        ctx = Context(0, 1, torch.device("cpu"), Comm(rec, 0, 1), rec,
                      options=SimpleNamespace(sequence_parallel=False))
        made = []

        def optim_fn(params, foreach=True, **how):
            made.append(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=foreach, **how))
            return made[-1]

        torch.manual_seed(0)
        strategy = TorchTP(ctx, lambda: build_model("gpt", layers=1, heads=2, embed=16, context=8), optim_fn)
        x = torch.randint(0, 256, (2, 8))
        for _ in range(2):  # the second step uses the momentum buffers
            strategy.train_step(x, x)
        state = strategy.state_dict()
        for group in state["optimizer"]["param_groups"]:
            group["foreach"] = True  # a checkpoint from before the fix says None: on CUDA, foreach
        strategy.load_state_dict(state)
        strategy.train_step(x, x)
        (out / "ok").write_text(str(made[0].defaults["foreach"]))
    finally:
        dist.destroy_process_group()


def test_torch_tp_steps_where_the_optimizer_defaults_to_foreach(tmp_path):
    """LayerNorms and the position table stay plain tensors beside the DTensors; torch's foreach kernels
    (its default on CUDA) refuse such a mixed list, which first failed on a GPU (bench/gpu_check.py)."""
    from spawn_ranks import spawn
    spawn(_step_with_foreach_optimizer, (tmp_path,), 1)
    assert (tmp_path / "ok").read_text() == "False"
