"""``--recompute full|selective`` under every strategy: ``--check`` in float64 at lr 0.1 with momentum, 8 steps,
and in float32 at the course setting (lr 1e-3, 2 steps). Context parallelism (pure cp with ring and all-to-all
attention on 2 workers, and cp composed with dp, tp and pp on 4) has a matrix of its own.

Recomputation must not change one bit of the arithmetic, so every layout's check must pass as it does
without it (tests/test_fp64.py). The jobs run inside one set of worker processes per world size, as
tests/test_fp64.py does. The whole matrix is slow (``make test-slow``); three jobs run in the default suite.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import shared_references
from spawn_ranks import run_jobs as run_jobs_in_ranks

from paralab.check.reference import TOLERANCES
from paralab.run.config import RunConfig

#: recomputation changes no bit of any step, so a recompute that differs does so from its first steps on (the
#: seeded bugs of tests/test_mutants.py that forget the generator or update BatchNorm twice show at step 1); how
#: 20 steps at real hyperparameters carry a layout's rounding is tests/test_fp64.py's, without recomputation
STEPS = 8
REAL = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
GPT = dict(model="gpt", dataset="synthetic-text", layers=2, embed=32, heads=4, context=16)
# (job name, strategy, extra options): the CNN (VGG-11 at width 0.125, BatchNorm) unless GPT
JOBS2 = [
    ("gather-scatter", "gather-scatter", {}),
    ("allreduce", "allreduce", {}),
    ("ddp", "ddp", {"bucket_mb": 0.05}),
    ("torch-ddp", "torch-ddp", {}),
    ("fsdp1", "fsdp", {"zero_stage": 1}),
    ("fsdp2", "fsdp", {"zero_stage": 2}),
    ("fsdp3", "fsdp", {"zero_stage": 3}),
    ("torch-fsdp", "torch-fsdp", {}),
    ("model", "model", {}),
    ("pipeline-gpipe", "pipeline", {"schedule": "gpipe", "microbatches": 4}),
    ("pipeline-1f1b", "pipeline", {"schedule": "1f1b", "microbatches": 4}),
    ("pipeline-zb-h1", "pipeline", {"schedule": "zb-h1", "microbatches": 4}),
    ("pipeline-zb-h2", "pipeline", {"schedule": "zb-h2", "microbatches": 4}),
    ("pipeline-interleaved", "pipeline", {"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 4}),
    ("torch-pipeline", "torch-pipeline", {"schedule": "1f1b", "microbatches": 4}),
    ("tp-vgg", "tp", {}),
    ("gpt-ddp", "ddp", GPT),
    ("gpt-fsdp3", "fsdp", GPT | {"zero_stage": 3}),
    ("gpt-tp", "tp", GPT),
    ("gpt-tp-sp", "tp", GPT | {"sequence_parallel": True}),
    ("gpt-torch-tp", "torch-tp", GPT),
    ("gpt-pipeline-zb-h1", "pipeline", GPT | {"schedule": "zb-h1", "microbatches": 4}),
]
COURSE = dict(precision="fp32", lr=1e-3, momentum=0.0, weight_decay=0.0, num_batches=2)  # fp32's setting
JOBS1 = [("single", "single", {}), ("gpt-single", "single", GPT)]
JOBS4 = [
    ("ddp-pp2", "ddp", {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    ("gpt-ddp-tp2-pp2", "tp", GPT | {"pp": 2, "schedule": "1f1b", "microbatches": 2}),
]

# context parallelism (the gpt's sequence split over cp ranks): pure cp with each method, and cp composed
JOBS_CP2 = [
    ("gpt-cp-ring", "cp", GPT | {"cp_method": "ring"}),
    ("gpt-cp-a2a", "cp", GPT | {"cp_method": "all-to-all"}),
]
JOBS_CP4 = [
    ("gpt-dp2-cp2", "allreduce", GPT | {"cp": 2}),
    ("gpt-cp2-tp2-a2a", "ddp", GPT | {"cp": 2, "tp": 2, "cp_method": "all-to-all"}),
    ("gpt-cp2-pp2", "allreduce", GPT | {"cp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2}),
]


def at_course_setting(table: list) -> list:
    """Every job again in fp32 at the course setting, but tensor parallelism of a BatchNorm CNN (fp32
    cannot vouch for it: ``Strategy.check_limit``, refused before start)."""
    return [(f"fp32-{n}", s, e | COURSE) for n, s, e in table if not (s == "tp" and e.get("model") != "gpt")]


JOBS1, JOBS2, JOBS4, JOBS_CP2, JOBS_CP4 = (t + at_course_setting(t)
                                           for t in (JOBS1, JOBS2, JOBS4, JOBS_CP2, JOBS_CP4))
#: in the default suite: a CNN under ddp, the gpt under tp, a zero-bubble pipeline (I and W apart)
FAST = {("ddp", "full"), ("gpt-tp", "selective"), ("gpt-pipeline-zb-h1", "full")}


def job_config(out: Path, strategy: str, workers: int, extra: dict, mode: str) -> RunConfig:
    kw = dict(strategy=strategy, workers=workers, out=str(out), dataset="synthetic", synthetic_size=512,
              width=0.125, batch_size=16, num_batches=STEPS, check=True, precision="fp64", recompute=mode,
              progress=False, eval_batches=1, eval_batch_size=16, timeout=60, log_every=STEPS) | REAL | extra
    return RunConfig(**kw, check_cache=shared_references(kw["precision"])).validate()


def run_jobs(root: Path, world: int, jobs: list) -> dict:
    root.mkdir(parents=True)
    configs = [job_config(root / f"{name}-{mode}", strategy, world, extra, mode)
               for name, strategy, extra, mode in jobs]
    run_jobs_in_ranks(world, configs, root)
    return {Path(c.out).name: json.loads(Path(c.out, "summary.json").read_text()) for c in configs}


def _jobs(table, only_fast: bool):
    return [(n, s, e, m) for n, s, e in table for m in ("full", "selective") if ((n, m) in FAST) == only_fast]


def _assert_pass(summary):
    check = summary["check"]
    tol = TOLERANCES[check["precision"]]
    assert check["result"] == "PASS", check
    assert check["max_weight_dev"] <= tol["weights"] and check["max_output_dev"] <= tol["outputs"]


@pytest.fixture(scope="module")
def fast_summaries(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute-fast")
    return run_jobs(root / "w2", 2, _jobs(JOBS2, True))


@pytest.mark.parametrize("name", [f"{n}-{m}" for n, m in sorted(FAST)])
def test_recompute_check_passes(fast_summaries, name):
    _assert_pass(fast_summaries[name])


@pytest.fixture(scope="module")
def slow_summaries(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    return (run_jobs(root / "w1", 1, _jobs(JOBS1, False)) | run_jobs(root / "w2", 2, _jobs(JOBS2, False))
            | run_jobs(root / "w4", 4, _jobs(JOBS4, False)))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [f"{n}-{m}" for n, _, _, m in _jobs(JOBS1 + JOBS2 + JOBS4, False)])
def test_recompute_check_passes_every_strategy(slow_summaries, name):
    _assert_pass(slow_summaries[name])


def test_pipeline_records_what_recompute_frees(paralab):
    """A 1F1B pipeline's recorded peak of saved bytes (the stage's saved_tensors_hooks, which a recomputed
    unit passes what it keeps through): the first stage keeps far less under --recompute full; the last
    stage, whose every forward is followed by its backward, does not recompute and keeps the same."""
    peaks = {}
    for mode in ("none", "full"):
        r = paralab("train", "pipeline", "--workers", "2", "--schedule", "1f1b", "--microbatches", "4", "--model",
                    "gpt", "--layers", "2", "--embed", "32", "--context", "16", "--dataset", "synthetic-text",
                    "--batch-size", "16", "--num-batches", "2", "--recompute", mode)
        assert r.returncode == 0, r.stderr
        details = r.summary["strategy_details"]
        peaks[mode] = [details[str(k)]["peak_activation_bytes"] for k in range(2)]
    assert peaks["full"][0] * 5 < peaks["none"][0]
    assert peaks["full"][1] == peaks["none"][1] > 0


@pytest.fixture(scope="module")
def cp_summaries(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute-cp")
    # each job also without recomputation: what a recompute sends again is counted against it
    jobs2, jobs4 = ([(n, s, e, m) for n, s, e in table for m in ("none", "full", "selective")]
                    for table in (JOBS_CP2, JOBS_CP4))
    summaries = run_jobs(root / "w2", 2, jobs2) | run_jobs(root / "w4", 4, jobs4)
    return {name: (summary, json.loads(next(root.glob(f"w*/{name}/config.json")).read_text()))
            for name, summary in summaries.items()}


def _messages(summary) -> int:
    return sum(op["calls"] for op in summary["comm_ops"].values())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [f"{n}-{m}" for n, _, _, m in _jobs(JOBS_CP2 + JOBS_CP4, False)])
def test_recompute_check_passes_under_context_parallelism(cp_summaries, name):
    """Full recomputation re-runs each block, selective the attention core: either way the ring's K/V rotations
    or Ulysses' all-to-alls run again in backward (more messages than without recomputation), and neither may
    change a bit of what --check compares."""
    summary, config = cp_summaries[name]
    _assert_pass(summary)
    mode = name.rsplit("-", 1)[1]
    assert config["recompute"] == mode and config["mesh"]["shape"]["cp"] == 2, config
    without = cp_summaries[name[:-len(mode)] + "none"][0]
    assert _messages(summary) > _messages(without), (summary["comm_ops"], without["comm_ops"])
