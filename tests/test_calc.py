"""The cost model (`paralab calc`) and the large-batch learning-rate rule (schedule.lr_at)."""
from __future__ import annotations

import json

import pytest
import torch

from paralab.analysis import cost
from paralab.cli import main
from paralab.training.lr_schedule import lr_at, target_lr

from report_runs import tiny_compare


def calc(capsys, *args) -> tuple[int, str, str]:
    code = main(["calc", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- memory (ZeRO paper, sec. 5.1)
def test_zero_paper_example(capsys):
    code, out, _ = calc(capsys, "memory", "--parameters", "7.5e9", "--workers", "64", "--optimizer", "adam",
                        "--precision", "mixed", "--json")
    assert code == 0
    totals = {e["strategy"]: e["bytes"]["total"] / 1e9 for e in json.loads(out)}
    assert round(totals["ddp"]) == 120
    assert round(totals["zero-1"], 1) == 31.4
    assert round(totals["zero-2"], 1) == 16.6
    assert round(totals["zero-3"], 1) == 1.9


ZERO_EXAMPLE = ["--parameters", "7.5e9", "--workers", "64", "--optimizer", "adam", "--precision", "mixed", "--json"]
PSI, N = 7.5e9, 64


def _totals(out: str, key: str = "total") -> dict:
    return {e["strategy"]: e["bytes"][key] for e in json.loads(out)}


def test_memory_fp32_gradient_copy_is_deepspeeds_accounting(capsys):
    """DeepSpeed's estimators keep an fp32 gradient shard beside the optimizer state: 4 Psi + 16 Psi / N at
    ZeRO-1 (estimate_zero2_model_states_mem_needs, which serves stages 1 and 2; its ZeRO-2 also keeps the 16-bit
    gradients whole), 18 Psi / N at ZeRO-3 (estimate_zero3_model_states_mem_needs, less the largest layer)."""
    code, out, _ = calc(capsys, "memory", *ZERO_EXAMPLE, "--fp32-grads")
    assert code == 0
    got = _totals(out)
    assert got["ddp"] == pytest.approx(16 * PSI + 4 * PSI)
    assert got["zero-1"] == pytest.approx(4 * PSI + 16 * PSI / N)
    assert got["zero-2"] == pytest.approx(2 * PSI + 2 * PSI / N + 12 * PSI / N + 4 * PSI / N)  # the paper's + 4 Psi / N
    assert got["zero-3"] == pytest.approx(18 * PSI / N)                                     # the paper's + 2 Psi / N
    code, text, _ = calc(capsys, "memory", *ZERO_EXAMPLE[:-1], "--fp32-grads")
    assert "fp32 gradient copy" in text


def test_memory_offloads_the_optimizer_state_to_the_host(capsys):
    code, out, _ = calc(capsys, "memory", *ZERO_EXAMPLE, "--offload", "optimizer")
    assert code == 0
    device, host = _totals(out, "device"), _totals(out, "host")
    assert device["zero-2"] == pytest.approx(2 * PSI + 2 * PSI / N) and host["zero-2"] == pytest.approx(12 * PSI / N)
    assert device["ddp"] == pytest.approx(4 * PSI) and host["ddp"] == pytest.approx(12 * PSI)
    assert _totals(out)["zero-2"] == pytest.approx(device["zero-2"] + host["zero-2"])
    code, text, _ = calc(capsys, "memory", *ZERO_EXAMPLE[:-1], "--offload", "optimizer")
    assert "device" in text and "host" in text and f"{12 * PSI / N / 1e9:.4g} GB" in text


def test_memory_model_parallel_divides_psi_before_the_data_parallel_sharding(capsys):
    code, out, _ = calc(capsys, "memory", *ZERO_EXAMPLE, "--mp", "16")
    assert code == 0
    got = _totals(out)
    assert got["ddp"] == pytest.approx(16 * PSI / 16) and got["zero-3"] == pytest.approx(16 * PSI / 16 / N)
    code, text, _ = calc(capsys, "memory", *ZERO_EXAMPLE[:-1], "--mp", "16")
    assert "M = 16" in text and "1,024 devices" in text


def test_memory_prints_formula_substitution_and_result(capsys):
    code, out, _ = calc(capsys, "memory", "--model", "vgg11", "--workers", "4", "--stage", "0,3")
    assert code == 0
    assert "9,231,114 parameters" in out  # DESIGN.md: VGG-11's parameter count
    assert "(p + g + K) x Psi / N" in out and "formula:" in out and "substituted:" in out
    # fp32 sgd with momentum: 12 bytes per parameter, sharded 4 ways for ZeRO-3
    assert f"{12 * 9231114 / 4 / 1e6:.4g} MB" in out and "zero-1" not in out


def test_memory_with_a_model_shows_the_largest_units_working_set_and_peak(capsys):
    code, out, _ = calc(capsys, "memory", "--model", "vgg11", "--workers", "2", "--stage", "3",
                        "--step-in-backward")
    assert code == 0
    # VGG-11's largest unit: a 512 -> 512 3x3 convolution with bias and BatchNorm = 2,360,832 parameters;
    # stepped in backward: (p + K) Psi / N + g Psi_unit / N + (p + g) Psi_unit, what bench/fsdp.py measures
    assert "(p + K) x Psi / N + g x Psi_unit / N" in out and "(4 + 4) x 2_360_832" in out
    peak = 8 * 9231114 / 2 + 4 * 2360832 / 2 + 8 * 2360832
    assert f"{peak / 1e6:.4g} MB" in out


@pytest.mark.parametrize("args, message", [
    (["memory", "--parameters", "1e9", "--workers", "8", "--step-in-backward"], "--step-in-backward"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--unit-parameters", "2e9"], "--unit-parameters"),
    (["memory", "--parameters", "1e9", "--workers", "0"], "--workers"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--optimizer", "lamb"], "--optimizer"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--precision", "fp8"], "--precision"),
    (["memory", "--model", "alexnet", "--workers", "8"], "unknown model"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--fp32-grads"], "--precision mixed"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--offload", "gpu"], "--offload"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--mp", "0"], "--mp"),
    (["memory", "--parameters", "1e9", "--workers", "8", "--mp", "7"], "--mp"),
    (["allreduce", "--parameters", "1e9", "--workers", "8", "--bandwidth", "0"], "--bandwidth"),
    (["allreduce", "--bytes", "1e6", "--workers", "8", "--bandwidth", "10", "--per-tensor"], "--per-tensor"),
    (["bubble", "--stages", "4", "--microbatches", "0"], "--microbatches"),
    (["comm", "--model", "vgg11", "--workers", "99"], "at most"),
])
def test_bad_input_exits_2_saying_what_to_change(capsys, args, message):
    code, _, err = calc(capsys, *args)
    assert code == 2 and message in err


# ---------------------------------------------------------------- all-reduce (CS1390 Q1.6, HPML Q3.2)
def test_ring_allreduce_cs1390_example(capsys):
    # 10B fp16 gradients over 8 workers at 100 Gb/s: 2 x 7/8 x 20 GB / 12.5 GB/s = 2.8 s
    code, out, _ = calc(capsys, "allreduce", "--parameters", "10e9", "--precision", "fp16", "--workers", "8",
                        "--bandwidth", "100")
    assert code == 0
    assert "result:      2.8 s" in out
    assert "result:      22.4 s" in out  # gather/scatter: 2 x 7 x 20 GB / 12.5 GB/s
    assert "2(N-1)/N x S / B + 2(N-1) x a" in out


def test_allreduce_formulas():
    f = cost.ring_allreduce_time(1e9, 4, 8.0, latency_s=1e-3, messages=10)
    # 1.5 x 1e9 B / 1e9 B/s + 2 x 3 x 1 ms x 10
    assert f.value == pytest.approx(1.5 + 0.06)
    assert cost.ring_allreduce_time(1e9, 1, 8.0).value == 0
    gs = cost.gather_scatter_time(1e9, 4, 8.0)
    assert gs.value == pytest.approx(6.0)
    # gather/scatter grows with N, the ring stays under 2 S / B
    assert cost.gather_scatter_time(1e9, 16, 8.0).value > 4 * gs.value
    assert cost.ring_allreduce_time(1e9, 64, 8.0).value < 2.0


def test_per_tensor_latency_counts_model_tensors(capsys):
    code, out, _ = calc(capsys, "allreduce", "--model", "vgg11", "--workers", "4", "--bandwidth", "10",
                        "--latency", "100", "--per-tensor")
    assert code == 0
    tensors = len(list(__import__("paralab.models", fromlist=["build_model"]).build_model("vgg11").parameters()))
    assert f"k = {tensors} call(s)" in out and f"x {tensors}" in out


# ---------------------------------------------------------------- bubble (GPipe sec. 2.3, PipeDream 1F1B)
def test_bubble_numbers(capsys):
    code, out, _ = calc(capsys, "bubble", "--stages", "4", "--microbatches", "1,4,8")
    assert code == 0
    assert "bubble = (4-1) / (4+4-1) = 3/7" in out and "42.86 %" in out
    assert "75.00 %" in out and "27.27 %" in out
    assert "min(4-0, 8) = 4, min(4-1, 8) = 3, min(4-2, 8) = 2, min(4-3, 8) = 1" in out


def test_bubble_and_in_flight_functions():
    assert cost.bubble_fraction(2, 4).parts["fraction"] == pytest.approx(0.2)
    assert cost.in_flight("gpipe", 3, 8) == [8, 8, 8]
    assert cost.in_flight("1f1b", 3, 8) == [3, 2, 1]
    assert cost.in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert cost.ideal_step_time(4, 4, 0.01, 0.02).value == pytest.approx(7 * 0.03)


# ---------------------------------------------------------------- bubble with stage times (Qi et al. 2024, sec. 2)
def test_timed_bubble_at_equal_times_is_the_schedules_formula_and_the_simulators():
    from paralab.strategies.pipeline.schedules import SCHEDULES
    for name in SCHEDULES:
        v = 2 if name == "interleaved-1f1b" else 1
        t = cost.schedule_times(name, 4, 8, v, forward_s=1.0, input_s=1.0, weight_s=1.0)
        fraction = cost.schedule_bubble(name, 4, 8, v).parts["fraction"]
        assert t.parts["fraction"] == pytest.approx(fraction), name
        assert t.parts["simulated_fraction"] == pytest.approx(fraction), name


def test_zb_h1_bubble_with_a_lighter_weight_gradient():
    """T_F = T_I = 1, T_W = 0.5: ZB-H1 idles (p-1)(T_F + T_I - T_W) per step, as the simulator finds."""
    p, m = 4, 8
    t = cost.schedule_times("zb-h1", p, m, 1, forward_s=1.0, input_s=1.0, weight_s=0.5)
    idle = (p - 1) * (1 + 1 - 0.5)
    step = m * (1 + 1 + 0.5) + idle
    assert t.value == pytest.approx(step) and t.parts["fraction"] == pytest.approx(idle / step)
    assert t.parts["simulated_step"] == pytest.approx(step)
    assert t.parts["simulated_fraction"] == pytest.approx(idle / step)


def test_calc_bubble_schedule_uses_the_times(capsys):
    code, old, _ = calc(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8")
    assert code == 0 and "11.11 %" in old
    code, out, _ = calc(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8",
                        "--forward-ms", "1", "--backward-ms", "2")
    assert code == 0 and all(line in out.splitlines() for line in old.splitlines())  # today's output, and more
    assert "T_I = T_W = 1 ms" in out  # the whole backward split evenly, said
    code, out, _ = calc(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8",
                        "--forward-ms", "1", "--backward-ms", "1", "--weight-ms", "0.5")
    assert code == 0
    assert "(4-1)(1 ms + 1 ms - 0.5 ms)" in out and "18.37 %" in out
    assert "24.5 ms" in out and "simulated" in out


def test_calc_bubble_says_which_times_a_schedule_cannot_split(capsys):
    code, out, _ = calc(capsys, "bubble", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                        "--forward-ms", "1", "--backward-ms", "1", "--weight-ms", "0.5")
    assert code == 0 and "1f1b runs each backward whole" in out and "T_B = T_I + T_W = 1.5 ms" in out
    code, out, _ = calc(capsys, "bubble", "--stages", "4", "--microbatches", "8",
                        "--forward-ms", "1", "--backward-ms", "1", "--weight-ms", "0.5")
    assert code == 0 and "runs each backward whole" in out


@pytest.mark.parametrize("args, message", [
    (["--forward-ms", "-1"], "--forward-ms"),
    (["--forward-ms", "1", "--backward-ms", "0"], "--backward-ms"),
    (["--backward-ms", "2"], "--forward-ms"),
    (["--forward-ms", "1", "--weight-ms", "1"], "--backward-ms"),
    (["--forward-ms", "1", "--backward-ms", "1", "--weight-ms", "-1"], "--weight-ms"),
])
def test_calc_bubble_refuses_bad_times(capsys, args, message):
    code, _, err = calc(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", *args)
    assert code == 2 and message in err


# ---------------------------------------------------------------- boundary traffic (CS1390 Q2.3)
def test_comm_counts_the_real_boundary(capsys):
    from paralab.models import build_model
    from paralab.strategies.pipeline.partition import partition_model
    code, out, _ = calc(capsys, "comm", "--model", "vgg11", "--width", "0.25", "--workers", "2",
                        "--batch-size", "64", "--partition", "params")
    assert code == 0
    model = build_model("vgg11", width=0.25)
    (_, cut), _ = partition_model(model, 2, "params")
    h = torch.zeros(1, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        for unit in list(model)[:cut]:
            h = unit(h)
    act = 64 * h[0].numel() * 4
    assert f"V = 2 x ({act:_}" in out or f"V = 2 x ({act})" in out
    total = 2 * act
    assert f"({total:,} B)" in out
    assert "2 x m x (p-1) = 2 x 1 x 1 = 2" in out


# ---------------------------------------------------------------- tp (Narayanan et al. 2021, Korthikanti et al. 2022)
GPT3_175B = ["--layers", "96", "--embed", "12288", "--heads", "96", "--context", "2048", "--vocab", "50257"]


@pytest.mark.parametrize("shape", [dict(layers=1, heads=4, embed=32, context=16, vocab=256),
                                   dict(layers=4, heads=4, embed=128, context=64, vocab=256),
                                   dict(layers=3, heads=3, embed=24, context=7, vocab=50),
                                   dict(layers=2, heads=1, embed=8, context=5, vocab=1000)])
def test_gpt_parameters_counted_without_building_equal_the_models(shape):
    from paralab.models import count_parameters
    from paralab.models.gpt import gpt, parameter_counts
    counts = parameter_counts(shape["layers"], shape["embed"], shape["context"], shape["vocab"])
    assert counts["total"] == count_parameters(gpt(**shape))
    assert counts["tokens"] == shape["vocab"] * shape["embed"] and counts["positions"] == shape["context"] * shape["embed"]


def test_tp_flops_leave_the_embedding_tables_out(capsys):
    """6N + 12 L h s with N the matmul parameters: the blocks and the (untied) head, not the two lookup tables."""
    code, out, _ = calc(capsys, "tp", "--layers", "1", "--embed", "32", "--context", "16")
    assert code == 0
    # 29,664 parameters, less the token (256 x 32) and position (16 x 32) tables = 20,960
    assert "6 x 20,960 + 12 x 1 x 32 x 16" in out and "result:      131904 FLOP" in out
    assert "N = 20,960" in out and "embedding tables" in out


def test_tp_runs_gpt3_175b_in_seconds_with_the_papers_flops(capsys):
    code, out, _ = calc(capsys, "tp", *GPT3_175B, "--tp", "8", "--batch-size", "1", "--sequence-parallel")
    assert code == 0
    assert "175,221,817,344 parameters" in out
    # Narayanan et al. 2021 (eq. 3 without recomputation): 72 L h^2 (1 + s/(6h)) + 6 h V per token
    L, h, s, V = 96, 12288, 2048, 50257
    paper = 72 * L * h ** 2 * (1 + s / (6 * h)) + 6 * h * V
    from paralab.analysis.tensor import gpt_flops_per_token
    f = gpt_flops_per_token(L, h, s, V)
    assert f.value == pytest.approx(paper, rel=1e-4)  # the paper leaves out biases and LayerNorms
    assert f"{f.value:.6g} FLOP" in out


def test_activation_memory_with_recomputation_is_korthikantis_table_2():
    """Korthikanti et al. 2022, Table 2 (per layer) and sec. 4.3 (the whole model), at GPT-3 175B, t = 8, b = 1."""
    from paralab.analysis.tensor import activation_memory, activation_total
    s, b, h, a, L, t, v = 2048, 1, 12288, 96, 96, 8, 50257
    sbh = s * b * h
    table2 = {("none", 1, False): sbh * (34 + 5 * a * s / h),
              ("none", t, False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
              ("none", t, True): sbh * (34 / t + 5 * a * s / (h * t)),
              ("selective", 1, False): sbh * 34,
              ("selective", t, False): sbh * (10 + 24 / t),
              ("selective", t, True): sbh * 34 / t,
              ("full", 1, False): 2 * sbh, ("full", t, False): 2 * sbh, ("full", t, True): 2 * sbh}
    for (recompute, tp, sp), want in table2.items():
        assert activation_memory(b, s, h, a, tp, sp, recompute).value == pytest.approx(want)
        # the model: L layers, plus the embedding's dropout mask and the final LayerNorm, output layer and loss
        total = activation_total(b, s, h, a, L, tp, sp, recompute, v)
        assert total.value == pytest.approx(L * want + s * b * h / tp + 4 * s * b * h / tp * (1 + v / h))


def test_tp_prints_a_row_per_recomputation(capsys):
    code, out, _ = calc(capsys, "tp", *GPT3_175B, "--tp", "8", "--batch-size", "1", "--sequence-parallel")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["none"], ["selective"], ["full"])}
    assert set(rows) == {"none", "selective", "full"}
    from paralab.analysis.cost import fmt_bytes
    from paralab.analysis.tensor import activation_total
    for name, line in rows.items():
        assert fmt_bytes(activation_total(1, 2048, 12288, 96, 96, 8, True, name, 50257).value) in line


@pytest.mark.parametrize("args, message", [
    (["tp", "--embed", "30", "--heads", "4"], "--embed"),
    (["tp", "--vocab", "0"], "--vocab"),
    (["tp", "--heads", "4", "--tp", "3"], "--tp"),
])
def test_tp_bad_input_exits_2(capsys, args, message):
    code, _, err = calc(capsys, *args)
    assert code == 2 and message in err


# ---------------------------------------------------------------- from a run directory
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out, p = tiny_compare(tmp_path_factory.getbasetemp())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def test_calc_run_bandwidth_utilisation(report, capsys):
    from paralab.analysis.runs import load_run
    run_dir = report / "runs" / "ddp-w2"
    r = load_run(run_dir)
    op = r.get("comm_ops")["all_reduce"]
    steps = r.get("measured_steps")
    t = op["seconds"] / steps / 2
    expected = 2 * (2 - 1) / 2 * op["bytes_per_step"] / t / 1e9
    code, out, _ = calc(capsys, "run", str(run_dir), "--bandwidth", "10")
    assert code == 0
    assert "U = 2(N-1)/N x S / T_comm" in out
    assert f"{expected:.4g} GB/s" in out
    assert "predicted" in out and "measured / predicted" in out and "share of the link" in out


def test_calc_run_pipeline_bubble(report, capsys):
    code, out, _ = calc(capsys, "run", str(report / "runs" / "pipeline-w2"))
    assert code == 0
    assert "bubble = (2-1) / (2+2-1) = 1/3" in out and "measured bubble" in out
    assert "the schedule replayed on this run's mean stage times" in out


def test_the_replay_uses_each_stages_own_mean_times(report):
    """analysis/pipeline: the schedule on the run's measured stage times, a reference for its bubble that
    knows the cut's imbalance (the formula assumes equal stages)."""
    from paralab.analysis.pipeline import ideal_timeline
    from paralab.analysis.runs import load_run
    from paralab.strategies.pipeline.simulate import simulated_bubble
    run = load_run(report / "runs" / "pipeline-w2")
    ideal, why = ideal_timeline(run)
    assert why is None and (ideal.schedule, ideal.stages, ideal.microbatches) == ("gpipe", 2, 2)
    measured = set(run.measured_steps())
    for stage in (0, 1):
        fwd = [s["t1"] - s["t0"] for s in run.spans if s["rank"] == stage and s["step"] in measured
               and s["category"] == "compute" and s["name"] == "forward"]
        assert ideal.stage_ms["forward"][stage] == pytest.approx(1000 * sum(fwd) / len(fwd))
    assert ideal.bubble == simulated_bubble(ideal.timed) and all(0 < x < 1 for x in ideal.bubble)


def test_calc_run_refuses_a_non_run(tmp_path, capsys):
    code, _, err = calc(capsys, "run", str(tmp_path))
    assert code == 2 and "not a finished run directory" in err


# ---------------------------------------------------------------- large batches (Goyal et al.)
def test_lr_scaling_and_warmup_follow_the_documented_rule():
    kw = dict(lr=0.1, global_batch=1024, steps_per_epoch=50)
    # no scaling, no warm-up: lr throughout
    assert lr_at(0, scaling="none", warmup_epochs=0, **kw) == 0.1
    assert lr_at(500, scaling="none", warmup_epochs=0, **kw) == 0.1
    # linear rule: lr x global batch / 256
    assert target_lr(0.1, "linear", 1024) == pytest.approx(0.4)
    assert lr_at(0, scaling="linear", warmup_epochs=0, **kw) == pytest.approx(0.4)
    # warm-up over 2 epochs (100 steps): from lr to the target, linearly, then held
    assert lr_at(0, scaling="linear", warmup_epochs=2, **kw) == pytest.approx(0.1)
    assert lr_at(50, scaling="linear", warmup_epochs=2, **kw) == pytest.approx(0.25)
    assert lr_at(99, scaling="linear", warmup_epochs=2, **kw) == pytest.approx(0.1 + 0.3 * 99 / 100)
    assert lr_at(100, scaling="linear", warmup_epochs=2, **kw) == pytest.approx(0.4)
    assert lr_at(10_000, scaling="linear", warmup_epochs=2, **kw) == pytest.approx(0.4)
    # a batch of 256 is the reference: the rule changes nothing
    assert lr_at(0, lr=0.1, scaling="linear", global_batch=256, warmup_epochs=0, steps_per_epoch=1) == 0.1


def test_memory_of_a_run_beside_the_planners_prediction(tmp_path, capsys):
    """``calc memory RUN``: what each rank measured it holds beside the planner's prediction for the run's
    layout, here context parallelism with selective recomputation (the planner's cp and recompute terms)."""
    from conftest import run_paralab
    out = tmp_path / "run"
    res = run_paralab("train", "ddp", "--workers", "2", "--cp", "2", "--model", "gpt", "--layers", "2", "--embed",
                      "32", "--context", "16", "--recompute", "selective", "--batch-size", "8", "--num-batches", "1",
                      "--dataset", "synthetic-text", out=out)
    assert res.returncode == 0, res.stderr
    assert main(["calc", "memory", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        held, pred = r["measured"], r["predicted"]
        measured = held["model_states_total_bytes"] + held["saved_activations_peak_bytes"]
        assert pred["layout"] == "dp1 cp2 ring m1xb8 rc-selective"
        assert abs(pred["total_bytes"] - measured) <= 0.02 * measured
    assert main(["calc", "memory", str(out), "--workers", "2"]) == 2
    assert "leave out --workers" in capsys.readouterr().err
    assert main(["calc", "memory"]) == 2
    assert "needs --workers" in capsys.readouterr().err
