"""`paralab plot`: every kind from real run directories, as PNG and as a table; the timeline's contents."""
from __future__ import annotations

import pytest

from paralab.report import plots
from paralab.analysis.runs import load_run, load_runs
from paralab.cli import main

from report_runs import tiny_compare


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    out, p = tiny_compare(tmp_path_factory.getbasetemp())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / "runs"


def all_runs(runs_dir):
    return sorted(str(p) for p in runs_dir.iterdir())


def png_size(path):
    import matplotlib.image
    img = matplotlib.image.imread(path)
    return img.shape[1], img.shape[0]


# moe-load: tests/test_moe.py; grad-norm (runs with --clip-grad): tests/test_clip.py
@pytest.mark.parametrize("kind", [k for k in plots.KINDS if k not in ("moe-load", "grad-norm")])
def test_every_kind_draws_a_png(runs_dir, tmp_path, capsys, kind):
    runs = [str(runs_dir / "pipeline-w2"), str(runs_dir / "ddp-w2")] if kind == "timeline" else all_runs(runs_dir)
    out = tmp_path / f"{kind}.png"
    assert main(["plot", kind, *runs, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = png_size(out)
    assert width >= 500 and height >= 250
    assert f"wrote {out}" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no partial file left


def test_tables_without_output(runs_dir, capsys):
    assert main(["plot", "throughput", *all_runs(runs_dir)]) == 0
    out = capsys.readouterr().out
    for label in ("single w1", "ddp w1", "ddp w2", "pipeline w2"):
        assert label in out
    ddp2 = load_run(runs_dir / "ddp-w2")
    assert f"{ddp2.samples_per_s:.1f}" in out
    assert main(["plot", "split-time", str(runs_dir / "ddp-w2")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "rank", "data"] and len(lines) == 2 + 2  # header, rule, two ranks


def test_scaling_rows_ideal_and_speedup(runs_dir):
    rows = plots.scaling_rows(load_runs(all_runs(runs_dir)))
    ddp = {e["workers"]: e for e in rows if e["strategy"] == "ddp"}
    t1 = ddp[1]["seconds_per_iter"]
    assert ddp[2]["ideal"] == pytest.approx(t1 / 2)
    assert ddp[2]["speedup"] == pytest.approx(t1 / ddp[2]["seconds_per_iter"])
    assert ddp[2]["efficiency"] == pytest.approx(ddp[2]["speedup"] / 2)
    pipe = next(e for e in rows if e["strategy"] == "pipeline")
    assert pipe["baseline"] == "single w1"  # no 1-worker pipeline run: single is T1


def test_pipeline_timeline_has_microbatches_waits_and_the_ideal_schedule(runs_dir):
    run = load_run(runs_dir / "pipeline-w2")
    headers, rows = plots.timeline_table([run])
    col = {h: i for i, h in enumerate(headers)}
    kinds = {(r[col["rank"]], r[col["kind"]], r[col["mb"]]) for r in rows}
    for rank in (0, 1):
        for mb in (0, 1):
            assert (rank, "forward", mb) in kinds and (rank, "backward", mb) in kinds
    assert any(r[col["kind"]] == "idle" for r in rows)  # a stage waits for its peer
    (boxes, desc), why = plots.ideal_schedule_boxes(run)
    assert why is None and desc == "gpipe, 2 stages, 2 microbatches"
    labels = {(b[0], b[4]) for b in boxes if b[3] in ("forward", "backward")}
    assert labels == {(s, t) for s in (0, 1) for t in ("F0", "F1", "B0", "B1")}
    # ideal GPipe: stage 1 waits for stage 0's first forward before it starts
    assert any(b[0] == 1 and b[3] == "idle" and b[1] == 0 for b in boxes)


def test_ddp_timeline_shows_async_communication(runs_dir):
    run = load_run(runs_dir / "ddp-w2")
    headers, rows = plots.timeline_table([run])
    col = {h: i for i, h in enumerate(headers)}
    asyncs = [r for r in rows if r[col["kind"]] == "async"]
    assert {r[col["rank"]] for r in asyncs} == {0, 1}
    assert plots.ideal_schedule_boxes(run)[0] is None  # no schedule to simulate


def test_send_and_recv_without_a_completion_are_drawn_until_their_wait_not_as_overlap(runs_dir, tmp_path):
    """The pipeline's isend/irecv on gloo: the backend reports no completion, so each interval ends at its
    wait; the timeline calls them so (a dotted outline), the split and the trace never count them as overlap."""
    from paralab.analysis.trace import chrome_trace
    run = load_run(runs_dir / "pipeline-w2")
    headers, rows = plots.timeline_table([run])
    col = {h: i for i, h in enumerate(headers)}
    kinds = {r[col["kind"]] for r in rows}
    assert "unseen" in kinds and "async" not in kinds
    assert {r[col["name"]] for r in rows if r[col["kind"]] == "unseen"} <= {"send_act", "recv_act", "send_grad",
                                                                           "recv_grad"}
    assert all(run.split(k)["comm_async"] == 0 for k in run.ranks) and not run.overlaps_communication
    named = [e["name"] for e in chrome_trace(run.spans, 2)["traceEvents"] if e["ph"] == "X"]
    assert any(n.endswith("(until its wait: completion not reported)") for n in named)
    assert plots.plot_timeline([run], tmp_path / "t.png").stat().st_size > 0


def test_memory_uses_what_each_rank_measured_it_holds(runs_dir):
    pipe = load_run(runs_dir / "pipeline-w2")
    mem = plots.memory_by_rank(pipe)
    held = [pipe.details[str(r)]["stage_parameters"] for r in (0, 1)]
    assert sum(held) == pipe.get("parameters")
    for r in (0, 1):
        parts = mem[r]["parts"]
        # measured (run/held.py): fp32 weights, their gradients and momentum of the stage's parameters
        assert parts["parameters"] == parts["gradients"] == parts["optimizer state"] == (4.0 * held[r], False)
        # the step's saved activations, counted per storage over the whole step, against the stage's own
        # count (per microbatch at the end of its forward): the same tensors, counted two ways
        stage = pipe.details[str(r)]["peak_activation_bytes"]
        assert abs(parts["saved activations (peak)"][0] - stage) <= 0.05 * stage
        assert "not pipeline" in pipe.details[str(r)]["held"]["predicted"]["why_not"]  # ddp and fsdp only
    ddp = load_run(runs_dir / "ddp-w2")
    for r in (0, 1):  # beside what each rank holds, the planner's prediction for the run's layout
        held = ddp.details[str(r)]["held"]
        measured = held["model_states_total_bytes"] + held["saved_activations_peak_bytes"]
        assert held["predicted"]["layout"].startswith("dp2 ")
        assert abs(held["predicted"]["total_bytes"] - measured) <= 0.05 * measured
    run = load_run(runs_dir / "single-w1")
    assert "not single" in run.details["0"]["held"]["predicted"]["why_not"]  # the planner models ddp and fsdp
    single, p = plots.memory_by_rank(run)[0]["parts"], run.get("parameters")
    assert single["parameters"] == single["gradients"] == single["optimizer state"] == (4.0 * p, False)
    assert single["saved activations (peak)"][0] > 0 and not any(est for _, est in single.values())


@pytest.mark.parametrize("args, message", [
    (["throughput", "{tmp}"], "finished run directory"),
    (["throughput", "{tmp}/missing"], "does not exist"),
    (["timeline", "{ddp}", "--step", "999"], "has no step 999"),
    (["throughput", "{ddp}", "--step", "1"], "--step is for"),
    (["throughput", "{ddp}", "-o", "{tmp}/plot.txt"], ".png"),
    (["throughput", "{ddp}", "-o", "{tmp}/no/such/dir/p.png"], "does not exist"),
])
def test_plot_refuses_bad_input(runs_dir, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, ddp=runs_dir / "ddp-w2") for a in args]
    assert main(["plot", *args]) == 2
    assert message in capsys.readouterr().err


def test_unfinished_directories_are_skipped_with_a_warning(runs_dir, tmp_path, capsys):
    (tmp_path / "failed-run").mkdir()
    assert main(["plot", "throughput", str(runs_dir / "ddp-w2"), str(tmp_path / "failed-run")]) == 0
    out = capsys.readouterr()
    assert "skipping" in out.err and "ddp w2" in out.out
    assert main(["plot", "throughput", str(tmp_path / "failed-run")]) == 2


def test_compare_report_dir_hint(runs_dir, capsys):
    assert main(["plot", "throughput", str(runs_dir.parent)]) == 2
    assert "/runs/*" in capsys.readouterr().err


@pytest.mark.parametrize("processes", [1, 2])
def test_report_figures_drawn_together_name_the_one_that_fails(runs_dir, tmp_path, processes):
    """report/figures.py: in this process or in children of the forkserver, the same figures come out,
    and one that fails is named with its error while the others are drawn."""
    from paralab.report.figures import Figures
    runs = load_runs(all_runs(runs_dir))
    figures = Figures(tmp_path / "plots")
    assert figures.add(plots.plot_throughput, "throughput.png", runs) == tmp_path / "plots" / "throughput.png"
    figures.add(plots.plot_scaling, "scaling.png", [])  # nothing to draw: fails
    figures.add(plots.plot_split_time, "split_time.png", runs)
    failed = figures.draw(processes)
    assert failed == {"scaling.png": "ValueError: no run with a measured time per iteration"}
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["split_time.png", "throughput.png"]
    assert png_size(tmp_path / "plots" / "throughput.png")[0] > 300


def test_a_test_loss_that_differs_by_design_says_why(runs_dir):
    """The pipeline (VGG-11 with BatchNorm, 2 microbatches) updates BatchNorm's statistics once per microbatch,
    so its test loss is not single's: the report's note says so; the data-parallel run carries no note."""
    from paralab.report.page import by_design
    assert "BatchNorm's running statistics are updated once per microbatch (2 per step)" in \
        by_design(load_run(runs_dir / "pipeline-w2"))
    assert by_design(load_run(runs_dir / "ddp-w2")) == ""
