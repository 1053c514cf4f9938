"""The planner against measured runs (analysis/measured.py, `paralab measured`): vTrain's 1,440 single-node A100
iteration times, each planned with its layout pinned.

The reference is the table itself (measured by vTrain's authors, not by us). What is held: the a100-sxm preset
reaches on it the figures docs/plan.md prints (median error, worst, rank correlation, regret), far better than
the datasheet figures it was fitted from; the preset is what the printed fit command finds; a fit that never
saw two model sizes predicts them about as well (slow); a fit recovers the parameters that made a table; and a
bad table or --out is refused with exit 2, leaving nothing written.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from paralab.analysis import measured as M
from paralab.analysis.plan import PRESETS, Layout, Setting, gpt_workload, predict
from paralab.cli import main
from paralab.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "plan.md"
ROWS = M.read_table(M.SHIPPED)


def page_figures(cluster: str) -> dict:
    """The summary line docs/plan.md prints for ``cluster`` on the shipped table."""
    m = re.search(rf"^\| `{cluster}` \| ([\d.]+) % \| ([\d.]+) % \| ([\d.]+) % \| ([\d.]+) \| ([-\d.]+) \| (\d+) of "
                  rf"(\d+) \| ([\d.]+) % \| ([\d.]+) % \|$", PAGE.read_text(), re.M)
    assert m, f"docs/plan.md has no row for {cluster}"
    return dict(zip(("median", "mean", "worst", "rank_median", "rank_worst", "below", "groups", "regret_median",
                     "regret_worst"), m.groups()))


def printed(rep: dict) -> dict:
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    return {"median": pct(rep["median"]), "mean": pct(rep["mean"]), "worst": pct(rep["worst"]),
            "rank_median": f"{rep['rank_median']:.2f}", "rank_worst": f"{rep['rank_worst']:.2f}",
            "below": str(rep["groups_below_0.9"]), "groups": str(rep["groups"]),
            "regret_median": pct(rep["regret_median"]), "regret_worst": pct(rep["regret_worst"])}


def test_the_shipped_table_is_vtrains_1440_runs():
    assert len(ROWS) == 1440 and {r.gpus for r in ROWS} == {2, 4, 8} and {r.size for r in ROWS} == {
        f"{h}x{L}" for h in (1024, 2048) for L in (12, 16, 20, 24)}
    assert all(r.tp * r.dp * r.pp == r.gpus and r.context == 1024 and r.heads == 16 for r in ROWS)
    assert (M.SHIPPED.parent / "vtrain-LICENSE").read_text().startswith("Copyright (c) 2024, VIA Research Group")


@pytest.mark.parametrize("cluster", ["a100-sxm", "a100-sxm-datasheet"])
def test_the_page_prints_what_each_preset_reaches_on_the_table(cluster):
    rep = M.report(ROWS, M.predicted(ROWS, PRESETS[cluster]))
    assert printed(rep) == page_figures(cluster)


def test_the_calibrated_preset_meets_the_bars_it_meets_and_says_where_it_does_not():
    """Median |error| within 5 % (the datasheet's figures: 38 %), the predicted time the measured one at the
    median, the layouts ordered as measured in the median group (rank correlation >= 0.9) and the fastest
    predicted layout the measured fastest in most groups. The worst row (a micro batch of 2 at tp 4, whose
    measured time per layer is below that of a micro batch of 1, which no cost monotone in the work follows)
    is 27.8 % off, over the issue's 25 %: held here as it is, so a change that moves it is seen."""
    rep = M.report(ROWS, M.predicted(ROWS, PRESETS["a100-sxm"]))
    assert rep["median"] <= 0.05 and abs(rep["median_ratio"] - 1) < 0.01
    assert rep["rank_median"] >= 0.9 and rep["regret_median"] == 0.0
    assert rep["worst"] < 0.28
    worst = ROWS[rep["worst_row"]]
    assert (worst.tp, worst.microbatch, worst.hidden) == (4, 2, 2048)
    before = M.report(ROWS, M.predicted(ROWS, PRESETS["a100-sxm-datasheet"]))
    assert before["median"] > 0.3 and before["median_ratio"] < 0.7  # predicted far too fast


def test_the_preset_records_its_fit_and_the_40gb_node_scales_its_memory_bandwidth():
    a100 = PRESETS["a100-sxm"]
    assert a100.launch_us > 0 and a100.unit_overhead_us == 0 and a100.matmul
    assert "fitted by `paralab measured --fit` to the 1440 measured runs of vtrain-single.csv" in a100.source
    forty = PRESETS["a100-40gb"]
    assert forty.memory_gb == 40 and forty.memory_gbs == pytest.approx(a100.memory_gbs * 1555 / 2039)
    assert forty.launch_us == a100.launch_us and forty.matmul == a100.matmul


def test_a_pass_takes_at_least_the_hosts_launch():
    """A model whose device work is nothing beside the launch: each of a step's m microbatches costs every unit
    its forward's launch, twice it for backward and once more for full recomputation; the step is that plus
    the optimizer's memory-bound step (one replica, no pipeline: nothing else)."""
    import dataclasses
    work = gpt_workload(4, 64, 4, 16, 256)
    lay = Layout(dp=1, tp=1, pp=1, microbatch=1, microbatches=8, recompute="full")
    cluster = dataclasses.replace(PRESETS["a100-sxm"], launch_us=1000.0)
    x = predict(work, lay, cluster, Setting(8))
    assert x.step == pytest.approx(8 * len(work.units) * 4 * 1e-3 + x.optimizer, rel=1e-12)
    without = predict(work, lay, dataclasses.replace(cluster, launch_us=0.0), Setting(8))
    assert without.step < 0.05 * x.step  # the device work, 1 % of it
    big = gpt_workload(24, 2048, 16, 1024, 50304)  # device-bound: the launch changes nothing
    lay = Layout(dp=1, tp=1, pp=1, microbatch=8, microbatches=2, recompute="full")
    assert predict(big, lay, cluster, Setting(16)).step == predict(
        big, lay, dataclasses.replace(cluster, launch_us=0.0), Setting(16)).step


def test_a_fit_recovers_the_parameters_that_made_a_table():
    """Times predicted by a known cluster for 96 of the table's layouts: the fit from its default start finds
    them again where the layouts pin them (the matmul ramp, the launch, the memory bandwidth), to within a few
    per cent, and predicts every row to within 1 %."""
    truth = dict(efficiency=0.7, half_gflop=12.0, launch_us=400.0, intra_latency_us=8.0, intra_gbps=1800.0,
                 p2p_overhead_us=200.0, memory_gbs=1500.0)
    base = PRESETS["a100-sxm-datasheet"]
    made = M.with_parameters(base, truth)
    rows = [M.Row(*(getattr(r, f) for f in ("gpus", "global_batch", "microbatch", "hidden", "heads", "layers",
                                             "context", "tp", "dp", "pp")), t)
            for r, t in zip(ROWS[::15], M.predicted(ROWS[::15], made))]
    cluster, found = M.fit(rows, base, iterations=240)
    rep = M.report(rows, M.predicted(rows, cluster))
    assert rep["worst"] < 0.01
    for name in ("efficiency", "half_gflop", "launch_us", "memory_gbs"):
        assert found[name] == pytest.approx(truth[name], rel=0.05), name


def test_a_fit_in_worker_processes_is_a_single_processs_bit_for_bit():
    """The rows spread over processes come back in order with the same floats: the same times, and a fit that
    moves through the same points to the same values."""
    rows = ROWS[::5]
    for cluster in (PRESETS["a100-sxm"], PRESETS["a100-sxm-datasheet"]):
        with M.Predictor(rows, workers=3) as spread:
            assert len(spread.pools) == 3 and spread(cluster) == M.predicted(rows, cluster)
    alone, spread = (M.fit(ROWS[::15], PRESETS["a100-sxm-datasheet"], iterations=45, workers=w)[1] for w in (1, 2))
    assert alone == spread and alone != M.fit(ROWS[::15], PRESETS["a100-sxm-datasheet"], iterations=0)[1]


def test_spearman_ranks_ties_at_their_mean():
    assert M.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert M.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert M.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # ranks 0.5 0.5 2 against 0 1 2
    assert M.spearman([5, 5], [1, 2]) == 1.0  # one predicted value: no order to get wrong


# ---------------------------------------------------------------- the command
def test_the_command_prints_the_report_and_json_the_same_figures(capsys):
    assert main(["measured", "--worst", "2"]) == 0
    out = capsys.readouterr().out
    assert "1440 measured runs of vtrain-single.csv" in out and "median 4.8 %" in out
    assert out.count(" ms (") == 2  # the two largest errors
    assert main(["measured", "--json", "--cluster", "a100-sxm-datasheet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"] == "a100-sxm-datasheet" and data["report"]["rows"] == 1440
    assert printed(data["report"]) == page_figures("a100-sxm-datasheet")


BAD = [
    ("# GPUs,global batch\n2,16\n", "the first line must name the columns"),
    (",".join(M.COLUMNS) + "\n2,16,8,1024,16,24,1024,1,1,2,fast\n", ":2: the first 10 values must be whole numbers"),
    (",".join(M.COLUMNS) + "\n4,16,8,1024,16,24,1024,1,1,2,372.1\n", ":2: tp 1 x dp 1 x pp 2 is not the 4 GPUs"),
    (",".join(M.COLUMNS) + "\n2,16,3,1024,16,24,1024,1,1,2,372.1\n", "not a whole number of micro batches"),
    (",".join(M.COLUMNS) + "\n2,16,8,1024,16,24,1024,1,1,2,-3\n", "every value must be positive"),
    (",".join(M.COLUMNS) + "\n", "no rows under the header"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_a_bad_table_is_refused_naming_the_line(tmp_path, capsys, text, message):
    f = tmp_path / "t.csv"
    f.write_text(text)
    assert main(["measured", str(f)]) == 2
    assert message in capsys.readouterr().err


def test_bad_flags_are_refused_and_nothing_is_written(tmp_path, capsys):
    keep = tmp_path / "notes.json"
    keep.write_text('{"mine": 1}')
    for argv, message in ((["--out", str(tmp_path / "x.json")], "--out belongs to a fit: add --fit"),
                          (["--fit", "--out", str(keep)], "exists and is not a cluster file"),
                          (["--fit", "--out", str(tmp_path / "x.toml")], "name a .json file"),
                          (["--fit", "--hold-out", "4096x8"], "4096x8 is not a model size of the table"),
                          (["--fit", "--hold-out", ",".join(sorted({r.size for r in ROWS}))], "leaves nothing to fit"),
                          (["--cluster", "nowhere.toml"], "no such file, and not a preset"),
                          ([str(tmp_path / "none.csv")], "no such file")):
        assert main(["measured", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert keep.read_text() == '{"mine": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]


@pytest.mark.slow
def test_the_printed_fit_finds_the_preset_and_a_held_out_fit_generalises(tmp_path):
    """The page's two fit commands: the first writes the a100-sxm preset's file (the same figures), the second,
    fitted without two model sizes, predicts them within the page's figures."""
    from conftest import run_paralab
    out = tmp_path / "a100-sxm.json"
    r = run_paralab("measured", "--fit", "--cluster", "a100-sxm-datasheet", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got, shipped = json.loads(out.read_text()), json.loads((M.SHIPPED.parent / "a100-sxm.json").read_text())
    assert got.keys() == shipped.keys()
    for k, v in shipped.items():
        if isinstance(v, float):
            assert got[k] == pytest.approx(v, rel=1e-6), k
    r = run_paralab("measured", "--fit", "--cluster", "a100-sxm-datasheet", "--hold-out", "1024x16,2048x24",
                    "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    held = json.loads(r.stdout)["held_out"]
    m = re.search(r"held out \(1024x16 and 2048x24, 360 runs\): median ([\d.]+) %, worst ([\d.]+) %", PAGE.read_text())
    assert m and (f"{100 * held['median']:.1f}", f"{100 * held['worst']:.1f}") == m.groups()
    assert held["median"] < 0.08


def test_the_preset_is_where_its_fit_stopped():
    """Each fitted parameter of the preset moved 3 % up or down (inside its bounds) fits the table worse: the
    preset is a minimum of what the fit minimises, as the printed fit command left it (that command itself
    runs in the slow selection)."""
    import dataclasses
    base, preset = PRESETS["a100-sxm-datasheet"], PRESETS["a100-sxm"]
    values = M.fitted_values(preset)
    again = M.with_parameters(base, values)
    assert dataclasses.replace(again, matmul=None) == dataclasses.replace(preset, name=base.name, source=base.source,
                                                                           matmul=None)
    assert [e for _, e in again.matmul] == pytest.approx([e for _, e in preset.matmul], rel=1e-12)
    rows = ROWS
    best = M.squared_log_error(rows, preset)
    bounds = dict(zip([n for n, *_ in M.FREE], M._bounds(base)))
    for name in values:
        for factor in (0.97, 1.03):
            moved = values[name] * factor
            lo, hi = bounds[name]
            if lo <= moved <= hi:
                assert M.squared_log_error(rows, M.with_parameters(base, {**values, name: moved})) > best, (name, factor)
