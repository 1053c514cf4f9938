"""The mesh, and data x pipeline parallelism (``--pp``) checked against one process.

The DP x PP matrix (each data-parallel flavour x {gpipe, 1f1b} x {BatchNorm,
no norm} at dp 2 x pp 2) runs inside one set of 4 worker processes, job after
job, as tests/test_data_parallel.py does for pure data parallelism. Four
ranks share this machine's two cores, so the jobs are tiny.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from spawn_ranks import run_jobs as run_jobs_in_ranks

from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.mesh import Mesh, MeshShape

FLAVOURS = ("gather-scatter", "allreduce", "ddp", "torch-ddp", "fsdp")  # fsdp at ZeRO-1
SCHEDULES = ("gpipe", "1f1b")
BATCH = 32  # 16 per replica, 4 microbatches of 4


# ------------------------------------------------------------------ the grid
def test_layout_pp_outermost():
    shape = MeshShape.for_world(8, pp=2, tp=2)
    assert (shape.pp, shape.dp, shape.tp) == (2, 2, 2)
    assert [shape.coords(r) for r in (0, 1, 2, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1}, {"pp": 0, "dp": 1, "tp": 0},
        {"pp": 1, "dp": 1, "tp": 1}]
    for r in range(8):
        assert shape.rank(**shape.coords(r)) == r


def test_groups_partition_the_world_along_each_dimension():
    shape = MeshShape.for_world(4, pp=2)
    assert shape.groups("dp") == [[0, 1], [2, 3]]  # a stage's replicas are neighbours
    assert shape.groups("pp") == [[0, 2], [1, 3]]  # a pipeline: one rank per stage
    assert shape.groups("tp") == [[0], [1], [2], [3]]
    for dim in ("pp", "dp", "tp"):
        ranks = sorted(r for g in shape.groups(dim) for r in g)
        assert ranks == list(range(4))


def test_mesh_comms_are_group_local():
    class World:  # stands in for the world Comm: only what Mesh reads
        recorder, world, group = None, 4, None

    made = []
    mesh = Mesh(MeshShape.for_world(4, pp=2), 3, World(), new_group=lambda ranks: made.append(ranks) or tuple(ranks))
    assert made == [[0, 2], [1, 3], [0, 1], [2, 3], [0], [1], [2], [3]]  # every group, same order on every rank
    assert mesh.coords == {"pp": 1, "dp": 1, "tp": 0}
    dp, pp = mesh.comm("dp"), mesh.comm("pp")
    assert (dp.rank, dp.world, dp.ranks, dp.group) == (1, 2, [2, 3], (2, 3))
    assert (pp.rank, pp.world, pp.ranks) == (1, 2, [1, 3])
    assert pp._global(0) == 1  # the previous stage of rank 3's pipeline is rank 1
    assert "pp 2 x dp 2 x tp 1" in mesh.describe()


@pytest.mark.parametrize("world,pp,message", [(3, 2, "must be a multiple of 2"), (4, 0, "--pp must be positive")])
def test_bad_shapes_are_refused(world, pp, message):
    with pytest.raises(UsageError, match=message):
        MeshShape.for_world(world, pp=pp)


def config(strategy, **kw):
    base = dict(strategy=strategy, dataset="synthetic", width=0.125, batch_size=BATCH, workers=4, num_batches=1,
                pp=2, microbatches=4)
    return RunConfig(**(base | kw))


@pytest.mark.parametrize("strategy,kw,message", [
    ("torch-fsdp", {}, "cannot be composed with pipeline stages"),
    ("single", dict(workers=2), "cannot be composed with pipeline stages"),
    ("model", {}, "name the data-parallel flavour instead"),
])
def test_uncomposable_layouts_are_refused(strategy, kw, message):
    with pytest.raises(UsageError, match=message):
        config(strategy, **kw).validate()


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp_zero23_composes_with_pipeline_stages(stage):  # the ZeRO-2/3 flavours (fsdp/zero23.py)
    from paralab.strategies import plan
    cfg = config("fsdp", zero_stage=stage).validate()
    shape, cls, kwargs = plan(cfg, 4)
    assert (shape.pp, shape.dp, cls.__name__, kwargs["replicas_cls"].zero_stage) == (2, 2, "Pipeline", stage)


def test_global_batch_splits_over_dp_only():
    assert config("ddp").data_replicas() == 2
    assert config("ddp", per_worker_batch=8, batch_size=None).global_batch() == 16
    assert config("pipeline", pp=1).data_replicas() == 1


# ------------------------------------------------------------------ the DP x PP matrix
def job_config(out: Path, strategy: str, schedule: str, norm: str, **extra) -> RunConfig:
    # fp32's course setting (verify.py): 2 steps at lr 1e-3. At lr 1e-2 BatchNorm over 4-sample microbatches
    # amplifies rounding by an amount that depends on the CPU's kernels (issue 20); fp64 vouches for real settings
    return RunConfig(strategy=strategy, norm=norm, workers=4, pp=2, schedule=schedule, microbatches=4,
                     out=str(out), dataset="synthetic", synthetic_size=256, width=0.125, batch_size=BATCH,
                     num_batches=2, lr=1e-3, check=True, precision="fp32", progress=False, eval_batches=1,
                     eval_batch_size=64, timeout=60, zero_stage=1, **extra).validate()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpxpp")
    jobs = [job_config(root / f"{s}-{sched}-{n}", s, sched, n)
            for s in FLAVOURS for sched in SCHEDULES for n in ("batch", "none")]
    run_jobs_in_ranks(4, jobs, root)
    out = {}
    for cfg in jobs:
        path = Path(cfg.out)
        assert (path / "summary.json").exists(), f"{path.name}: no records"
        out[path.name] = (json.loads((path / "summary.json").read_text()) | {"_dir": str(path)},
                          json.loads((path / "config.json").read_text()),
                          [json.loads(line) for line in (path / "spans.jsonl").read_text().splitlines()])
    return out


@pytest.mark.parametrize("norm", ["batch", "none"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_dp_x_pp_check_passes(matrix, flavour, schedule, norm):
    summary, config_json, spans = matrix[f"{flavour}-{schedule}-{norm}"]
    assert summary["check"]["result"] == "PASS", summary["check"]
    assert summary["check"]["max_weight_dev"] <= 1e-5 and summary["check"]["max_output_dev"] <= 1e-4
    assert summary["workers"] == 4 and summary["global_batch"] == BATCH
    assert config_json["mesh"]["shape"] == {"pp": 2, "dp": 2, "tp": 1}
    details = summary["strategy_details"]
    assert [details[str(r)]["stage"] for r in range(4)] == [0, 0, 1, 1]
    assert [details[str(r)]["dp_replica"] for r in range(4)] == [0, 1, 0, 1]
    assert {details[str(r)]["data_parallel"]["flavour"] for r in range(4)} == \
        {"zero1" if flavour == "fsdp" else flavour}
    assert summary["first_loss"] is not None and summary["final_loss"] is not None


def test_every_flavour_reports_the_same_loss_every_step(matrix):
    """Only the last stage computes a loss; its replicas' mean is the global batch's, the same whatever
    the flavour and the schedule (the same data, the same arithmetic up to rounding)."""
    losses = {}
    for name, (summary, _, _) in matrix.items():
        rows = [json.loads(line) for line in Path(summary["_dir"], "steps.jsonl").read_text().splitlines()]
        for row in rows:
            assert (row["loss"] is None) == (row["rank"] in (0, 1)), (name, row)  # stage 0 has no loss
        by_step = {}
        for row in rows:
            if row["loss"] is not None:
                by_step.setdefault(row["step"], []).append(row["loss"])
        losses[name] = [sum(v) / len(v) for _, v in sorted(by_step.items())]
    for norm in ("batch", "none"):
        runs = {k: v for k, v in losses.items() if k.endswith(norm)}
        first = next(iter(runs.values()))
        assert len(first) == 2
        for name, values in runs.items():
            assert values == pytest.approx(first, abs=1e-5), name


@pytest.mark.parametrize("flavour", ["ddp", "allreduce"])
def test_gradients_are_synchronised_once_per_step_after_the_last_microbatch(matrix, flavour):
    """Over dp, per rank and step: the gradient collectives start only after the stage's last backward."""
    _, _, spans = matrix[f"{flavour}-1f1b-none"]
    for rank in range(4):
        for step in (0, 1):
            mine = [s for s in spans if s["rank"] == rank and s["step"] == step]
            backwards = [s for s in mine if s["category"] == "compute" and s["name"] == "backward"]
            last_start = max(s["t0"] for s in backwards)
            grads = [s for s in mine if s["category"] == "comm" and s["bytes"]
                     and (s["name"].startswith("ddp_bucket") or s["name"] == "all_reduce")]
            assert grads, (rank, step)
            assert min(s["t0"] for s in grads) >= last_start  # never inside an earlier microbatch's backward
            if flavour == "ddp":
                assert len([s for s in grads if s["args"].get("async")]) == 1  # one bucket, once
