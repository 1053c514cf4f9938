"""paralab plan: the layouts it enumerates, its terms against calc's formulas and the simulator, its ranking,
its output, its refusals. Nothing trains; this-machine is built from a calibration written here."""
from __future__ import annotations

import json
import time

import pytest

from paralab.analysis.memory import memory_per_worker
from paralab.analysis.plan import PRESETS, Layout, Setting, gpt_workload, cnn_workload, enumerate_layouts, \
    load_cluster, make_plan, predict
from paralab.analysis.plan.calibrate import calibration, this_machine
from paralab.analysis.plan.cluster import REQUIRED, Cluster
from paralab.analysis.tensor import activation_total, gpt_flops_per_token
from paralab.cli import main
from paralab.strategies.pipeline.schedules import build_schedule, spec_of
from paralab.strategies.pipeline.simulate import simulate

H100 = PRESETS["h100-sxm"]
SMALL = dict(layers=12, embed=256, heads=8, context=128, vocab=512)


def small():
    return gpt_workload(**SMALL)


def test_gpt_workload_counts_what_calc_tp_counts():
    w = gpt_workload(96, 12288, 96, 2048, 50257)
    assert w.parameters == 175_221_817_344
    assert w.model_flops_per_sample() == pytest.approx(2048 * gpt_flops_per_token(96, 12288, 2048, 50257).value)


def test_cnn_workload_on_the_meta_device():
    w = cnn_workload("vgg11")
    assert w.parameters == 9_231_114  # VGG-11 with BatchNorm, as models/vgg.py says
    assert w.units[0].forward_flops == 2 * 3 * 9 * 64 * 32 * 32  # the first conv: 2 x Cin k^2 x output elements


@pytest.mark.parametrize("name,width", [("vgg11", 0.125), ("vgg11", 1.0), ("resnet18", 0.125),
                                        ("vgg16-cs1390-pool", 0.125)])
def test_cnn_workload_is_the_same_probed_on_the_cpu_or_the_meta_device(monkeypatch, name, width):
    """A small CNN is probed on the CPU, a large one on the meta device: both count the same."""
    from paralab.analysis.plan import workload
    monkeypatch.setattr(workload, "PROBE_ON_CPU_UP_TO", 0)
    on_meta = cnn_workload(name, width)
    monkeypatch.setattr(workload, "PROBE_ON_CPU_UP_TO", 10**12)
    on_cpu = cnn_workload(name, width)
    assert on_meta.units == on_cpu.units and any(u.kept_elements for u in on_cpu.units)


@pytest.mark.parametrize("b", [1, 3, 8])
def test_cnn_stage_activations_are_what_a_stage_keeps(b):
    """What a CNN's stage keeps for backward, against the saved-tensor probe on a real forward (CPU): per
    sample, plus BatchNorm's statistics per microbatch whatever its size, and, for a stage after the
    first, its received input, which the previous stage's last ReLU keeps too (the planner counted it
    once, and BatchNorm's statistics once per sample)."""
    import torch

    from paralab.models import build_model
    from paralab.run.held import parameter_storages
    from paralab.training.saved import SavedActivations
    w, model = cnn_workload("vgg11", 0.25), build_model("vgg11", width=0.25)
    for lo, hi in ((0, 6), (6, 14), (3, 9)):
        x = torch.randn(b, 3, 32, 32)
        with torch.no_grad():
            for unit in list(model)[:lo]:
                x = unit(x)
        probe = SavedActivations(parameter_storages([model]))
        with probe.watch():
            y = x.requires_grad_(lo > 0)  # received: a tensor of the stage's own
            for unit in list(model)[lo:hi]:
                y = unit(y)
        assert probe.live == w.activation_bytes(lo, hi, b, 1, False, "none", 4), (lo, hi, b)
        del y


def test_every_layout_divides_the_model_the_workers_and_the_batch():
    w, workers, batch = small(), 8, 16
    layouts = enumerate_layouts(w, workers, batch, devices_per_node=8)
    assert len(layouts) > 100
    for lay in layouts:
        assert lay.dp * lay.cp * lay.tp * lay.pp == workers
        assert SMALL["heads"] % lay.tp == 0 and lay.pp * lay.virtual <= SMALL["layers"]  # uneven stages allowed
        assert batch % lay.dp == 0 and lay.microbatch * lay.microbatches == batch // lay.dp
        if lay.zero >= 2:  # paralab's fsdp at ZeRO-2/3: with tp and pp, not cp; no accumulation without pp
            assert lay.cp == 1 and (lay.pp > 1 or lay.microbatches == 1)
        if lay.replicate > 1:  # HSDP: fsdp's dp split into replica groups of shards
            assert lay.zero >= 1 and lay.cp == 1 and 1 < lay.replicate < lay.dp and lay.dp % lay.replicate == 0
        if lay.pp == 1:
            assert lay.schedule is None
        elif spec_of(lay.schedule).virtual:
            assert lay.virtual >= 2 and lay.microbatches % lay.pp == 0
    kinds = {(lay.tp > 1, lay.pp > 1, lay.zero, lay.sp, lay.recompute) for lay in layouts}
    assert (True, True, 1, True, "selective") in kinds and (False, False, 3, False, "full") in kinds
    assert (True, True, 3, False, "none") in kinds and any(x.replicate > 1 and x.tp > 1 for x in layouts)
    pinned = enumerate_layouts(w, workers, batch, 8, fixed={"tp": 2, "schedule": "1f1b"})
    assert pinned and all(x.tp == 2 and x.schedule in (None, "1f1b") for x in pinned)


def test_model_states_agree_with_calc_memory(capsys):
    w = small()
    for zero in (0, 1, 2, 3):
        lay = Layout(dp=4, tp=1, pp=1, zero=zero, microbatch=4, microbatches=1)
        got = predict(w, lay, H100, Setting(16))
        argv = ["calc", "memory", "--parameters", str(w.parameters), "--workers", "4", "--optimizer", "adam",
                "--precision", "mixed", "--stage", str(zero), "--json"]
        if zero:
            argv += ["--unit-parameters", str(max(u.parameters for u in w.units))]
        if zero >= 2:
            argv.append("--step-in-backward")
        assert main(argv) == 0
        calc = json.loads(capsys.readouterr().out)[0]["bytes"]["peak"]
        buckets = w.parameters * 2 if zero == 0 else 0  # paralab's ddp keeps a 16-bit copy in its buckets
        assert got.memory_parts["model_states"] == pytest.approx(calc + buckets)
    lay = Layout(dp=2, tp=2, pp=1, zero=1, microbatch=4, microbatches=2)
    got = predict(w, lay, H100, Setting(16))
    want = memory_per_worker(w.parameters, 2, 1, "adam", "mixed", unit_parameters=max(u.parameters for u in w.units),
                             model_parallel=2)
    assert got.memory_parts["model_states"] == pytest.approx(want.peak)


def test_activations_are_korthikantis_for_the_whole_model():
    """Korthikanti et al.'s Table 2 for what each block keeps, and under recomputation one block's more: the
    block being recomputed holds what it would have kept until its backward is done."""
    w, s = small(), SMALL
    for rc in ("none", "selective", "full"):
        lay = Layout(dp=1, tp=1, pp=1, microbatch=4, microbatches=4, recompute=rc)
        got = predict(w, lay, H100, Setting(16))
        total = lambda layers, rc: activation_total(4, s["context"], s["embed"], s["heads"], layers, 1, False,  # noqa: E731
                                                    rc, s["vocab"]).value
        again = total(1, "none") - total(1, rc)  # one recomputed block's, from its recomputation to its backward
        assert got.memory_parts["activations"] == pytest.approx(total(s["layers"], rc) + again)  # 16-bit, as published
        assert (again > 0) == (rc != "none")


def test_the_bubble_is_the_simulators_on_per_stage_times():
    w = gpt_workload(8, 256, 8, 128, 50257)  # a large vocabulary: the last stage (the head) is the slowest
    cluster = Cluster("free-links", {"bf16": 100.0}, 80, 1000, 8, 1e9, 0, 1e9, 0, 1.0, "test")
    for sched, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        lay = Layout(dp=1, tp=1, pp=4, schedule=sched, virtual=v, microbatch=1, microbatches=8)
        got = predict(w, lay, cluster, Setting(8))
        stages = w.cut(4 * v)
        # each stage's matmuls at the rate, its blocks' elementwise bytes at the memory bandwidth (1000 GB/s)
        F = [sum(u.forward_flops for u in w.units[lo:hi]) / 100e12
             + w.elementwise_bytes(lo, hi, 1, 1, False, 2)[0] / 1000e9 for lo, hi in stages]
        split = spec_of(sched).split_backward  # paralab's W walks the activation gradients again: I = F, W = 2 F
        B = [(3 if split else 2) * f for f in F]
        kw = dict(input_time=[f for f in F], weight_time=[2 * f for f in F]) if split else {}
        timeline = simulate(build_schedule(sched, 4, 8, v), F, B, **kw)
        makespan = max(x.t1 for row in timeline for x in row)
        assert got.step - got.dp_comm - got.optimizer == pytest.approx(makespan, rel=1e-6)
        assert got.compute + got.bubble == pytest.approx(makespan, rel=1e-6)
        equal_stage = spec_of(sched).bubble(4, 8, v)
        assert got.bubble / makespan != pytest.approx(equal_stage, abs=1e-3)  # unequal stages: not the formula


def test_ranking_follows_the_link():
    w = gpt_workload(4, 512, 8, 256, 256)
    fast = Cluster("fast", {"bf16": 100.0}, 80, 1000, 8, 1e6, 0, 1e6, 0, 1.0, "test")
    slow = Cluster("slow", {"bf16": 100.0}, 80, 1000, 8, 0.01, 0, 0.01, 0, 1.0, "test")
    a = make_plan(w, fast, Setting(8), 2, top=50)
    assert a.ranked[0].layout.dp == 2  # data parallelism costs nothing here: no bubble, no tp collectives
    b = make_plan(w, slow, Setting(8), 2, top=50)
    assert b.ranked[0].layout.dp == 1  # gradients over a 10 Mb/s link: a pipeline's activations are cheaper
    for plan in (a, b):
        steps = [x.step for x in plan.ranked]
        assert steps == sorted(steps) and all(x.fits and (x.simulated or x.layout.pp == 1) for x in plan.ranked)


def test_json_output(capsys):
    code = main(["plan", "--model", "gpt", "--layers", "4", "--workers", "4", "--cluster", "a100-sxm", "--top", "3",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["ranked"]) == 3 and data["cluster"]["name"] == "a100-sxm"
    first = data["ranked"][0]
    assert first["step"] <= data["ranked"][1]["step"] and set(first) >= {"compute", "bubble", "memory", "mfu"}
    assert data["why"] and data["command"].startswith("paralab train")


def test_the_175b_example_gives_the_first_row_its_page_prints(capsys):
    """docs/plan.md's headline example, counted from the shape (nothing built): its first row is the layout
    and MFU the page prints (a sane ~48 % layout, not the 4 % one-microbatch zero-bubble layout an idle law
    used outside its range put first)."""
    import re
    from pathlib import Path
    row = re.compile(r"^ ?1  (\S.*?)\s{2,}\d+\s.*\s(\d+\.\d)\s+[\d.]+e\+\d+$", re.M)
    page = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text()
    layout, mfu = row.search(page).groups()
    code = main(["plan", "--model", "gpt", "--layers", "96", "--embed", "12288", "--heads", "96", "--context", "2048",
                 "--vocab", "50257", "--workers", "1024", "--cluster", "h100-sxm", "--global-batch", "1536",
                 "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "why:" in out and "175,221,817,344 parameters" in out
    assert row.search(out).groups() == (layout, mfu), out
    assert float(mfu) > 40


def test_an_idle_law_outside_its_range_gives_way_to_a_bound_that_holds():
    """ZB-H1's closed form needs m >= p (and T_W <= T_F + T_I): with one microbatch on 16 stages it is
    negative; the bound used instead is 1F1B's fill and drain, which the simulator never exceeds."""
    from paralab.analysis.plan.predict import makespan
    from paralab.strategies.pipeline.schedules import spec_of
    zb = spec_of("zb-h1").idle
    f, i, w = 1.0, 1.0, 3.0  # W dearer than F + I: the law's own range excluded too
    assert zb.value(16, 1, f, i, w) < 0 and zb.bounded(16, 1, 1, f, i, w) == 15 * (f + i + w)
    assert zb.bounded(4, 8, 1, 1.0, 1.0, 1.0) == zb.value(4, 1, 1.0, 1.0, 1.0)  # inside its range: the law
    for name in ("zb-h1", "zb-h2"):
        for p, m in ((4, 1), (4, 3), (8, 2)):
            simulated = makespan(name, p, m, 1, (1.0,) * p, (2.0,) * p, 0.0) - m * 3.0
            assert simulated <= spec_of(name).idle.bounded(p, m, 1, 1.0, 1.0, 1.0) + 1e-9, (name, p, m)


def test_the_first_pass_bounds_from_below_where_no_law_holds_and_counts_the_hosts_sends_where_one_does():
    """A zero-bubble schedule with fewer microbatches than stages has no closed form: the first pass gives a
    lower bound (the last stage's fill and work, the first stage's last weight gradient), said so, which the
    search shortlists apart (a bound from above kept the best small-batch layouts off the shortlist:
    tests/test_plan_property.py's 175B-b64). Where the law holds the first pass's pipeline carries each
    send's and receive's host time, as the simulation does, so a cluster with a dear send does not shortlist
    pipelines the simulator then ranks low."""
    import dataclasses
    w = gpt_workload(16, 1024, 16, 1024, 50257)
    for label in ("dp2 tp2 pp8 zb-h1 m4xb1", "dp1 tp4 pp8 zb-h2 m2xb2 rc-full", "dp1 tp2 pp16 zb-h1 m1xb8"):
        lay = Layout.parse(label)
        rough, exact = (predict(w, lay, H100, Setting(8), simulate_pipeline=sim) for sim in (False, True))
        assert rough.bounded and not exact.bounded, label
        assert 0.8 * exact.step < rough.step <= exact.step * (1 + 1e-12), label
    assert not predict(w, Layout.parse("dp1 tp1 pp8 zb-h1 m8xb1"), H100, Setting(8),
                       simulate_pipeline=False).bounded  # m = p: the law
    lay = Layout.parse("dp2 tp2 pp4 1f1b m16xb1")
    dear = dataclasses.replace(H100, p2p_overhead_us=500.0)  # the step nearly doubles
    (rough, exact), (rough_dear, exact_dear) = [[predict(w, lay, c, Setting(32), simulate_pipeline=sim).step
                                                 for sim in (False, True)] for c in (H100, dear)]
    assert exact_dear > 1.8 * exact
    assert abs(rough_dear / exact_dear - 1) < 0.05 and abs(rough / exact - 1) < 0.05


def refused(capsys, *argv) -> str:
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_bad_input_exits_2(capsys, tmp_path):
    assert "--pp 5: 5 stages exceed the 4 blocks" in refused(capsys, "--workers", "5", "--pp", "5",
                                                                   "--cluster", "h100-sxm")
    assert "--tp 3 does not divide the model" in refused(capsys, "--workers", "6", "--tp", "3",
                                                        "--cluster", "h100-sxm")
    err = refused(capsys, "--layers", "96", "--embed", "12288", "--heads", "96", "--context", "2048", "--vocab",
                  "50257", "--workers", "8", "--global-batch", "8", "--cluster", "h100-sxm")
    assert "no layout fits" in err and "the smallest found needs" in err
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"peak_tflops": {"bf16": 100}, "memory_gb": 80}))
    err = refused(capsys, "--workers", "4", "--cluster", str(f))
    assert "missing field(s) memory_gbs" in err and "source" in err
    assert "not a preset" in refused(capsys, "--workers", "4", "--cluster", str(tmp_path / "none.toml"))
    assert "--workers is required" in refused(capsys, "--cluster", "h100-sxm")
    assert "--global-batch must be positive" in refused(capsys, "--workers", "2", "--global-batch", "0",
                                                        "--cluster", "h100-sxm")
    assert "--microbatch 3 divides no replica's batch" in refused(capsys, "--workers", "8", "--global-batch", "8",
                                                                  "--microbatch", "3", "--cluster", "h100-sxm")


def test_a_plan_read_by_head_ends_without_a_traceback():
    """`paralab plan ... | head -2`: the reader closes the pipe early; the command ends as a shell's SIGPIPE
    does (141), with nothing on stderr. (The JSON of 200 rows, 0.2 MB, outgrows a pipe's buffer: its write
    meets the closed pipe.)"""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "paralab", "plan", "--workers", "8", "--global-batch", "8",
                             "--cluster", "h100-sxm", "--top", "200", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


GOOD_CLUSTER = dict(peak_tflops={"bf16": 312}, memory_gb=80, memory_gbs=2039, devices_per_node=8, intra_gbps=2400,
                    intra_latency_us=5, inter_gbps=200, inter_latency_us=10, efficiency=0.6, source="my notes")


@pytest.mark.parametrize("change,message", [
    ({"unit_overhead_us": "NaN"}, "unit_overhead_us must be a number, zero or more (got nan)"),
    ({"p2p_overhead_us": -1000}, "p2p_overhead_us must be a number, zero or more (got -1000)"),
    ({"inter_latency_us": "Infinity"}, "inter_latency_us must be a number, zero or more (got inf)"),
    ({"memory_gb": "80"}, "memory_gb must be a positive number (got '80')"),
    ({"intra_gbps": True}, "intra_gbps must be a positive number (got True)"),
    ({"efficiency": 1.5}, "efficiency must be a fraction in (0, 1] (got 1.5)"),
    ({"devices_per_node": 8.5}, "devices_per_node must be a positive integer (got 8.5)"),
    ({"peak_tflops": {"bf16": 0}}, "peak_tflops.bf16 must be a positive number (got 0)"),
    ({"crowding": -1}, "crowding must be a number, zero or more"),
    ({"source": 3}, "source must be a string"),
    ({"inter_gpbs": 100}, "unknown field 'inter_gpbs' (did you mean 'inter_gbps'?)"),
    ({"matmul": [[1e9, 0.5], [1e8, 0.6]]}, "matmul must be [[FLOPs, fraction of the peak], ...], FLOPs positive and "
                                           "ascending"),
    ({"matmul": [[1e9, 1.5]]}, "each fraction in (0, 1]"),
    ({"matmul": [[1e9, "NaN"]]}, "matmul must be"),
    ({"matmul": []}, "matmul must be"),
    ({"matmul": [1e9, 0.5]}, "matmul must be"),
])
def test_a_cluster_file_field_out_of_range_is_refused_by_name(capsys, tmp_path, change, message):
    """Every field of a cluster file checked as an option is: a string, NaN, inf or a negative time where a
    number belongs, exit 2 naming the field, and no plan printed (NaN: a table of nan; -1000 us: a step of
    -1237 ms, before)."""
    fields = {**GOOD_CLUSTER, **change}
    text = json.dumps(fields).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    f = tmp_path / "c.json"
    f.write_text(text)
    err = refused(capsys, "--workers", "8", "--cluster", str(f))
    assert message in err and "run the first" not in capsys.readouterr().out
    f.write_text(json.dumps(GOOD_CLUSTER))
    assert main(["plan", "--workers", "8", "--cluster", str(f), "--top", "1"]) == 0  # the file alone was wrong


def test_a_binary_cluster_file_is_refused(capsys, tmp_path):
    f = tmp_path / "c.json"
    f.write_bytes(bytes(range(256)) * 4)
    assert "not a text file" in refused(capsys, "--workers", "8", "--cluster", str(f))
    f.write_text("[1, 2]")
    assert "expected a table of fields, got list" in refused(capsys, "--workers", "8", "--cluster", str(f))


def test_cluster_file_toml_and_presets_cite_sources(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text("\n".join(f"{k} = {v}" for k, v in dict(
        memory_gb=40, memory_gbs=1555, devices_per_node=4, intra_gbps=800, intra_latency_us=5, inter_gbps=100,
        inter_latency_us=10, efficiency=0.5, source='"my notes"').items()) + "\n[peak_tflops]\nbf16 = 312\n")
    c = load_cluster(str(f))
    assert c.name == "mine" and c.rate("bf16") == pytest.approx(156e12) and set(REQUIRED) <= set(c.to_dict())
    for name, preset in PRESETS.items():
        assert len(preset.source) > 80, name
        if name != "cpu":
            assert "datasheet" in preset.source and "https://" in preset.source


def test_this_machine_from_a_cached_calibration(tmp_path, monkeypatch):
    from paralab.analysis.plan.calibrate import block_flops
    cal = {"dtype": "fp32", "matmul_flops": 1e11, "copy_bytes_per_s": 2e10, "unit_overhead_s": 5e-5, "block_flops": 5e10,
           "block_seconds": {"8": block_flops(8) / 4e10}, "block_flops_by_workers": {"4": 1e10},
           "link_gbps": 10.0, "link_latency_s": 1e-4, "cores": 2, "memory_bytes": 8e9, "cpu": "test CPU",
           "measured_at": "now"}
    cache = tmp_path / "cal.json"
    cache.write_text(json.dumps({"fp32": cal}))
    monkeypatch.setattr("paralab.analysis.plan.calibrate.measure", lambda *a, **k: pytest.fail("measured again"))
    # a cache from before the pipeline's per-action time: that alone is measured, once, and kept
    monkeypatch.setattr("paralab.analysis.plan.calibrate.p2p_time", lambda: 3e-4)
    got, where = calibration("fp32", cache)
    assert got == {**cal, "p2p_overhead_s": 3e-4} and "measured now" in where
    monkeypatch.setattr("paralab.analysis.plan.calibrate.p2p_time", lambda: pytest.fail("measured again"))
    cal = got
    got, where = calibration("fp32", cache)
    assert got == cal and str(cache) in where and "read from" in where
    c = this_machine(got, 4, where)
    assert c.peak("fp32") == pytest.approx(0.5e11)  # 4 workers share 2 cores
    # the block alone on 8 sequences 4e10 FLOP/s, 1e10 with 4 at once: 4 x slower, its fixed cost 4 x longer
    assert c.efficiency == pytest.approx(0.25) and c.rate("fp32") == pytest.approx(1.25e10)
    assert c.unit_overhead_us == pytest.approx(200)
    assert c.p2p_overhead_us == pytest.approx(300)  # alone: the replay on shared cores shares it
    assert c.devices_per_node == 4 and c.memory_gb == pytest.approx(2.0) and "test CPU" in c.source


def test_a_calibration_at_another_speed_scales_compute_and_keeps_the_link():
    """bench/plan.py predicts each run again at the machine's speed around it (calibrate.at_speed): a machine
    computing twice as slowly has every compute rate halved and every compute time doubled, and its link
    measurements unchanged, so a compute-only step doubles and a link-bound collective does not."""
    from paralab.analysis.plan.calibrate import at_speed, block_flops
    from paralab.analysis.plan import Layout, Setting, gpt_workload
    from paralab.analysis.plan.predict import predict
    cal = {"dtype": "fp32", "matmul_flops": 1e11, "copy_bytes_per_s": 2e10, "unit_overhead_s": 5e-5,
           "p2p_overhead_s": 3e-4, "block_flops": 5e10, "block_seconds": {"8": block_flops(8) / 4e10},
           "block_flops_by_workers": {"2": 2e10}, "link_gbps": 10.0, "link_latency_s": 1e-4, "cores": 2,
           "memory_bytes": 8e9, "cpu": "test CPU", "measured_at": "now"}
    slow = at_speed(cal, 2.0)
    assert slow["matmul_flops"] == 5e10 and slow["block_flops"] == 2.5e10 and slow["copy_bytes_per_s"] == 1e10
    assert slow["unit_overhead_s"] == 1e-4 and slow["p2p_overhead_s"] == 6e-4
    assert slow["block_seconds"]["8"] == 2 * cal["block_seconds"]["8"] and slow["block_flops_by_workers"]["2"] == 1e10
    assert (slow["link_gbps"], slow["link_latency_s"]) == (10.0, 1e-4) and cal["matmul_flops"] == 1e11  # a copy
    work, setting = gpt_workload(2, 128, 4, 64, 256), Setting(8, "fp32", "sgd-momentum")
    one = Layout(dp=1, tp=1, pp=1, microbatch=8)
    fast_step = predict(work, one, this_machine(cal, 2, "t"), setting)
    slow_step = predict(work, one, this_machine(slow, 2, "t"), setting)
    assert slow_step.compute == pytest.approx(2 * fast_step.compute)
    two = Layout(dp=2, tp=1, pp=1, microbatch=4)
    assert predict(work, two, this_machine(slow, 2, "t"), setting).dp_total == pytest.approx(
        predict(work, two, this_machine(cal, 2, "t"), setting).dp_total)


def test_report_page_from_the_plan_json(capsys, tmp_path):
    out = tmp_path / "page"
    code = main(["plan", "--model", "vgg11", "--workers", "8", "--cluster", "a100-sxm", "--global-batch", "256",
                 "--top", "4", "--report", str(out)])
    assert code == 0 and f"plan page: {out / 'report.html'}" in capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for i, r in enumerate(plan["ranked"], 1):  # every ranked layout, in order, with its predicted step
        assert f"| {i} | {r['layout']['label']} | {r['step'] * 1e3:.4g} |" in md
    assert plan["command"] in md and "samples/s" in md and "a100-sxm" in md
    assert page.count("data:image/png;base64,") == 2 and sorted(p.name for p in (out / "plots").iterdir()) == \
        ["memory.png", "step.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["page"]  # the staging directory was renamed, none left
    before = (out / "plan.json").read_text()
    assert "already exists" in refused(capsys, "--workers", "8", "--cluster", "a100-sxm", "--report", str(out))
    assert (out / "plan.json").read_text() == before


@pytest.mark.slow
def test_this_machine_measured_through_the_command_line(tmp_path):
    """The real calibration (matmuls, a gpt block on every worker, gloo all-reduces), cached, then reused."""
    from conftest import run_paralab
    cache = tmp_path / "cal.json"
    argv = ["plan", "--model", "gpt", "--workers", "2", "--cluster", "this-machine", "--calibration", str(cache),
            "--json", "--top", "2"]
    t0 = time.perf_counter()
    first = run_paralab(*argv)
    measuring = time.perf_counter() - t0
    assert first.returncode == 0, first.stderr
    cal = json.loads(cache.read_text())["fp32"]
    assert cal["matmul_flops"] > 1e8 and cal["link_gbps"] > 0 and cal["unit_overhead_s"] > 0
    plan = json.loads(first.stdout)
    assert plan["cluster"]["name"] == "this-machine" and plan["ranked"][0]["step"] > 0
    t0 = time.perf_counter()
    again = run_paralab(*argv)
    assert again.returncode == 0 and json.loads(again.stdout)["ranked"] == plan["ranked"]  # from the cache, same plan
    assert time.perf_counter() - t0 < measuring


def test_paralab_gpt_activations_are_what_its_blocks_keep():
    """The planner's count of what paralab's gpt keeps for backward (``activations="paralab"``) against
    the saved-tensor probe around a real forward, one process (tensor parallelism: the runs below)."""
    import torch

    from paralab.models import build_model
    from paralab.run.held import parameter_storages
    from paralab.training.saved import SavedActivations
    for b, s, h, a in ((2, 32, 64, 4), (3, 16, 96, 6)):
        model = build_model("gpt", layers=2, embed=h, heads=a, context=s)
        probe = SavedActivations(parameter_storages([model]))
        with probe.watch():
            loss = torch.nn.functional.cross_entropy(model(torch.zeros(b, s, dtype=torch.long)).flatten(0, 1),
                                                     torch.zeros(b * s, dtype=torch.long))
        work = gpt_workload(2, h, a, s, 256, activations="paralab")
        predicted = work.activation_bytes(0, len(work.units), b, 1, False, "none", 4)
        # left out of the count: the int64 tokens, positions and targets, and the loss's total weight
        indices = (2 * b * s + s) * 8 + 4
        assert probe.peak - indices == predicted, (b, s, h, a)
        del loss


@pytest.mark.parametrize("sp", [False, True])
def test_paralab_gpt_activations_under_tensor_parallelism(tmp_path, sp):
    from conftest import run_paralab
    b, s, h, a, t = 8, 32, 64, 4, 2
    res = run_paralab("train", "tp", "--workers", str(t), "--model", "gpt", "--layers", "2", "--embed", str(h),
                      "--heads", str(a), "--context", str(s), "--batch-size", str(b), "--num-batches", "1",
                      "--dataset", "synthetic-text", *(["--sequence-parallel"] if sp else []), out=tmp_path / "r")
    assert res.returncode == 0, res.stderr
    details = json.loads((tmp_path / "r" / "summary.json").read_text())["strategy_details"]
    work = gpt_workload(2, h, a, s, 256, activations="paralab")
    predicted = work.activation_bytes(0, len(work.units), b, t, sp, "none", 4)
    for rank in ("0", "1"):
        measured = details[rank]["held"]["saved_activations_peak_bytes"]
        assert abs(measured - predicted) <= 0.01 * predicted, (rank, measured, predicted)


def test_context_parallel_layouts_and_their_cost():
    import dataclasses

    from paralab.analysis.context import cp_messages
    from paralab.run.config import RunConfig
    w = gpt_workload(4, 128, 4, 64, 256, activations="paralab")
    lays = enumerate_layouts(w, 8, 16, 8)
    cps = [x for x in lays if x.cp > 1]
    assert {x.cp for x in cps} == {2, 4, 8} and not any(x.sp or x.zero > 1 for x in cps)
    assert {x.cp for x in cps if x.cp_method == "all-to-all" and x.tp == 1} == {2, 4}  # 4 heads: not 8
    assert all((4 // x.tp) % x.cp == 0 for x in cps if x.cp_method == "all-to-all")
    assert not [x for x in enumerate_layouts(cnn_workload("vgg11", 0.25), 8, 16, 8) if x.cp > 1]
    assert not [x for x in enumerate_layouts(gpt_workload(4, 128, 4, 60, 256), 8, 16, 8) if x.cp == 4]  # 60 % 8
    lay = next(x for x in cps if x.cp == 2 and x.tp == 1 and x.pp == 1 and x.cp_method == "all-to-all")
    words = lay.command(8).split()[2:]
    cfg = RunConfig.from_argv(words + ["--model", "gpt"])
    assert (cfg.cp, cfg.cp_method, cfg.workers) == (2, "all-to-all", 8)
    # Ulysses is synchronous: every all-to-all's bytes cross the link; the ring hides behind attention
    slow = dataclasses.replace(H100, intra_gbps=1.0, inter_gbps=1.0, intra_latency_us=0, inter_latency_us=0)
    setting = Setting(16, "fp32", "sgd-momentum")
    got = predict(w, lay, slow, setting)
    msgs = cp_messages(lay.microbatch, 64, 128, 4, 2, "all-to-all", 1, 4)
    wire = sum(size for _, size in msgs.values()) / 2  # half of each rank's tensor leaves it at cp 2
    assert got.cp_comm == pytest.approx(lay.microbatches * wire / (1e9 / 8))
    # at 2048 tokens a block's attention outlasts its ring messages over NVLink: all hidden
    long, ring = gpt_workload(4, 128, 4, 2048, 256), dataclasses.replace(lay, cp_method="ring")
    fast = dataclasses.replace(H100, intra_latency_us=0, inter_latency_us=0)
    assert predict(long, ring, fast, setting).cp_comm == 0.0 < predict(long, ring, slow, setting).cp_comm
    # each cp rank keeps the activations of its s / cp tokens
    one = dataclasses.replace(lay, cp=1, dp=8)
    assert got.memory_parts["activations"] == pytest.approx(predict(w, one, H100, setting).memory_parts["activations"] / 2)


def test_a_cp_group_spans_nodes_where_its_ranks_keep_long_chunks():
    """A cp x tp group larger than a node is listed where each rank keeps CP_ACROSS_NODES_TOKENS tokens or
    more (a ring step's transfer then hides under its attention), and pinned with --cp at any length."""
    from paralab.analysis.plan.layouts import CP_ACROSS_NODES_TOKENS
    assert CP_ACROSS_NODES_TOKENS == 1024
    long = enumerate_layouts(gpt_workload(2, 128, 8, 8192, 256), 64, 64, 4)
    spans = {(x.cp, x.tp) for x in long if x.cp * x.tp > 4}
    assert (8, 1) in spans and (2, 4) in spans and (8, 4) in spans  # 1,024 tokens a rank: across nodes
    assert not [c for c, _ in spans if 8192 // c < 1024]  # cp 16 keeps 512: listed only inside a node
    assert all(x.cp * x.tp <= 4 for x in long if x.cp == 16)
    short = gpt_workload(2, 128, 8, 1024, 256)
    assert all(x.cp * x.tp <= 4 for x in enumerate_layouts(short, 64, 64, 4) if x.cp > 1)
    pinned = enumerate_layouts(short, 64, 64, 4, fixed={"cp": 16, "tp": 2})
    assert pinned and all((x.cp, x.tp) == (16, 2) for x in pinned)  # 64 tokens a rank, across 8 nodes


def test_cp_messages_carry_grouped_query_keys_and_values_at_their_width():
    """Keys and values are h G / a wide under grouped-query attention: the ring's sends and Ulysses's k and v
    all-to-alls shrink by G / a, its q and output do not; the planner prices what they carry."""
    import dataclasses

    from paralab.analysis.context import cp_messages
    full = cp_messages(2, 1024, 512, 3, 4, "ring", 2, 2)
    gqa = cp_messages(2, 1024, 512, 3, 4, "ring", 2, 2, kv=512 * 2 // 8)
    assert full == cp_messages(2, 1024, 512, 3, 4, "ring", 2, 2, kv=512)
    assert {n: (c, b // 4) for n, (c, b) in full.items()} == gqa
    a2a, a2a_gqa = (cp_messages(2, 1024, 512, 3, 4, "all-to-all", 2, 2, kv=k) for k in (512, 128))
    assert {n: a2a[n][1] // (4 if n.startswith(("cp_a2a_k", "cp_a2a_v")) else 1) for n in a2a} == \
        {n: b for n, (_, b) in a2a_gqa.items()}
    # a slow link, nothing hidden: the ring's exposed time falls with the key/value heads
    slow = dataclasses.replace(H100, intra_gbps=1.0, inter_gbps=1.0, intra_latency_us=0, inter_latency_us=0)
    setting = Setting(16, "mixed", "adam")
    mha, gq = (gpt_workload(2, 512, 8, 1024, 256, kv_heads=g) for g in (8, 2))
    lay = next(x for x in enumerate_layouts(mha, 8, 16, 8) if x.cp == 4 and x.tp == 2 and x.cp_method == "ring")
    assert predict(gq, lay, slow, setting).cp_comm == pytest.approx(predict(mha, lay, slow, setting).cp_comm / 4,
                                                                    rel=1e-3)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_paralab_gpt_activations_recomputed(recompute):
    """What --recompute keeps of paralab's gpt blocks (training/recompute.py), against the planner's count."""
    import torch

    from paralab.analysis.plan.workload import paralab_block_elements
    from paralab.models import build_model
    from paralab.training import recompute as rc
    b, s, h, a = 2, 32, 64, 4
    model = rc.apply(build_model("gpt", layers=2, embed=h, heads=a, context=s), recompute)
    x = model[0](torch.zeros(b, s, dtype=torch.long)).detach().requires_grad_()
    with rc.measure_saved(model) as meter:
        model[2](model[1](x)).sum()
    work = gpt_workload(2, h, a, s, 256, activations="paralab")
    counted = 4 * 2 * paralab_block_elements(b, s, h, a, 1, False, recompute)
    assert meter.bytes == counted == work.activation_bytes(1, 3, b, 1, False, recompute, 4)
    assert counted < 4 * 2 * paralab_block_elements(b, s, h, a, 1, False)


def test_hsdp_and_sharding_under_a_pipeline():
    """HSDP holds model states over its shard group and sends only the shard across replica groups; ZeRO-3
    under a pipeline holds the stage whole for the step (ZeRO-1's peak plus its own shard; ZeRO-2's with one
    microbatch)."""
    import dataclasses
    w, setting = small(), Setting(16, "fp32", "adam")
    fsdp = Layout(dp=4, tp=1, pp=1, zero=3, microbatch=4, microbatches=1)
    hsdp = dataclasses.replace(fsdp, replicate=2)
    a, b = predict(w, fsdp, H100, setting), predict(w, hsdp, H100, setting)
    want = memory_per_worker(w.parameters, 2, 3, "adam", "fp32", unit_parameters=max(u.parameters for u in w.units),
                             step_in_backward=True)
    assert b.memory_parts["model_states"] == pytest.approx(want.peak)
    assert b.memory_parts["model_states"] > a.memory_parts["model_states"]
    assert "--replicate 2" in hsdp.command(4) and "hsdp2x2" in hsdp.label()
    cross = dataclasses.replace(H100, devices_per_node=2)  # shard groups inside a node, replicas across
    assert predict(w, hsdp, cross, setting).dp_total < predict(w, fsdp, cross, setting).dp_total
    piped = Layout(dp=2, tp=1, pp=2, zero=3, schedule="1f1b", microbatch=2, microbatches=4)
    one = predict(w, dataclasses.replace(piped, zero=1), H100, setting).memory_parts["model_states"]
    stage = max(sum(u.parameters for u in w.units[lo:hi]) for lo, hi in w.cut(2))
    assert predict(w, piped, H100, setting).memory_parts["model_states"] == pytest.approx(one + stage / 2 * 4)
    # one microbatch: its backward is the step's last, each unit's gradient reduced in it as it completes,
    # so ZeRO-2's peak (stepped after backward) on each rank, with its own largest unit's working set
    single = dataclasses.replace(piped, zero=2, microbatch=8, microbatches=1)
    two, three = (predict(w, dataclasses.replace(single, zero=z), H100, setting) for z in (2, 3))
    for r, (lo, hi) in enumerate(w.cut(2)):
        params = sum(u.parameters for u in w.units[lo:hi])
        zero2 = memory_per_worker(params, 2, 2, "adam", "fp32", unit_parameters=max(u.parameters for u in w.units[lo:hi]))
        assert two.memory_by_rank[r][0] == pytest.approx(zero2.peak)
        assert three.memory_by_rank[r][0] == pytest.approx(zero2.peak + params / 2 * 4)



def test_a_pipelines_send_or_receive_is_measured_through_the_executor():
    """Two processes run a tiny pipeline through paralab's executor: what each send or receive costs the
    processor beside compute and waiting is positive and far below a millisecond-scale step's compute."""
    from paralab.analysis.plan.calibrate import p2p_time
    t = p2p_time()
    assert 1e-6 < t < 0.05


@pytest.mark.parametrize("pins", [["--tp", "2", "--pp", "2", "--schedule", "1f1b", "--microbatch", "2"],
                                  ["--zero", "3", "--pp", "1", "--tp", "1"],
                                  ["--experts", "4", "--top-k", "2", "--ep", "2", "--pp", "1", "--tp", "1",
                                   "--zero", "0"]],
                         ids=["tp-pp", "zero3", "moe"])
def test_the_printed_command_makes_the_planned_run(capsys, tmp_path, pins):
    """The first row's command, pasted (with one step on this machine's data), trains the planned model with its
    shape, the batch and every dimension of the layout: the run's own config.json says so."""
    import shlex

    from conftest import run_paralab
    shape = ["--model", "gpt", "--layers", "4", "--embed", "32", "--heads", "4", "--context", "16"]
    assert main(["plan", *shape, "--workers", "4", "--global-batch", "8", "--cluster", "h100-sxm", "--top", "1",
                 "--json", *pins]) == 0
    plan = json.loads(capsys.readouterr().out)
    words = shlex.split(plan["command"])
    assert words[:2] == ["paralab", "train"]
    r = run_paralab(*words[1:], "--num-batches", "1", "--dataset", "synthetic-text", "--eval-batches", "1",
                    out=tmp_path / "run", fast=False)
    assert r.returncode == 0, plan["command"] + "\n" + r.stderr[-3000:]
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    layout = plan["ranked"][0]["layout"]
    assert (cfg["model"], cfg["layers"], cfg["embed"], cfg["heads"], cfg["context"]) == ("gpt", 4, 32, 4, 16)
    assert cfg["batch_size"] == 8 and cfg["workers"] == 4 and cfg["optimizer"] == "adam"
    assert (cfg["tp"], cfg["pp"], cfg["cp"], cfg["ep"]) == (layout["tp"], layout["pp"], layout["cp"], layout["ep"])
    assert cfg["strategy"] == ("ddp" if layout["zero"] == 0 else "fsdp") and cfg["recompute"] == layout["recompute"]
    if layout["zero"]:
        assert cfg["zero_stage"] == layout["zero"] and cfg["replicate"] == layout["replicate"]
    if layout["pp"] > 1:
        assert (cfg["schedule"], cfg["microbatches"], cfg["virtual_stages"]) == (
            layout["schedule"], layout["microbatches"], layout["virtual"])
    if "--experts" in pins:
        assert (cfg["experts"], cfg["top_k"]) == (4, 2)


@pytest.mark.parametrize("work,workers", [(gpt_workload(8, 256, 8, 512, 256), 64),
                                          (gpt_workload(4, 128, 4, 64, 256, experts=4, top_k=2), 16),
                                          (cnn_workload("vgg11", 0.25), 8)], ids=["gpt", "moe", "vgg"])
def test_every_label_the_planner_prints_parses_back_to_its_layout(work, workers):
    lays = enumerate_layouts(work, workers, 64, 8)
    assert len(lays) > 20
    for x in lays:
        assert Layout.parse(x.label()) == x, x.label()


def test_a_named_layout_is_evaluated_fitting_or_not_and_placed(capsys):
    """--layout: the search's first row is placed first with the same prediction; a layout too big for the
    device still gets its row and how much it lacks; a label that is not a layout, or that the workers do not
    divide, exits 2 saying which."""
    shape = ["--model", "gpt", "--layers", "8", "--embed", "512", "--heads", "8", "--context", "512",
             "--workers", "16", "--global-batch", "32", "--cluster", "a100-sxm"]
    assert main(["plan", *shape, "--json", "--top", "1"]) == 0
    first = json.loads(capsys.readouterr().out)["ranked"][0]
    assert main(["plan", *shape, "--json", "--layout", first["layout"]["label"]]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rank"] == 1 and got["fits"] and got["evaluated"]["step"] == first["step"]
    assert got["command"].startswith("paralab train") and "--model gpt" in got["command"]
    big = ["--model", "gpt", "--layers", "96", "--embed", "12288", "--heads", "96", "--context", "2048",
           "--workers", "8", "--global-batch", "8", "--cluster", "h100-sxm"]
    assert main(["plan", *big, "--layout", "dp8 m1xb1"]) == 0
    out = capsys.readouterr().out
    assert "does not fit: needs" in out and "GB more than the 72 GB usable" in out and "dp8 m1xb1" in out
    assert "it does not fit, so the search leaves it out" in out
    assert "'tq2' is not a word of a layout" in refused(capsys, *shape, "--layout", "dp8 tq2")
    assert "dp x cp x tp x pp = 8, not the 16 workers" in refused(capsys, *shape, "--layout", "dp8 m1xb4")
    assert "pp2 needs its schedule" in refused(capsys, *shape, "--layout", "dp8 pp2 m1xb4")
    assert "--layout names every dimension" in refused(capsys, *shape, "--layout", "dp16 m1xb2", "--tp", "2")


def test_layouts_evaluated_one_after_another_share_the_unpinned_search(monkeypatch):
    """evaluate() keeps its last unpinned search: a second layout of the same model, cluster, batch and workers
    is placed in it (no new search) exactly as a fresh search places it; another batch searches again."""
    from dataclasses import replace

    from paralab.analysis.plan import search
    work, cluster = gpt_workload(layers=8, embed=512, heads=8, context=512, vocab=50257), PRESETS["a100-sxm"]
    searches = []
    real = search.make_plan
    monkeypatch.setattr(search, "make_plan", lambda *a, **k: searches.append(a) or real(*a, **k))
    monkeypatch.setattr(search, "_LAST_SEARCH", [])
    first = search.make_plan(work, cluster, Setting(32), 16, top=2).ranked
    a = search.evaluate(work, cluster, Setting(32), 16, first[0].layout)
    b = search.evaluate(work, cluster, Setting(32), 16, first[1].layout)
    assert len(searches) == 2 and a.plan is b.plan and (a.rank, b.rank) == (1, 2)
    search._LAST_SEARCH.clear()
    fresh = search.evaluate(work, cluster, Setting(32), 16, first[1].layout)
    assert (fresh.rank, fresh.rank_all, fresh.prediction.step) == (b.rank, b.rank_all, b.prediction.step)
    doubled = replace(first[1].layout, microbatches=2 * first[1].layout.microbatches)
    search.evaluate(work, cluster, Setting(64), 16, doubled)  # another batch: its own search
    assert len(searches) == 4


def test_a_layout_for_other_workers_is_refused_before_this_machine_is_measured(capsys, tmp_path):
    """The layout's words and its product are checked first: no calibration runs (and none is cached) for a
    layout that cannot be evaluated."""
    cache = tmp_path / "calibration.json"
    err = refused(capsys, "--workers", "8", "--cluster", "this-machine", "--calibration", str(cache),
                  "--layout", "dp8 tp3")
    assert "dp x cp x tp x pp = 24, not the 8 workers" in err and "change the layout's degrees" in err
    assert "is not a word of a layout" in refused(capsys, "--workers", "8", "--cluster", "this-machine",
                                                   "--calibration", str(cache), "--layout", "dp8 tq2")
    assert not cache.exists()


@pytest.mark.slow
@pytest.mark.parametrize("example", ["mixtral", "llama", "llama-128k"])
def test_the_pages_other_examples_give_the_first_row_they_print(capsys, example):
    """docs/plan.md's Mixtral-like and Llama 3 405B examples, at 8K and 128K, run as printed: their first row's
    layout and MFU are the page's (the Mixtral table's first line; the Llama paragraphs' "first row is ...,
    MFU ...")."""
    import re
    import shlex
    from pathlib import Path
    page = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text()
    flat = " ".join(page.replace("\\\n", " ").split())  # a command continued over lines, joined
    if example == "mixtral":
        command = re.search(r"(paralab plan --model gpt --layers 32 .*?--global-batch 256)", flat).group(1)
        layout, mfu = re.search(r"\| (dp\S.*?) \| \d+ \|.*?\| ([\d.]+) % \|", page.split("The first three:")[1]).groups()
    elif example == "llama":
        command = re.search(r"(paralab plan --model gpt --layers 126 .*?--top 5)", flat).group(1)
        layout, mfu = re.search(r"first row is `([^`]+)`, MFU ([\d.]+) %", flat).groups()
    else:
        command = re.search(r"(paralab plan --model gpt --layers 126 [^`]*?--context 131072 [^`]*?--top 5)",
                            flat).group(1)
        layout, mfu = re.search(r"at 128K the first row is `([^`]+)`, MFU ([\d.]+) %", flat).groups()
    assert main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    first = re.search(r"^ ?1  (\S.*?)\s{2,}\S+\s.*\s(\d+\.\d)\s+[\d.]+e\+\d+$", out, re.M)
    assert first.groups() == (layout, mfu), out
    if example == "llama-128k":  # the published layout, pinned as the page prints it, at the MFU it says
        pinned = re.search(r"(paralab plan --model gpt --layers 126 [^`]*?--context 131072 [^`]*?--layout \"[^\"]+\")",
                           flat).group(1)
        said = re.search(r"pinned as `--layout \"([^\"]+)\"`, is predicted at ([\d.]+) %", flat).groups()
        assert main(shlex.split(pinned)[1:]) == 0
        out = capsys.readouterr().out
        row = re.search(r"^1  (\S.*?)\s{2,}\S+\s.*\s(\d+\.\d)\s+[\d.]+e\+\d+$", out, re.M)
        assert row.groups() == said and said[0] in pinned, out


@pytest.mark.slow
def test_the_llama_paragraphs_pinned_layouts_give_what_it_says(capsys):
    """docs/plan.md's Llama 3 paragraph: the published layout pinned with 4 virtual stages, 2, and on plain
    1F1B, each predicted with the MFU the page prints, none fitting, with the activations it says; and the
    published 400 TFLOP/s per GPU is the page's share of the H100's dense peak."""
    import re
    import shlex
    from pathlib import Path
    page = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text()
    flat = " ".join(page.replace("\\\n", " ").split())
    command = shlex.split(re.search(r"(paralab plan --model gpt --layers 126 .*?--top 5)", flat).group(1))[1:]
    command = command[:command.index("--top")]
    said = re.search(r"Pinned with 4 virtual stages, `--layout \"([^\"]+)\"`, the planner predicts ([\d.]+) % "
                     r"\(2 virtual stages ([\d.]+) %, plain 1F1B ([\d.]+) %", flat)
    interleaved, v4, v2, plain = said.groups()
    one_f_one_b = re.search(r"on plain 1F1B \(`--layout \"([^\"]+)\"`", flat).group(1)
    activations = re.search(r"keeps ([\d.]+) GB of activations .*?\), interleaved ([\d.]+) GB", flat).groups()
    assert f"{400 / 989.4:.1%}" == "40.4%" and "400 TFLOP/s per GPU, 40.4 % of the dense peak" in flat
    for layout, mfu, kept in ((interleaved, v4, activations[1]), (interleaved.replace(" v4 ", " v2 "), v2, None),
                              (one_f_one_b, plain, activations[0])):
        assert main(command + ["--layout", layout]) == 0
        out = capsys.readouterr().out
        row = re.search(r"^1  (\S.*?)\s{2,}\S+\s.*\s(\d+\.\d)\s+[\d.]+e\+\d+$", out, re.M)
        assert row.groups() == (layout, mfu), out
        needs = re.search(r"does not fit: needs [\d.]+ GB per device \(model states [\d.]+ GB, activations "
                          r"([\d.]+) GB\)", out)
        assert needs, out
        if kept:  # as the page rounds it
            assert round(float(needs.group(1)), len(kept.partition(".")[2])) == float(kept), (kept, needs.group(1))


def test_a_calibration_file_that_is_not_one_is_refused_not_replaced(capsys, tmp_path):
    """--calibration FILE naming a file of the user's: refused before anything is measured, the file kept."""
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    err = refused(capsys, "--workers", "2", "--cluster", "this-machine", "--calibration", str(notes))
    assert "is not a calibration file paralab wrote" in err and notes.read_text() == '{"mine": 1}\n'
    assert "is not a calibration file" in refused(capsys, "--workers", "2", "--cluster", "this-machine",
                                                  "--calibration", str(tmp_path))


def test_the_blocks_rate_is_the_slope_above_its_measured_fixed_cost():
    """fit_block recovers the rate of exact times t(b) = fixed + b x flops / rate, whatever the fixed cost."""
    from paralab.analysis.plan.calibrate import block_flops, fit_block
    for fixed in (0.0, 6e-4, 2e-3):
        times = {str(b): fixed + block_flops(b) / 7e10 for b in (1, 2, 4, 8)}
        assert fit_block(times, fixed) == pytest.approx(7e10)
