"""Context parallelism (--cp) on the gpt: the layout, the mesh, --check against one process, bad input."""
import json

import pytest

from conftest import run_paralab

from paralab.cli import main
from paralab.mesh import MeshShape
from paralab.strategies.context.layout import Layout

GPT = ["--model", "gpt", "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16", "--batch-size", "8",
       "--dataset", "synthetic-text", "--check"]
FP64 = ["--precision", "fp64", "--lr", "0.1", "--momentum", "0.9", "--num-batches", "20"]
COURSE = ["--lr", "1e-3", "--num-batches", "2", "--precision", "fp32"]


def test_balanced_layout_pairs_head_and_tail_chunks():
    layout = Layout(context=16, size=4)
    assert layout.chunks_of(0) == (0, 7) and layout.chunks_of(3) == (3, 4)
    assert layout.positions(1).tolist() == [2, 3, 12, 13]
    # every position held exactly once, and the inverse puts the gathered order back
    assert sorted(layout.order().tolist()) == list(range(16))
    assert layout.order()[layout.inverse()].tolist() == list(range(16))
    # causal work per rank (key positions each query sees) is equal when balanced, not when contiguous
    work = [int((p + 1).sum()) for p in (layout.positions(r) for r in range(4))]
    assert len(set(work)) == 1
    plain = [int((Layout(16, 4, balanced=False).positions(r) + 1).sum()) for r in range(4)]
    assert plain[-1] > 3 * plain[0]
    assert Layout(12, 4).problem() and "multiple of 8" in Layout(12, 4).problem()
    assert Layout(12, 4, balanced=False).problem() is None


def test_mesh_puts_cp_between_dp_and_tp():
    shape = MeshShape.for_world(8, tp=2, cp=2)
    assert (shape.pp, shape.dp, shape.cp, shape.tp) == (1, 2, 2, 2)
    assert shape.coords(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert shape.group_of(0, "cp") == [0, 2] and shape.group_of(0, "tp") == [0, 1]
    assert shape.group_of(0, "dp") == [0, 4]
    assert shape.group_of(1, "dpcp") == [1, 3, 5, 7]  # gradients are averaged over dp x cp
    assert shape.dims() == ("pp", "dp", "tp", "cp", "dpcp")
    assert shape.to_dict()["order"] == ["pp", "dp", "cp", "tp"]
    assert MeshShape.for_world(4).dims() == ("pp", "dp", "tp")  # unchanged without --cp


def _passed(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.summary["check"]["result"] == "PASS"
    assert r.stdout.count(": PASS  weights: PASS") == r.summary["workers"], r.stdout
    return json.loads((r.out / "config.json").read_text())["mesh"]["shape"]


@pytest.mark.parametrize("method", ["ring", "all-to-all"])
@pytest.mark.parametrize("setting", [FP64, COURSE], ids=["fp64-lr0.1-momentum-20", "fp32-course"])
def test_cp2_passes_check(paralab, method, setting):
    r = paralab("train", "allreduce", "--workers", "2", "--cp", "2", "--cp-method", method, *GPT, *setting,
                fast=False)
    assert _passed(r) == {"pp": 1, "dp": 1, "cp": 2, "tp": 1}
    _calc_matches(r, 3 if method == "ring" else 8)


def _calc_matches(r, kinds):
    """calc cp RUN: every cp message recorded per step equals the cost model's count and bytes, byte for byte."""
    calc = run_paralab("calc", "cp", str(r.out))
    assert calc.returncode == 0, calc.stderr
    rows = [line.split() for line in calc.stdout.splitlines() if line.startswith("  cp_")]
    assert len(rows) == kinds + 1, calc.stdout  # + the loss all-reduce
    for row in rows:
        name, predicted, measured = row[0], " ".join(row[1:5]), " ".join(row[5:9])
        assert predicted == measured, (name, calc.stdout)


def cp4_argv(method, setting, balance) -> tuple:
    return ("allreduce", "--workers", "4", "--cp", "4", "--cp-method", method, balance, *GPT, *setting)


@pytest.fixture(scope="module")
def slow_runs(request, tmp_path_factory):
    """The slow selection's runs of this file (those its selected tests need), two at a time: argv -> Result."""
    from conftest import selected, side_by_side
    jobs = [cp4_argv(**p) for p in selected(request, "test_cp4_passes_check")]
    jobs += [(*p["args"], *GPT, *FP64) for p in selected(request, "test_compositions_pass_check_in_fp64")]
    jobs += [(*p["args"], *GPT, *COURSE) for p in selected(request, "test_compositions_pass_check_in_fp32_course")]
    return side_by_side({argv: argv for argv in jobs}, tmp_path_factory.mktemp("context"), fast=False)


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["--cp-balance", "--no-cp-balance"])
@pytest.mark.parametrize("method", ["ring", "all-to-all"])
@pytest.mark.parametrize("setting", [FP64, COURSE], ids=["fp64-lr0.1-momentum-20", "fp32-course"])
def test_cp4_passes_check(slow_runs, method, setting, balance):
    _passed(slow_runs[cp4_argv(method, setting, balance)])


COMPOSITIONS = [
    (["allreduce", "--workers", "4", "--cp", "2"], {"pp": 1, "dp": 2, "cp": 2, "tp": 1}),
    (["ddp", "--workers", "4", "--cp", "2", "--tp", "2"], {"pp": 1, "dp": 1, "cp": 2, "tp": 2}),
    (["allreduce", "--workers", "4", "--cp", "2", "--tp", "2", "--cp-method", "all-to-all"],
     {"pp": 1, "dp": 1, "cp": 2, "tp": 2}),
    (["allreduce", "--workers", "4", "--cp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b"],
     {"pp": 2, "dp": 1, "cp": 2, "tp": 1}),
    (["allreduce", "--workers", "4", "--cp", "2", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1"],
     {"pp": 2, "dp": 1, "cp": 2, "tp": 1}),  # a split backward: the attention backward runs in I and in W
    (["ddp", "--workers", "8", "--cp", "2", "--tp", "2"], {"pp": 1, "dp": 2, "cp": 2, "tp": 2}),
    (["ddp", "--workers", "8", "--cp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b",
      "--cp-method", "all-to-all"], {"pp": 2, "dp": 1, "cp": 2, "tp": 2}),
]
COMPOSED = ["dp2xcp2", "cp2xtp2", "cp2xtp2-a2a", "cp2xpp2", "cp2xpp2-zbh1", "dp2xcp2xtp2", "pp2xcp2xtp2-a2a"]


@pytest.mark.slow
@pytest.mark.parametrize("args,shape", COMPOSITIONS, ids=COMPOSED)
def test_compositions_pass_check_in_fp64(slow_runs, args, shape):
    r = slow_runs[(*args, *GPT, *FP64)]
    assert _passed(r) == shape
    _calc_matches(r, 8 if "all-to-all" in args else 3)


@pytest.mark.slow
@pytest.mark.parametrize("args,shape", COMPOSITIONS, ids=COMPOSED)
def test_compositions_pass_check_in_fp32_course(slow_runs, args, shape):
    """The same layouts in float32 at the course setting (lr 1e-3, 2 steps), fp32's own tolerance: the gpt has
    no BatchNorm, so fp32 can vouch for its tp slices (``Strategy.check_limit`` refuses only BatchNorm CNNs)."""
    r = slow_runs[(*args, *GPT, *COURSE)]
    assert _passed(r) == shape
    assert r.summary["check"]["precision"] == "fp32", r.summary["check"]
    _calc_matches(r, 8 if "all-to-all" in args else 3)


def refused(capsys, tmp_path, *argv):
    out = tmp_path / "never"
    code = main(["train", *argv, "--num-batches", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists()
    return err


SMALL = ["--model", "gpt", "--layers", "1", "--embed", "32", "--heads", "4", "--context", "16",
         "--dataset", "synthetic-text"]


@pytest.mark.parametrize("argv,message", [
    (["allreduce", "--workers", "2", "--cp", "2", "--dataset", "synthetic"], "--model vgg11 has none"),
    (["allreduce", "--workers", "2", "--cp", "2", "--cp-method", "all-to-all", *SMALL, "--heads", "2",
      "--embed", "32", "--tp", "1", "--workers", "2", "--context", "16", "--heads", "1"], "must divide by cp 2"),
    (["allreduce", "--workers", "4", "--cp", "4", *SMALL, "--context", "12"], "--context 12 must be a multiple of 8"),
    (["allreduce", "--workers", "3", "--cp", "2", *SMALL], "must be a multiple of 2"),
    (["tp", "--workers", "4", "--cp", "2", *SMALL], "does not compose with --cp 2"),
    (["allreduce", "--workers", "2", "--cp", "2", "--sequence-parallel", *SMALL], "drop --sequence-parallel"),
], ids=["cnn", "heads", "context", "workers", "pure-tp", "sequence-parallel"])
def test_bad_layouts_are_refused(capsys, tmp_path, argv, message):
    assert message in refused(capsys, tmp_path, *argv)


def test_pure_cp_is_a_strategy_over_all_workers(paralab):
    r = paralab("train", "cp", "--workers", "2", *GPT, *COURSE, fast=False)
    assert _passed(r) == {"pp": 1, "dp": 1, "cp": 2, "tp": 1}


def test_torch_cp_is_refused_on_cpu_with_the_reason(capsys, tmp_path):
    err = refused(capsys, tmp_path, "torch-cp", "--workers", "2", *SMALL, "--device", "cpu")
    assert "_scaled_dot_product_flash_attention_for_cpu" in err and "paralab train cp" in err


def test_torch_cp_still_cannot_run_on_cpu():
    """The reason torch-cp is refused, tried on this PyTorch (one gloo rank, in a fresh process): when a release
    runs it, this fails, and torch-cp should be written."""
    import multiprocessing
    import socket
    from paralab.strategies.torch_cp import cpu_probe
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        error = pool.apply(cpu_probe, (port,))
    assert error and "_scaled_dot_product_flash_attention_for_cpu" in error, error


@pytest.mark.slow
def test_resume_from_cp_into_another_layout(paralab, tmp_path):
    """A cp checkpoint (every cp rank holds the whole state) resumes resharded into cp x tp with Ulysses, and the
    resumed run still passes --check; export puts the cp run's files together."""
    common = [*GPT[:-1], "--precision", "fp64", "--checkpoint-every", "5"]
    a = paralab("train", "cp", "--workers", "2", *common, "--num-batches", "5", out=tmp_path / "a", fast=False)
    assert a.returncode == 0, a.stderr
    b = paralab("train", "allreduce", "--workers", "4", "--cp", "2", "--tp", "2", "--cp-method", "all-to-all",
                *common, "--num-batches", "10", "--resume", str(a.out), "--check", out=tmp_path / "b", fast=False)
    assert b.returncode == 0, b.stdout + b.stderr
    assert "resharded" in b.stdout and b.summary["check"]["result"] == "PASS", b.stdout
    export = run_paralab("export", str(a.out), "-o", str(tmp_path / "m.pt"))
    assert export.returncode == 0, export.stderr
