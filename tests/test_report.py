"""`paralab compare` (table, report, merged trace, failure isolation), the report module, `paralab sweep`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paralab.analysis.runs import Run, load_run
from paralab.report.page import Report, markdown_table, merge_traces, results_table, text_table

from conftest import run_paralab
from report_runs import TINY, run_compare, tiny_compare


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out, p = tiny_compare(tmp_path_factory.getbasetemp())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p


def test_compare_writes_every_row_and_file(report):
    out, p = report
    data = json.loads((out / "results.json").read_text())
    rows = {(r[0], r[1]): dict(zip(data["headers"], r)) for r in data["rows"]}
    # default worker counts: single only at 1, pipeline (splits the model) only at 2
    assert set(rows) == {("single", 1), ("ddp", 1), ("ddp", 2), ("pipeline", 2)}
    assert any("pipeline at 1 worker" in x for x in data["left_out"])
    assert any("single at 2 workers" in x for x in data["left_out"])
    for row in rows.values():
        assert row["check"].startswith("PASS"), row
        assert float(row["s/iter"]) > 0 and float(row["samples/s"]) > 0
        assert 0 <= float(row["test acc %"]) <= 100
    single = load_run(out / "runs" / "single-w1")
    ddp2 = load_run(out / "runs" / "ddp-w2")
    assert rows[("single", 1)]["speedup over single"] == "1.00"
    assert float(rows[("ddp", 2)]["speedup over single"]) == pytest.approx(
        single.seconds_per_iter / ddp2.seconds_per_iter, abs=0.006)
    assert float(rows[("ddp", 2)]["samples/s"]) == pytest.approx(ddp2.samples_per_s, abs=0.06)
    # options reach every run: --train-args, core pinning (auto); microbatches and buckets only the runs
    # whose strategy declares them
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for name in ("single-w1", "ddp-w2", "pipeline-w2"):
        cfg = load_run(out / "runs" / name).config
        assert cfg["synthetic_size"] == 512 and cfg["num_batches"] == 4
        assert cfg["bucket_mb"] == (0.05 if name.startswith("ddp") else 25.0)
        assert cfg["cores_per_worker"] == (cores // 2 or None)
        assert cfg["microbatches"] == (2 if name.startswith("pipeline") else 1)
    for name in ("report.html", "report.md", "trace.json", "plots/throughput.png", "plots/scaling.png",
                 "plots/split_time.png", "plots/memory.png", "plots/timeline_pipeline-w2.png",
                 "plots/timeline_ddp-w2.png", "logs/ddp-w2.log"):
        assert (out / name).is_file(), name
    # runs whose references are the same share one (check/kept.py): ddp at 1 worker replays single's one
    # shard; the folder they shared is not part of the report, nor of the commands it shows
    assert "is the one an earlier run trained" in (out / "logs" / "ddp-w1.log").read_text()
    for name in ("single-w1", "ddp-w2", "pipeline-w2"):
        assert "check: the single-process reference trains beside the run" in (out / "logs" / f"{name}.log").read_text()
    assert not (out / "check-cache").exists()
    assert all("--check-cache" not in e["command"] for e in data["entries"])
    # written in a temporary directory and renamed at the end: nothing else left beside it
    assert [d.name for d in out.parent.iterdir() if d.name.startswith(".tiny-compare")] == []
    # the table is printed too, and the progress display named the runs and their steps
    assert "speedup over single" in p.stdout
    assert "[4/4" in p.stderr and "train 4/4" in p.stderr


def test_report_markdown_and_html_hold_the_table_commands_and_environment(report):
    out, _ = report
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    for text in (md, html):
        assert "paralab compare" in text and "paralab train ddp --workers 2" in text
        assert "torch" in text and "cores_available" in text
        assert "pipeline" in text and "left out" in text and "to include it" in text
    # what was left out: one compact row each (layout, why in a line, the option that includes it)
    row = next(line for line in md.splitlines() if line.startswith("| pipeline at 1 worker |"))
    assert row.endswith("| --workers 1,2 |"), row
    table1 = md.split("## Throughput")[0]
    assert table1.count("| ddp |") == 2 and table1.count("| pipeline |") == 1
    assert "](plots/throughput.png)" in md
    # self-contained: every image inline, nothing fetched
    assert html.count("<img ") == html.count('src="data:image/png;base64,') >= 6
    assert "http://" not in html.replace("https://ui.perfetto.dev", "")
    assert "<script" not in html


def test_merged_trace_has_one_process_per_run_and_one_track_per_rank(report):
    out, _ = report
    trace = json.loads((out / "trace.json").read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    assert sorted(names.values()) == sorted(["single w1", "ddp w1", "ddp w2", "pipeline w2 gpipe m2"])
    for pid, label in names.items():
        threads = {e["tid"]: e["args"]["name"] for e in ev if e["pid"] == pid and e.get("name") == "thread_name"}
        workers = 2 if "w2" in label else 1
        assert {f"rank {r}" for r in range(workers)} <= set(threads.values())
        spans = [e for e in ev if e["pid"] == pid and e["ph"] == "X"]
        assert {e["tid"] % 1000 for e in spans} == set(range(workers))
        assert all(e["dur"] >= 0 for e in spans)
    ddp = next(p for p, n in names.items() if n == "ddp w2")
    assert any(e["pid"] == ddp and e["ph"] == "X" and e["tid"] >= 1000 and e["args"].get("async") for e in ev)


def test_failed_run_is_reported_and_the_matrix_goes_on(tmp_path):
    out = tmp_path / "r"
    p = run_compare(out, "--strategies", "allreduce", "--no-check", *TINY, env={"PARALAB_FAULT": "1:1"})
    assert p.returncode == 1, p.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    rows = {r[1]: dict(zip(data["headers"], r)) for r in data["rows"]}
    assert float(rows[1]["s/iter"]) > 0 and rows[1]["note"] == ""
    assert rows[2]["s/iter"] == "-" and "injected fault" in rows[2]["note"]
    assert "injected fault" in (out / "report.md").read_text()
    assert (out / "logs" / "allreduce-w2.log").read_text().count("injected fault") >= 1


def test_no_share_references_trains_one_in_every_run(tmp_path):
    """Shared by default (the session's comparison: ddp at 1 worker loads single's); not with the flag."""
    out = tmp_path / "r"
    p = run_compare(out, "--strategies", "single,ddp", "--workers", "1", "--no-share-references", *TINY)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in ("single-w1", "ddp-w1"):
        assert "check: the single-process reference trains beside the run" in (out / "logs" / f"{name}.log").read_text()


@pytest.mark.parametrize("args, message", [
    (["--strategies", "nope"], "unknown strategy"),
    (["--workers", "0"], "--workers"),
    (["--workers", "two"], "--workers"),
    (["--strategies", "single", "--workers", "2"], "nothing to run"),
    (["--train-args=--out elsewhere"], "may not set --out"),
    (["--train-args=--check-cache kept"], "may not set --check-cache"),
    (["--train-args=--bogus 1"], "--train-args"),
    (["--batch-size", "7", "--strategies", "allreduce"], "divide evenly"),
    (["--cores-per-worker", "64"], "cores"),
])
def test_compare_refuses_bad_input_before_running(tmp_path, capsys, args, message):
    from paralab.cli import main
    out = tmp_path / "r"
    assert main(["compare", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_compare_refuses_an_existing_out(tmp_path, capsys):
    from paralab.cli import main
    assert main(["compare", "--out", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_dry_run_lists_the_matrix(tmp_path):
    from paralab.strategies import get_strategy, strategy_names
    p = subprocess.run([sys.executable, "-m", "paralab", "compare", "--dry-run", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    # every registered strategy appears: new strategies join the comparison by registering; by default
    # the baseline runs at 1 worker and every other strategy at 2 (its 1-worker run is left out, with why)
    for name in strategy_names():
        workers = [ln.split("--workers ")[1].split()[0] for ln in lines if ln.startswith(f"paralab train {name} ")]
        if name == "single":
            assert workers == ["1"]
        elif hasattr(get_strategy(name), "for_devices"):  # one process driving GPUs (torch-dp): --gpus 2
            assert workers == ["1"] or f"leaving out {name} at 2 workers" in p.stderr, name
            assert f"leaving out {name} at 1 worker" in p.stderr
        else:  # at 2, unless it refuses the default setting (then it says why)
            assert workers == ["2"] or f"leaving out {name} at 2 workers" in p.stderr, name
            assert f"leaving out {name} at 1 worker" in p.stderr
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- report module units
def _run(strategy, workers, spi, acc=0.5, check="PASS"):
    summary = {"strategy": strategy, "workers": workers, "seconds_per_iter": spi, "samples_per_s": 64 / spi,
               "test_loss": 1.0, "test_accuracy": acc, "check": {"result": check, "max_weight_dev": 0.0,
                                                                  "max_output_dev": 2e-6}}
    return Run(__import__("pathlib").Path(f"/x/{strategy}-{workers}"), {}, summary)


def test_results_table_speedup_failures_and_baseline():
    entries = [{"strategy": "single", "workers": 1, "status": "ok"},
               {"strategy": "ddp", "workers": 2, "status": "ok"},
               {"strategy": "fsdp", "workers": 2, "status": "failed", "error": "RuntimeError: boom"},
               {"strategy": "model", "workers": 2, "status": "ok"}]
    runs = {0: _run("single", 1, 0.4), 1: _run("ddp", 2, 0.25), 3: _run("model", 2, 0.5, check="FAIL")}
    headers, rows = results_table(entries, runs)
    assert headers[4] == "speedup over single"
    assert rows[0][4] == "1.00" and rows[1][4] == "1.60" and rows[3][4] == "0.80"
    assert rows[2][2] == "-" and rows[2][-1] == "error: RuntimeError: boom"
    assert rows[3][7].startswith("FAIL") and rows[1][7].startswith("PASS")
    # without single: each strategy against its own 1-worker run, and the header says so
    entries2 = [{"strategy": "ddp", "workers": 1, "status": "ok"}, {"strategy": "ddp", "workers": 2, "status": "ok"}]
    headers2, rows2 = results_table(entries2, {0: _run("ddp", 1, 0.6), 1: _run("ddp", 2, 0.4)})
    assert "own 1-worker" in headers2[4] and rows2[1][4] == "1.50"


def test_tables_render_in_text_markdown_and_html(tmp_path):
    headers, rows = ["name", "value"], [["a|b", 1.5], ["c", None]]
    assert text_table(headers, rows).splitlines()[2].startswith("a|b")
    md = markdown_table(headers, rows)
    assert "a\\|b" in md and md.splitlines()[1] == "|---|---:|"
    rep = Report("t")
    rep.section("S").para("x < y").table(headers, rows).code("cmd --flag")
    page, mdf = rep.write(tmp_path)
    html = page.read_text()
    assert "x &lt; y" in html and "<td>a|b</td>" in html and "<pre>cmd --flag</pre>" in html


def test_merge_traces_skips_missing_runs(tmp_path):
    assert merge_traces([("gone", tmp_path / "missing")])["traceEvents"] == []


# ---------------------------------------------------------------- HPML Lab 4 sweeps
SWEEP = ["--dataset", "synthetic", "--width", "0.125", "--epoch-samples", "32",
         "--train-args=--synthetic-size 512 --timeout 60"]


@pytest.mark.slow  # 17 s: the default suite stays near 15 min; CI runs the slow suite too
def test_sweep_batch_size_table(tmp_path):
    out = tmp_path / "s"
    checked = [*SWEEP[:-1], SWEEP[-1] + " --check"]  # and each run checked (the sweep's shared-reference folder)
    p = run_paralab("sweep", "batch-size", "--sizes", "16,32", "--out", str(out), "--lr-scaling", "linear", *checked,
                    timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in ("b16", "b32"):  # two batch sizes: two references, each trained; none kept in the report
        log = (out / "logs" / f"{name}.log").read_text()
        assert "check: the single-process reference trains beside the run" in log and "check: PASS" in log
    assert not (out / "check-cache").exists()
    data = json.loads((out / "sweep.json").read_text())
    rows = {r[0]: dict(zip(data["headers"], r)) for r in data["rows"]}
    assert set(rows) == {16, 32}
    assert rows[16]["steps/epoch"] == 2 and rows[32]["steps/epoch"] == 1
    for r in rows.values():
        assert 0 < float(r["epoch s (no data)"]) <= float(r["epoch s (all)"])
    # the first epoch is warm-up: each run trained 2 epochs and timed the second
    run = load_run(out / "runs" / "b16")
    assert run.get("steps") == 4 and run.get("warmup") == 2
    assert run.config["lr_scaling"] == "linear" and run.config["per_worker_batch"] == 16
    assert (out / "epoch_time.png").is_file() and (out / "report.html").is_file()


def test_sweep_scaling_weak_and_compute_vs_comm(tmp_path):
    out = tmp_path / "s"
    p = subprocess.run([sys.executable, "-m", "paralab", "sweep", "scaling", "--strategy", "allreduce",
                        "--workers", "1,2", "--batch-sizes", "16", "--mode", "weak", "--out", str(out), *SWEEP],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    tables = json.loads((out / "sweep.json").read_text())["tables"]
    speed = tables["weak_speedup"]["rows"]
    assert [r[0] for r in speed] == [1, 2] and speed[0][2] == "1.00"
    t1, t2 = float(speed[0][1]), float(speed[1][1])
    # the table shows times rounded to 3 decimals and a speed-up computed before rounding (to 2): the
    # speed-up lies within what the rounded times allow (at a few ms a step, the rounding alone is ~10 %)
    lo, hi = (t1 - 5e-4) / (t2 + 5e-4), (t1 + 5e-4) / (t2 - 5e-4)
    assert lo - 0.005 <= float(speed[1][2]) <= hi + 0.005, (t1, t2, speed)
    cc = dict(zip(tables["weak_compute_comm"]["headers"], tables["weak_compute_comm"]["rows"][0]))
    assert float(cc["comm s (measured)"]) > 0 and float(cc["compute s (measured)"]) > 0
    assert float(cc["compute s (T1/N)"]) == pytest.approx(t1 / 2, abs=0.002)
    assert float(cc["util GB/s"]) > 0
    # weak scaling: 1 worker ran single with the same per-worker batch
    assert load_run(out / "runs" / "weak-b16-w1").strategy == "single"
    assert load_run(out / "runs" / "weak-b16-w2").get("global_batch") == 32


def test_out_of_memory_is_recognised():
    from paralab.commands.sweep import OOM_RE
    for msg in ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "MemoryError"):
        assert OOM_RE.search(msg), msg
    assert not OOM_RE.search("RuntimeError: injected fault on rank 1 at step 1")
