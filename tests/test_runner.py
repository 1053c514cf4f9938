"""The library API commands use: run a RunConfig in a child process, progress as events, results as data.

Also the pieces around it: progress events, the status line, `--train-args` as
config overrides, a config rendered back as the `paralab train` command that
makes it, and the record accessors plots and reports decide from.
"""
from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path

import pytest

from paralab.run import runner
from paralab.analysis.runs import Run
from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.progress import EVENTS_ENV, Progress, StatusLine

TINY = dict(width=0.125, dataset="synthetic", synthetic_size=256, batch_size=32, num_batches=3, eval_batches=1,
            eval_batch_size=64, log_every=3, timeout=30)


def tiny(**kw) -> RunConfig:
    return RunConfig(**{**TINY, **kw})


# ---------------------------------------------------------------- runner.run
def test_run_reports_progress_as_events_and_results_from_the_summary(tmp_path, monkeypatch):
    import tempfile
    events = []
    cfg = tiny(check=True, lr=1e-3).validate()
    scratch = tmp_path / "tmp"  # this run's own temporary folder: other runs on the machine leave theirs alone
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    made = []
    mkstemp = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: made.append(mkstemp(*a, **k)) or made[-1])
    res = runner.run(cfg, tmp_path / "run", events.append, log=tmp_path / "run.log", timeout=300)
    assert res.ok and res.returncode == 0 and res.error is None and res.check == "PASS"
    assert res.summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert res.summary["steps"] == 3
    kinds = [e["event"] for e in events]
    assert kinds[0] == "phase" and events[0]["phase"] == "starting"
    train = [e for e in events if e["event"] == "progress" and e["phase"] == "train"]
    assert [e["done"] for e in train] == [1, 2, 3] and {e["total"] for e in train} == {3}
    loss = [e for e in events if e["event"] == "loss"]
    assert [e["step"] for e in loss] == [3] and loss[0]["loss"] > 0
    phases = [e["phase"] for e in events if e["event"] == "phase"]
    assert phases == ["starting", "eval", "check"]  # after the test evaluation: the reference check
    # the child's output is kept for people, not parsed
    log = (tmp_path / "run.log").read_text()
    assert "records written" in log and '"strategy": "single"' in log
    assert [Path(path).parent for _, path in made] == [scratch] * 2  # the events and output files were made here...
    assert not list(scratch.glob("paralab-*"))  # ...and are gone


def test_a_failing_rank_comes_back_as_an_error_event(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALAB_FAULT", "0:1")
    errors = []
    res = runner.run(tiny(), tmp_path / "run", lambda e: errors.append(e) if e["event"] == "error" else None,
                     log=tmp_path / "run.log", timeout=300)
    assert res.status == "failed" and res.returncode == 1 and res.summary is None
    assert res.error == "RuntimeError: injected fault on rank 0 at step 1 (PARALAB_FAULT)"
    assert errors and errors[0]["rank"] == 0


def test_a_config_the_child_refuses_fails_with_its_message(tmp_path):
    res = runner.run(tiny(batch_size=7, workers=2, strategy="allreduce"), tmp_path / "run", timeout=120)
    assert res.status == "failed" and res.returncode == 2
    assert "must divide evenly" in res.error


def test_a_run_past_its_timeout_is_stopped(tmp_path):
    t0 = time.monotonic()
    res = runner.run(tiny(num_batches=10_000), tmp_path / "run", log=tmp_path / "run.log", timeout=4)
    assert res.status == "timeout" and res.returncode is None and "timed out after 4 s" in res.error
    assert time.monotonic() - t0 < 60
    assert "stopped after 4 s" in (tmp_path / "run.log").read_text()


def test_run_refuses_an_existing_run_and_manual_ranks(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match="already holds a run"):
        runner.run(tiny(), tmp_path)
    with pytest.raises(UsageError, match="by hand"):
        runner.run(tiny(world_size=2, rank=0), tmp_path / "other")


def test_line_reader_waits_for_complete_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = runner.LineReader(path)
    assert reader.lines() == []  # no file yet
    path.write_text('{"event": "a"}\n{"event": "b", "x"')
    assert reader.lines() == ['{"event": "a"}']
    with open(path, "a") as f:
        f.write(': 1}\nnot json\n')
    assert reader.lines() == ['{"event": "b", "x": 1}', "not json"]
    assert [runner._event(line) for line in ['{"event": "b"}', "not json", "[1]"]] == [{"event": "b"}, None, None]


def test_strategy_roles_come_from_the_classes(monkeypatch):
    from paralab.strategies import get_strategy, strategy_for
    strategy_for.cache_clear()
    assert strategy_for("baseline") == RunConfig().strategy
    assert strategy_for("scaling") == "ddp"
    assert strategy_for("no such role") is None
    monkeypatch.setattr(get_strategy("allreduce"), "roles", ("scaling",))  # registered before ddp: it wins
    strategy_for.cache_clear()
    try:
        assert strategy_for("scaling") == "allreduce"
    finally:
        strategy_for.cache_clear()


# ---------------------------------------------------------------- progress events, status line
def test_progress_writes_events_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    bar = Progress(2, "train", stream=io.StringIO())
    bar.update(1)
    bar.close()
    assert not path.exists()
    monkeypatch.setenv(EVENTS_ENV, str(path))
    bar = Progress(2, "eval", stream=io.StringIO())
    bar.update(1)
    bar.update(2)
    bar.event("loss", step=2, loss=0.5)
    bar.close()
    bar.close()
    Progress(2, "train", enabled=False, stream=io.StringIO()).update(1)  # other ranks: nothing
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events == [{"event": "progress", "phase": "eval", "done": 1, "total": 2},
                      {"event": "progress", "phase": "eval", "done": 2, "total": 2},
                      {"event": "loss", "step": 2, "loss": 0.5},
                      {"event": "phase_end", "phase": "eval", "done": 2, "total": 2}]


def test_status_line_without_a_terminal_prints_phase_changes():
    out = io.StringIO()
    line = StatusLine(stream=out)
    follow = line.follow("[1/2] ddp w2")
    for e in ({"event": "phase", "phase": "starting"}, {"event": "tick", "seconds": 1},
              {"event": "progress", "phase": "train", "done": 1, "total": 3},
              {"event": "progress", "phase": "train", "done": 2, "total": 3},
              {"event": "loss", "step": 3, "loss": 1.25},
              {"event": "progress", "phase": "train", "done": 3, "total": 3},
              {"event": "phase", "phase": "check"}):
        follow(e)
    line.final("[1/2] ddp w2", "ok, 0.100 s/iter", 3.0)
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[1] for ln in lines[:-1]] == ["starting", "train 1/3", "train 3/3", "check: reference"]
    assert "loss 1.2500" in lines[2]
    assert lines[-1] == "[1/2] ddp w2  ok, 0.100 s/iter  3.0s"


# ---------------------------------------------------------------- configs for commands
def test_train_args_become_config_overrides():
    from paralab.commands.compare import config_overrides
    assert config_overrides("") == {}
    over = config_overrides("--norm none --no-augment --schedule 1f1b --microbatches 8 --no-step-in-backward")
    assert over == {"norm": "none", "augment": False, "schedule": "1f1b", "microbatches": 8,
                    "step_in_backward": False}
    with pytest.raises(UsageError, match="may not set --out"):
        config_overrides("--out x", owned=("out",))
    with pytest.raises(UsageError, match="--train-args: unrecognized arguments: --bogus"):
        config_overrides("--bogus 1")
    with pytest.raises(UsageError, match="--train-args"):
        config_overrides('--norm "none')


def test_train_command_makes_the_same_config():
    from paralab.cli import build_parser, config_from_args
    from paralab.run.config import train_command
    cfg = RunConfig(strategy="pipeline", workers=2, width=0.25, check=True, augment=False, step_in_backward=False,
                    microbatches=4, schedule="1f1b", eval_batches=2, cores_per_worker=1, lr=0.02)
    text = train_command(cfg, "runs/x")
    assert text.startswith("paralab train pipeline --workers 2 ") and text.endswith("--out runs/x")
    assert "--model" not in text  # defaults are left out
    import shlex
    again = config_from_args(build_parser().parse_args(shlex.split(text)[1:]))
    assert dataclasses.replace(again, out=None) == cfg


def test_compare_gives_options_to_the_strategies_that_declare_them():
    from paralab.commands.compare import takes_option
    from paralab.strategies import get_strategy, strategy_names
    takes = {name for name in strategy_names() if takes_option(get_strategy(name), "microbatches")}
    staged = {name for name in strategy_names() if not getattr(get_strategy(name), "data_parallel", True)}
    assert takes and takes <= staged  # pipelines take them; a stage that runs the batch whole (model) does not
    assert {name for name in strategy_names() if takes_option(get_strategy(name), "bucket_mb")} == \
        {"ddp", "torch-ddp"}


# ---------------------------------------------------------------- what the records hold
def toy_run(details: dict, workers: int = 2, spans=None, steps=None, split=None) -> Run:
    summary = {"strategy": "toy", "workers": workers, "seconds_per_iter": 0.1, "samples_per_s": 640.0,
               "strategy_details": details, "warmup": 0,
               "split": split or {str(r): {"compute": 0.05} for r in range(workers)}}
    run = Run(Path("/nowhere/toy"), {"strategy": "toy", "workers": workers}, summary)
    run._spans, run._steps = spans or [], steps or []
    return run


def test_a_new_strategy_that_records_stages_is_drawn_as_a_pipeline():
    from paralab.report import plots
    from paralab.report.page import timeline_runs
    spans, steps = [], []
    for rank in (0, 1):
        steps.append({"rank": rank, "step": 0, "seconds": 0.1, "split": {}})
        for mb in (0, 1):
            t = 0.01 * mb + 0.02 * rank
            spans.append({"rank": rank, "step": 0, "category": "compute", "name": "forward", "t0": t, "t1": t + 0.01,
                          "args": {"mb": mb}, "bytes": 0})
            spans.append({"rank": rank, "step": 0, "category": "compute", "name": "backward", "t0": t + 0.05,
                          "t1": t + 0.07, "args": {"mb": mb}, "bytes": 0})
    details = {str(r): {"stage": r, "schedule": "1f1b", "microbatches": 2, "bubble": 0.25 + r / 10}
               for r in (0, 1)}
    run = toy_run(details, spans=spans, steps=steps)
    assert run.stages == {0: 0, 1: 1} and run.num_stages == 2
    assert run.pipeline == {"schedule": "1f1b", "microbatches": 2, "stages": 2}
    assert run.bubbles == {0: 0.25, 1: 0.35}
    assert run.label == "toy w2 1f1b m2"
    assert timeline_runs([run]) == [run]
    (boxes, desc), why = plots.ideal_schedule_boxes(run)
    assert why is None and desc == "1f1b, 2 stages, 2 microbatches"
    assert {b[4] for b in boxes if b[3] == "forward"} == {"F0", "F1"}
    # a stage that runs each batch whole (its own schedule name, one microbatch): model parallelism
    whole = toy_run({str(r): {"stage": r, "schedule": "naive", "microbatches": 1} for r in (0, 1)},
                    spans=spans, steps=steps)
    assert whole.label == "toy w2"
    assert plots.ideal_schedule_boxes(whole)[0][1] == "model parallelism, 2 stages, whole batch (no pipelining)"


def test_runs_without_stages_or_overlap_have_no_timeline_or_ideal_schedule():
    from paralab.report import plots
    from paralab.report.page import timeline_runs
    plain = toy_run({})
    assert plain.stages == {} and plain.pipeline is None and plain.bubbles == {}
    assert plain.label == "toy w2" and timeline_runs([plain]) == []
    assert plots.ideal_schedule_boxes(plain) == (None, "no pipeline stages recorded")
    overlapped = toy_run({}, split={"0": {"comm_async": 0.01}, "1": {}})
    assert timeline_runs([overlapped]) == [overlapped]


def test_speedup_baseline_is_a_parameter():
    from paralab.report import plots
    from paralab.report.page import results_table
    a1, a2 = toy_run({}, workers=1), toy_run({}, workers=2)
    a2.summary["seconds_per_iter"] = 0.05
    entries = [{"strategy": "toy", "workers": 1, "status": "ok"}, {"strategy": "toy", "workers": 2, "status": "ok"}]
    headers, rows = results_table(entries, {0: a1, 1: a2}, baseline="toy")
    assert headers[4] == "speedup over toy" and rows[1][4] == "2.00"
    rows = {e["workers"]: e for e in plots.scaling_rows([a1, a2], baseline="toy")}
    assert rows[2]["speedup"] == pytest.approx(2.0) and rows[2]["baseline"] == "toy w1"


def test_sweep_figures_are_public_plot_functions(tmp_path):
    from paralab.report import plots
    p = plots.plot_epoch_time([(16, {"epoch_s": 2.0, "epoch_no_data_s": 1.5}),
                               (32, {"epoch_s": 1.5, "epoch_no_data_s": 1.0})], tmp_path / "e.png")
    assert p.read_bytes()[:4] == b"\x89PNG"
    p = plots.plot_speedup([("weak, b=16", "o-", [(1, 1.0), (2, 1.8)])], [1, 2], "t", "speedup", tmp_path / "s.png")
    assert p.read_bytes()[:4] == b"\x89PNG"
