"""`paralab compare --compress LIST`: the matrix of compression variants (plan level), the refusals,
the table's variant labels and bytes column, and one compression study end to end (slow)."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from paralab.analysis.runs import Run
from paralab.commands import compare
from paralab.errors import UsageError
from paralab.kinds import UNCOUNTED_COMM
from paralab.report.page import results_table

from report_runs import TINY, run_compare


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(["--dataset", "synthetic", "--cores-per-worker", "none", *argv])


def planned(*argv: str) -> tuple[dict, list[str]]:
    runs, left_out = compare.plan(args(*argv))
    return {r["name"]: r for r in runs}, left_out


# ---------------------------------------------------------------------------- the matrix
def test_default_is_todays_matrix():
    plain, plain_out = planned("--strategies", "ddp,allreduce", "--workers", "1,2")
    none, none_out = planned("--strategies", "ddp,allreduce", "--workers", "1,2", "--compress", "none")
    assert list(plain) == list(none) == ["ddp-w1", "ddp-w2", "allreduce-w1", "allreduce-w2"]
    assert [r["config"] for r in plain.values()] == [r["config"] for r in none.values()]
    assert all(r["config"].compress == "none" and r["config"].warmup == 1 for r in plain.values())
    assert plain_out == none_out
    assert "--compress" not in compare.canonical_command(args())


def test_each_compressing_strategy_runs_every_variant_the_others_once():
    runs, _ = planned("--strategies", "ddp,torch-ddp,allreduce", "--workers", "2", "--no-check",
                      "--compress", "none,fp16,powersgd-r2")
    assert list(runs) == ["ddp-w2", "ddp-fp16-w2", "ddp-powersgd-r2-w2",
                          "torch-ddp-w2", "torch-ddp-fp16-w2", "torch-ddp-powersgd-r2-w2", "allreduce-w2"]
    assert [r["compress"] for r in runs.values()] == ["none", "fp16", "powersgd-r2"] * 2 + ["none"]
    assert runs["ddp-w2"]["config"].compress == "none"
    assert runs["allreduce-w2"]["config"].compress == "none"
    fp16 = runs["ddp-fp16-w2"]["config"]
    assert (fp16.compress, fp16.warmup) == ("fp16", 1)
    # PowerSGD starts after compare's uncompressed steps, which are warm-up: s/iter and bytes are PowerSGD's
    psgd = runs["torch-ddp-powersgd-r2-w2"]["config"]
    assert (psgd.compress, psgd.powersgd_rank) == ("powersgd", 2)
    assert psgd.powersgd_start_iter == compare.POWERSGD_START == psgd.warmup
    assert all(r["config"].bucket_mb == 0.5 for r in runs.values() if r["strategy"] != "allreduce")


def test_the_default_matrix_leaves_out_one_worker_runs_once_per_strategy():
    runs, left_out = compare.plan(args("--compress", "none,fp16", "--no-check"))
    names = [r["name"] for r in runs]
    assert "ddp-w2" in names and "ddp-fp16-w2" in names and "ddp-w1" not in names
    assert sum(n.startswith("ddp at 1 worker:") for n in left_out) == 1
    assert not any(n.startswith("ddp (fp16) at 1 worker") for n in left_out)


def test_spellings_are_normalised_and_duplicates_run_once():
    assert compare.parse_compress(" FP16, powersgd,powersgd-r1, powersgd-r4,fp16") == [
        ("fp16", {"compress": "fp16"}),
        ("powersgd-r1", {"compress": "powersgd", "powersgd_rank": 1}),
        ("powersgd-r4", {"compress": "powersgd", "powersgd_rank": 4})]
    runs, _ = planned("--strategies", "ddp", "--workers", "2", "--compress", "powersgd,powersgd-r1")
    assert list(runs) == ["ddp-powersgd-r1-w2"]


def test_refused_variants_are_left_out_with_why_and_the_rest_runs():
    runs, left_out = planned("--strategies", "ddp,torch-ddp", "--workers", "2,3", "--batch-size", "24",
                             "--compress", "none,fp16")
    assert list(runs) == ["ddp-w2", "ddp-w3", "ddp-fp16-w2", "torch-ddp-w2", "torch-ddp-w3"]
    assert any(n.startswith("ddp (fp16) at 3 workers:") and "gloo's ring order" in n for n in left_out)
    for w in (2, 3):  # torch-ddp's hooks are not replayed by --check's reference
        assert any(n.startswith(f"torch-ddp (fp16) at {w} workers:") and "--check" in n for n in left_out)


@pytest.mark.parametrize("value", ["zip", "powersgd-r0", "powersgd-r", "fp16-r2", ","])
def test_bad_spellings_are_refused_naming_the_valid_ones(value):
    with pytest.raises(UsageError, match="powersgd-rN"):
        compare.plan(args("--strategies", "ddp", "--workers", "2", "--compress", value))


@pytest.mark.parametrize("argv, message", [
    (["ddp", "--train-args=--compress fp16"], "may not set --compress: compare's --compress LIST"),
    (["ddp", "--compress", "fp16", "--train-args=--powersgd-rank 2"], "may not set --powersgd-rank"),
    (["allreduce", "--compress", "none,fp16"], "none of the strategies compared compresses"),
    (["ddp", "--compress", "powersgd", "--num-batches", "2"], "--num-batches must be more than 2"),
])
def test_refused_before_running(argv, message):
    with pytest.raises(UsageError, match=message):
        compare.plan(args("--workers", "2", "--strategies", *argv))


def test_cli_exits_2_and_writes_nothing(tmp_path, capsys):
    from paralab.cli import main
    out = tmp_path / "r"
    assert main(["compare", "--out", str(out), "--strategies", "ddp", "--compress", "gzip"]) == 2
    assert "none, fp16, bf16, powersgd" in capsys.readouterr().err
    assert not out.exists()


def test_train_args_powersgd_start_iter_is_kept_and_is_the_warm_up():
    runs, _ = planned("--strategies", "ddp", "--workers", "2", "--compress", "none,powersgd",
                      "--train-args=--powersgd-start-iter 3")
    cfg = runs["ddp-powersgd-r1-w2"]["config"]
    assert (cfg.powersgd_start_iter, cfg.warmup) == (3, 3)
    assert runs["ddp-w2"]["config"].warmup == 1


def test_dry_run_and_canonical_command_say_compress(tmp_path, capsys):
    from paralab.cli import build_parser, config_from_args, main
    a = args("--strategies", "ddp", "--workers", "2", "--compress", "none,powersgd-r2,fp16")
    text = compare.canonical_command(a)
    assert "--compress none,powersgd-r2,fp16" in text
    again = build_parser().parse_args(shlex.split(text)[1:])  # the command parses back to the same variants
    assert compare.parse_compress(again.compress) == compare.parse_compress(a.compress)
    assert main(["compare", "--dry-run", "--out", str(tmp_path / "r"), "--dataset", "synthetic",
                 "--strategies", "ddp", "--workers", "2", "--compress", "none,powersgd-r2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "--compress" not in lines[0]
    cfg = config_from_args(build_parser().parse_args(shlex.split(lines[1])[1:]))
    assert (cfg.compress, cfg.powersgd_rank, cfg.powersgd_start_iter) == ("powersgd", 2, 2)
    assert lines[1].endswith("runs/ddp-powersgd-r2-w2")


# ---------------------------------------------------------------------------- the table
def fake_run(strategy: str, config: dict, comm_bytes: dict | None, details: dict | None = None,
             workers: int = 2) -> Run:
    summary = {"strategy": strategy, "workers": workers, "seconds_per_iter": 0.1, "samples_per_s": 640.0,
               "test_loss": 2.0, "test_accuracy": 0.1, "strategy_details": details or {}}
    if comm_bytes is not None:
        summary["comm_bytes"] = comm_bytes
    return Run(Path("/nowhere") / strategy, {"strategy": strategy, "workers": workers, **config}, summary)


def test_a_one_rank_run_sends_nothing_though_its_collectives_are_recorded():
    assert fake_run("ddp", {}, {"0": 5.8e5}, workers=1).bytes_sent_per_step == 0.0
    assert fake_run("ddp", {}, {"0": 5.8e5, "1": 5.8e5}).bytes_sent_per_step == 5.8e5


def test_table_shows_each_variant_and_the_bytes_it_sent():
    runs = {0: fake_run("ddp", {}, {"0": 8e6, "1": 8e6}),
            1: fake_run("ddp", {"compress": "fp16"}, {"0": 4e6, "1": 4.1e6}),
            2: fake_run("ddp", {"compress": "powersgd", "powersgd_rank": 2}, {"0": 1e5, "1": 1e5}),
            3: fake_run("torch-ddp", {"compress": "powersgd"}, {"0": 0.0, "1": 0.0},
                        {"0": {UNCOUNTED_COMM: "a hook of its own"}, "1": {UNCOUNTED_COMM: "a hook of its own"}}),
            4: fake_run("allreduce", {}, None)}
    entries = [{"strategy": r.strategy, "workers": 2, "status": "ok"} for r in runs.values()]
    entries.append({"strategy": "ddp", "workers": 2, "status": "failed", "error": "boom",
                    "config": {"compress": "bf16"}})
    headers, rows = results_table(entries, runs, baseline="none-here")
    table = [dict(zip(headers, row)) for row in rows]
    assert [t["strategy"] for t in table] == ["ddp", "ddp (fp16)", "ddp (powersgd r2)", "torch-ddp (powersgd r1)",
                                             "allreduce", "ddp (bf16)"]
    assert [t["MB sent/step/rank"] for t in table] == ["8.000", "4.100", "0.100", "-", "-", "-"]
    assert headers.index("MB sent/step/rank") == headers.index("test loss") - 1
    assert runs[2].label == "ddp w2 powersgd r2" and runs[2].series == "ddp (powersgd r2)"
    plain_headers, plain_rows = results_table(entries[:1] + entries[4:5], {0: runs[0], 1: runs[4]},
                                              baseline="none-here")
    assert "MB sent/step/rank" not in plain_headers and [r[0] for r in plain_rows] == ["ddp", "allreduce"]
    assert runs[0].label == "ddp w2"


def test_torch_ddp_powersgd_says_its_bytes_are_not_counted():
    from paralab.strategies.torch_ddp import TorchDDPReplicas
    replicas = TorchDDPReplicas.__new__(TorchDDPReplicas)  # only what summary() reads
    replicas.compress = "powersgd"
    assert "outside comm.py" in replicas.summary()[UNCOUNTED_COMM]
    replicas.compress = "fp16"  # through our counted hook
    assert replicas.summary() == {}


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_compare_compress_study(tmp_path):
    out = tmp_path / "study"
    p = run_compare(out, "--strategies", "ddp", "--workers", "2", "--compress", "none,fp16,powersgd-r2", *TINY)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    table = {row[0]: dict(zip(data["headers"], row)) for row in data["rows"]}
    assert list(table) == ["ddp", "ddp (fp16)", "ddp (powersgd r2)"]
    assert "--compress none,fp16,powersgd-r2" in data["command"]
    for row in table.values():
        assert row["check"].startswith("PASS"), row  # each against a reference with the same compression
    sent = {k: float(row["MB sent/step/rank"]) for k, row in table.items()}
    assert 0.45 < sent["ddp (fp16)"] / sent["ddp"] < 0.55  # the gradients at 2 bytes (BatchNorm buffers at 4)
    assert sent["ddp (powersgd r2)"] < 0.25 * sent["ddp"]
    assert "MB sent/step/rank" in (out / "report.md").read_text()
    assert sorted(d.name for d in (out / "runs").iterdir()) == ["ddp-fp16-w2", "ddp-powersgd-r2-w2", "ddp-w2"]


@pytest.mark.slow
def test_torch_ddp_powersgd_runs_with_several_buckets_on_gloo(paralab):
    """compare's small buckets (--bucket-mb 0.5) give torch-ddp several; PyTorch's PowerSGD hook then
    launched P and Q in a different order on each rank, which gloo refused or hung on (3 of 3 tries)."""
    r = paralab("train", "torch-ddp", "--workers", "2", "--num-batches", "4", "--bucket-mb", "0.05",
                "--compress", "powersgd", "--powersgd-rank", "2", "--powersgd-start-iter", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(UNCOUNTED_COMM in d for d in r.summary["strategy_details"].values())
