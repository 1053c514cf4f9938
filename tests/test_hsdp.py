"""Sharded data parallelism in every composition (issue 21, part 2): fsdp at ZeRO-1/2/3 with --tp, with --pp
and both, and HSDP (--replicate R): each checked against one process, bad layouts refused before start."""
import json

import pytest

from paralab.errors import UsageError
from paralab.mesh import Mesh, MeshShape
from paralab.run.config import RunConfig

GPT = ["--model", "gpt", "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16", "--batch-size", "8",
       "--dataset", "synthetic-text"]
FP64 = ["--precision", "fp64", "--lr", "0.1", "--momentum", "0.9", "--num-batches", "20", "--check"]  # real setting
COURSE = ["--lr", "1e-3", "--num-batches", "2", "--check", "--precision", "fp32"]                                         # fp32
VGG = ["--width", "0.125", "--dataset", "synthetic", "--batch-size", "16"]


def _passed(r, precision="fp64"):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["result"] == "PASS" and check["precision"] == precision, check
    assert r.stdout.count(": PASS  weights: PASS") == r.summary["workers"], r.stdout
    if precision == "fp64":
        assert check["max_weight_dev"] <= 1e-9, check
    return json.loads((r.out / "config.json").read_text())["mesh"]["shape"]


def _losses(r) -> dict[tuple[int, int], float]:
    return {(row["rank"], row["step"]): row["loss"] for row in r.rows("steps.jsonl") if row["loss"] is not None}


# ------------------------------------------------------------------ the mesh's shard and replicate groups
def test_hsdp_subdivides_dp_into_replicas_of_consecutive_shard_groups():
    shape = MeshShape.for_world(8, tp=2)
    import dataclasses
    shape = dataclasses.replace(shape, replicate=2)
    assert shape.size("shard") == 2 and shape.dims()[-2:] == ("shard", "replicate")
    assert shape.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.groups("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]      # neighbours along dp (one host)
    assert shape.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the same shard, across groups
    assert shape.coords(6) == {"pp": 0, "dp": 3, "tp": 0, "shard": 1, "replicate": 1}
    for r in range(8):
        assert shape.rank(**shape.coords(r)) == r
    assert shape.to_dict()["shape"]["replicate"] == 2 and "replicate_index" in shape.to_dict()["layout"]

    class World:
        recorder, world, group = None, 8, None
    mesh = Mesh(shape, 5, World(), new_group=tuple)
    assert mesh.comm("shard").ranks == [5, 7] and mesh.comm("replicate").ranks == [1, 5]
    assert "replicate 2 x shard 2" in mesh.describe()


# ------------------------------------------------------------------ refused before start
@pytest.mark.parametrize("kw,message", [
    (dict(strategy="ddp", workers=4, replicate=2), "does not shard: use fsdp"),
    (dict(strategy="fsdp", workers=6, replicate=4), "--replicate 4 must divide the 6"),
    (dict(strategy="fsdp", workers=8, tp=2, replicate=3), "--replicate 3 must divide the 4"),
])
def test_impossible_hsdp_is_refused_saying_what_to_change(kw, message):
    with pytest.raises(UsageError, match=message):
        RunConfig(dataset="synthetic", **kw).validate()


def test_replicate_without_fsdp_exits_2_on_the_command_line(paralab):
    r = paralab("train", "allreduce", "--workers", "2", "--replicate", "2")
    assert r.returncode == 2 and "--replicate" in r.stderr and not (r.out / "summary.json").exists(), r.stderr


# ------------------------------------------------------------------ fsdp x tp, fsdp x pp, 3-D: --check
def test_zero3_tp2_gpt_fp64_real_setting(paralab):
    r = paralab("train", "fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "3", *GPT, *FP64, fast=False)
    assert _passed(r) == {"pp": 1, "dp": 2, "tp": 2}
    details = r.summary["strategy_details"]["0"]
    assert details["zero_stage"] == 3 and details["tensor_parallel"]["size"] == 2
    # what is sharded over dp is this rank's tp slice: fewer parameters than the model's 42,368, cut in 2 (padded)
    sliced = details["memory"]["model"]["parameters"]
    assert sliced < 42368 and details["shard_elements"] * 2 == sliced + details["padding_elements"], details


def test_zero2_pp2_gpt_course_reduces_each_unit_inside_the_last_backward(paralab):
    r = paralab("train", "fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "2", "--microbatches", "2",
                "--schedule", "1f1b", *GPT, *COURSE, fast=False)
    assert _passed(r, "fp32") == {"pp": 2, "dp": 2, "tp": 1}
    for details in r.summary["strategy_details"].values():
        dp = details["data_parallel"]
        assert dp["flavour"] == "zero2" and dp["zero_stage"] == 2
        # once per unit and step, by the hooks of the last microbatch's backward (2 steps)
        assert dp["reduced_in_backward"] == 2 * dp["units_sharded"], dp


def test_zero3_pp2_holds_only_shards_between_steps_and_whole_stage_inside(paralab):
    r = paralab("train", "fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "3", "--microbatches", "2",
                *GPT, *FP64, fast=False)
    _passed(r)
    for details in r.summary["strategy_details"].values():
        dp = details["data_parallel"]
        itemsize = 8
        whole, shard = details["stage_parameters"] * itemsize, dp["shard_elements"] * itemsize
        # kept gathered across the step's microbatches: the stage's parameters whole plus the shards
        assert details["held"]["ledger"]["peak_bytes"]["params"] == whole + shard, details["held"]
    from paralab.analysis.runs import load_run
    from paralab.report.plots import memory_by_rank
    drawn = memory_by_rank(load_run(r.out))  # the memory plot draws each stage's ledger, not an estimate
    assert drawn and all(not estimated for rank in drawn.values() for _, estimated in rank["parts"].values())


@pytest.fixture(scope="module")
def slow_runs(request, tmp_path_factory):
    """The composition checks the selected tests need, two at a time: argv -> Result."""
    from conftest import selected, side_by_side
    jobs = [tuple(p["args"]) for p in selected(request, "test_more_compositions_pass_check")]
    jobs += [("fsdp", *p["args"]) for p in selected(request, "test_hsdp_compositions_pass_check")]
    return side_by_side({argv: argv for argv in jobs}, tmp_path_factory.mktemp("hsdp"), fast=False)


@pytest.mark.slow
def test_zero3_tp2_pp2_3d_fp64(paralab):
    r = paralab("train", "fsdp", "--workers", "8", "--tp", "2", "--pp", "2", "--zero-stage", "3",
                "--microbatches", "2", "--sequence-parallel", *GPT, *FP64, fast=False)
    assert _passed(r) == {"pp": 2, "dp": 2, "tp": 2}


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["fsdp", "--workers", "8", "--tp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2", *GPT, *COURSE],
    ["fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "3", "--microbatches", "2", "--schedule", "zb-h1",
     *GPT, *FP64],
    ["fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "3", *VGG, *FP64],
    ["fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "2", *VGG, "--norm", "none", *COURSE],
    ["fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "2", "--microbatches", "2", *GPT, *FP64],
    ["fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "3", "--schedule", "interleaved-1f1b", "--virtual-stages",
     "2", "--microbatches", "2", "--partition", "params", *GPT, *FP64],
    ["fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "2", "--schedule", "zb-h2", "--microbatches", "4", *GPT,
     *FP64],
    ["fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "3", *GPT, *COURSE],
    ["torch-fsdp", "--workers", "4", "--tp", "2", *GPT, *COURSE],
], ids=["3d-course", "zero3-pp2-zbh1", "vgg-zero3-tp2-fp64", "vgg-zero2-tp2-nonorm", "zero2-pp2-fp64",
        "zero3-interleaved", "zero2-zbh2", "zero3-tp2-course", "torch-fsdp-tp2-course"])
def test_more_compositions_pass_check(slow_runs, args):
    _passed(slow_runs[tuple(args)], "fp64" if "fp64" in args else "fp32")


# ------------------------------------------------------------------ HSDP
def test_hsdp_2x2_passes_fp64_and_matches_plain_fsdp_on_4(paralab):
    hsdp = paralab("train", "fsdp", "--workers", "4", "--replicate", "2", *GPT, *FP64, fast=False)
    shape = _passed(hsdp)
    assert shape["replicate"] == 2 and shape["shard"] == 2
    details = hsdp.summary["strategy_details"]
    assert [details[str(r)]["replica"] for r in range(4)] == [0, 0, 1, 1]
    assert details["0"]["memory"]["model"]["workers"] == 2  # the memory model shards over the shard group
    ops = hsdp.summary["comm_ops"]  # each reduced shard (half a unit) all-reduced across the 2 replica groups
    assert ops["all_reduce"]["calls"] == ops["reduce_scatter"]["calls"], ops
    assert ops["all_reduce"]["bytes"] * 2 == ops["reduce_scatter"]["bytes"], ops
    plain = paralab("train", "fsdp", "--workers", "4", *GPT, *FP64, fast=False)
    _passed(plain)
    a, b = _losses(hsdp), _losses(plain)
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if k[1] == 0)  # step 1: bit-identical (torchtitan's parity rule)
    assert max(abs(a[k] - b[k]) for k in a) < 1e-12   # after: the same sums in another order


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--workers", "8", "--tp", "2", "--replicate", "2", *GPT, *FP64],
    ["--workers", "8", "--tp", "2", "--replicate", "2", *GPT, *COURSE],
    ["--workers", "4", "--replicate", "2", *GPT, *COURSE],
    ["--workers", "4", "--replicate", "2", "--zero-stage", "2", *VGG, *FP64],
    ["--workers", "8", "--pp", "2", "--replicate", "2", "--zero-stage", "3", "--microbatches", "2", *GPT, *FP64],
    ["--workers", "8", "--tp", "2", "--replicate", "2", "--zero-stage", "1", *GPT, *FP64],
], ids=["hsdp-tp-fp64", "hsdp-tp-course", "hsdp-course", "hsdp-zero2-vgg-fp64", "hsdp-pp-zero3", "hsdp-tp-zero1"])
def test_hsdp_compositions_pass_check(slow_runs, args):
    shape = _passed(slow_runs[("fsdp", *args)], "fp64" if "fp64" in args else "fp32")
    assert shape["replicate"] == 2


# ------------------------------------------------------------------ resuming into another layout
def _resume_equals_single(paralab, tmp_path, first, second):
    """``first`` 5 steps, ``second`` resumed to 10 (resharded): the weights and losses of one process's 10."""
    from conftest import run_paralab
    from test_reshard import VGG, assert_equals_single, resume_across
    single = run_paralab("train", "single", *VGG, "--num-batches", "10", out=tmp_path / "single")
    assert single.returncode == 0, single.stderr
    _, b = resume_across(paralab, tmp_path, first, second, VGG)
    assert_equals_single(b, single.out)
    return b


def test_hsdp_2x2_resumes_as_ddp_on_2_fp64(paralab, tmp_path):
    b = _resume_equals_single(paralab, tmp_path, ["fsdp", "--workers", "4", "--replicate", "2"],
                              ["ddp", "--workers", "2"])
    assert "replicate 2" in b.stdout, b.stdout  # the layout it came from, in words


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [
    (["ddp", "--workers", "2"], ["fsdp", "--workers", "4", "--replicate", "2", "--zero-stage", "2"]),
    (["fsdp", "--workers", "4", "--pp", "2", "--zero-stage", "3", "--microbatches", "2"],
     ["fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "3"]),
    (["fsdp", "--workers", "4", "--tp", "2", "--zero-stage", "2", "--replicate", "2"], ["single"]),
], ids=["ddp-to-hsdp", "zero3pp-to-zero3tp", "hsdp-tp-to-single"])
def test_new_layouts_reshard_both_ways(paralab, tmp_path, first, second):
    _resume_equals_single(paralab, tmp_path, first, second)


# ------------------------------------------------------------------ calc memory
def test_calc_memory_hsdp_shards_over_the_shard_group():
    from conftest import run_paralab
    hsdp = run_paralab("calc", "memory", "--model", "gpt", "--workers", "8", "--replicate", "2", "--json")
    shard = run_paralab("calc", "memory", "--model", "gpt", "--workers", "4", "--json")
    assert hsdp.returncode == 0 and json.loads(hsdp.stdout) == json.loads(shard.stdout), hsdp.stderr
    bad = run_paralab("calc", "memory", "--model", "gpt", "--workers", "8", "--replicate", "3")
    assert bad.returncode == 2 and "--replicate must be a positive divisor" in bad.stderr


# ------------------------------------------------------------------ torch-fsdp x tp (FSDP2 on DTensor tp, torchtitan's order)
def test_torch_fsdp_on_torch_tp_passes_fp64(paralab):
    r = paralab("train", "torch-fsdp", "--workers", "4", "--tp", "2", *GPT, *FP64, fast=False)
    assert _passed(r) == {"pp": 1, "dp": 2, "tp": 2}
    assert r.summary["strategy_details"]["0"]["memory"]["model"]["workers"] == 2


@pytest.mark.slow
def test_torch_fsdp_on_torch_tp_resumes_as_ddp(paralab, tmp_path):
    from conftest import run_paralab
    from test_reshard import GPT as COMMON, assert_equals_single, resume_across
    single = run_paralab("train", "single", *COMMON, "--num-batches", "10", out=tmp_path / "single")
    assert single.returncode == 0, single.stderr
    _, b = resume_across(paralab, tmp_path, ["torch-fsdp", "--workers", "4", "--tp", "2"], ["ddp", "--workers", "2"],
                         COMMON)
    assert_equals_single(b, single.out)


def test_torch_fsdp_refuses_pp(paralab):
    r = paralab("train", "torch-fsdp", "--workers", "4", "--pp", "2", *GPT)
    assert r.returncode == 2 and "cannot be composed with pipeline stages" in r.stderr, r.stderr


# ------------------------------------------------------------------ compare --model gpt
def test_compare_on_2_workers_says_why_composed_sharding_is_left_out_and_runs_it_on_4():
    from test_compare_compress import planned
    _, left_out = planned("--model", "gpt", "--dataset", "synthetic-text")
    assert any(n.startswith("fsdp composed with --tp 2") and "4 workers" in n for n in left_out), left_out
    runs, left_out = planned("--model", "gpt", "--dataset", "synthetic-text", "--strategies", "fsdp,torch-fsdp", "--workers", "4",
                             "--train-args=--tp 2")
    assert [(r["config"].tp, r["config"].workers) for r in runs.values()] == [(2, 4), (2, 4)]
    assert not any("composed with" in n for n in left_out)


def test_zero3_tp2_ledger_peak_equals_the_memory_models_prediction(paralab):
    """fsdp on tp slices: the ledger's resident peak, per rank, is the cost model's ZeRO-3 peak for this
    rank's slice of the parameters over the dp group, to the byte (fp32, which the model counts)."""
    r = paralab("train", "fsdp", "--workers", "4", "--tp", "2", *GPT, "--num-batches", "3", fast=False)
    assert r.returncode == 0, r.stderr
    from paralab.analysis.runs import load_run
    for details in load_run(r.out).details.values():
        memory = details["memory"]
        assert memory["model"]["workers"] == 2 and memory["predicted"]["strategy"] == "zero-3"
        measured = details["held"]["ledger"]  # measured in one place: the held record (run/held.py)
        assert measured["resident_peak_bytes"] == memory["predicted"]["bytes"]["peak"], (measured, memory)
