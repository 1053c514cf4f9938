"""Resume into another layout (issue 24 part 2): 5 steps as layout A + 5 as layout B = 10 steps of one process.

In float64 at lr 0.1 with momentum 0.9 (Adam at lr 1e-3), the weights a resharded run ends with (read
back with ``paralab export``) and its losses of steps 6-10 are compared with a single process trained
10 steps. The tolerance is the check's own float64 one (weights 1e-9, ``check/reference.py``); what
is measured is about 1e-15. Momentum 0.9 makes a lost or misplaced optimizer state visible: the
test that starts B with no optimizer state shows it moves the weights by far more than the tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import commit_generation, recommit, run_paralab
from paralab.commands.export import consolidate
from paralab.run import checkpoint

FP64 = ["--precision", "fp64", "--lr", "0.1"]
VGG = ["--width", "0.125", "--norm", "none", *FP64]
GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "2",
       "--context", "16", "--partition", "params", *FP64]
ADAM = ["--width", "0.125", "--norm", "none", "--precision", "fp64", "--optimizer", "adam", "--lr", "1e-3"]
WEIGHTS = 1e-9  # check/reference.py's float64 tolerance on weights
LOSSES = 1e-12  # a loss is one number: what float64 rounding leaves of it


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 10-step single-process reference of each option set, trained once per module."""
    made = {}

    def get(common: list[str]) -> Path:
        key = tuple(common)
        if key not in made:
            out = tmp_path_factory.mktemp("single")
            r = run_paralab("train", "single", *common, "--num-batches", "10", out=out)
            assert r.returncode == 0, r.stderr
            made[key] = out
        return made[key]
    return get


def losses(run: Path) -> dict[int, float]:
    """Each step's loss: the mean over the ranks that report one (data-parallel shards of equal size,
    tensor-parallel ranks that agree, a pipeline's last stage)."""
    by_step: dict[int, list[float]] = {}
    for line in (run / "steps.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("loss") is not None:
            by_step.setdefault(row["step"], []).append(row["loss"])
    return {step: sum(v) / len(v) for step, v in by_step.items()}


def resume_across(paralab, tmp_path, first: list[str], second: list[str], common: list[str]):
    """Layout ``first`` 5 steps, then layout ``second`` resumed from it to step 10."""
    a = paralab("train", *first, *common, "--num-batches", "5", out=tmp_path / "a")
    assert a.returncode == 0, a.stderr
    b = paralab("train", *second, *common, "--num-batches", "10", "--resume", str(a.out), out=tmp_path / "b")
    assert b.returncode == 0, b.stdout + b.stderr
    assert "resharded" in b.stdout and "resumed from" in b.stdout, b.stdout
    return a, b


def assert_equals_single(b, reference: Path):
    mine, theirs = consolidate(b.out)[0], consolidate(reference)[0]
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst < WEIGHTS, f"weights differ from one process's by {worst:.3g}"
    got, want = losses(b.out), losses(reference)
    assert sorted(got) == [5, 6, 7, 8, 9]  # the resumed run trained steps 6-10 only
    for step in got:
        assert abs(got[step] - want[step]) < LOSSES, (step, got[step], want[step])
    assert b.summary["losses_before_resume"], "the steps before the resume are kept"


def test_fsdp3_w2_to_ddp_w2_equals_one_process(paralab, tmp_path, single):
    _, b = resume_across(paralab, tmp_path, ["fsdp", "--workers", "2", "--zero-stage", "3"],
                         ["ddp", "--workers", "2"], VGG)
    assert "fsdp (ZeRO-3) on 2 rank(s)" in b.stdout and "momentum" in b.stdout
    assert_equals_single(b, single(VGG))


def test_portable_state_is_one_process_state(paralab, tmp_path):
    """Offline, directly: the Portable made from fsdp ZeRO-3's two shard files after 3 steps holds the
    weights and momentum buffers a single process holds after 3 steps."""
    f = paralab("train", "fsdp", "--workers", "2", *VGG, "--num-batches", "3", out=tmp_path / "f")
    s = paralab("train", "single", *VGG, "--num-batches", "3", out=tmp_path / "s")
    assert f.returncode == s.returncode == 0, f.stderr + s.stderr
    from paralab.run.config import RunConfig
    from paralab.models import build_model
    cfg = RunConfig.from_dict(json.loads((s.out / "config.json").read_text()))
    model = build_model("vgg11", width=0.125, norm="none", num_classes=10)
    sharded, step, _, saved = checkpoint.read_portable(f.out, cfg, model)
    whole, *_ = checkpoint.read_portable(s.out, cfg, model)
    assert step == 3 and saved["strategy"] == "fsdp"
    assert set(sharded.tensors) == set(model.state_dict())
    assert set(sharded.optimizer) == {n for n, p in model.named_parameters()}
    for name, state in whole.optimizer.items():
        assert torch.allclose(sharded.optimizer[name]["momentum_buffer"], state["momentum_buffer"],
                              rtol=0, atol=WEIGHTS)
        assert state["momentum_buffer"].abs().max() > 1e-6  # momentum that matters
    for name, t in whole.tensors.items():
        assert torch.allclose(sharded.tensors[name], t, rtol=0, atol=WEIGHTS)


def test_without_the_optimizer_state_the_run_differs(paralab, tmp_path, single):
    """The control: the same resume from a copy of the checkpoint with the optimizer state taken out ends
    far outside the tolerance, so the comparisons above do test that it is carried."""
    a = paralab("train", "ddp", "--workers", "2", *VGG, "--num-batches", "5", out=tmp_path / "a")
    assert a.returncode == 0
    for rank in range(2):  # as a writer that left the optimizer state out would have committed it
        recommit(a.out, rank, lambda saved: saved["state"]["optimizer"].update(state={}))
    b = paralab("train", "single", *VGG, "--num-batches", "10", "--resume", str(a.out), out=tmp_path / "b")
    assert b.returncode == 0, b.stderr
    mine, theirs = consolidate(b.out)[0], consolidate(single(VGG))[0]
    assert max((mine[k] - theirs[k]).abs().max().item() for k in theirs) > 1e3 * WEIGHTS


def test_batchnorm_is_said_and_same_split_stays_exact(paralab, tmp_path):
    """With BatchNorm a run depends on how the batch is split: the start says so. Between two layouts
    that split it alike (dp 2, BatchNorm statistics from dp rank 0) the run stays exact: ddp w2 then
    fsdp ZeRO-2 w2 equals ddp w2 all along."""
    bn = ["--width", "0.125", *FP64]
    _, b = resume_across(paralab, tmp_path, ["ddp", "--workers", "2"], ["fsdp", "--workers", "2",
                                                                          "--zero-stage", "2"], bn)
    assert "BatchNorm" in b.stdout and "running statistics are carried" in b.stdout
    whole = paralab("train", "ddp", "--workers", "2", *bn, "--num-batches", "10", out=tmp_path / "ddp")
    assert whole.returncode == 0
    mine, theirs = consolidate(b.out)[0], consolidate(whole.out)[0]
    assert max((mine[k] - theirs[k]).abs().max().item() for k in theirs) < WEIGHTS
    assert any("running_mean" in k for k in theirs)


# ---------------------------------------------------------------------------------- refused before start
def _unchanged(folder: Path):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted((folder / "checkpoint").rglob("*"))
            if p.is_file()}


def test_bad_resumes_refused_before_start(paralab, tmp_path):
    a = paralab("train", "fsdp", "--workers", "2", *VGG, "--num-batches", "2", out=tmp_path / "a")
    assert a.returncode == 0
    before = _unchanged(a.out)
    # another model: a true mismatch, named, though the layout differs too
    r = paralab("train", "ddp", "--workers", "2", *VGG, "--width", "0.25", "--num-batches", "4",
                "--resume", str(a.out), out=tmp_path / "x1")
    assert r.returncode == 2 and "width" in r.stderr and not (tmp_path / "x1").exists(), r.stderr
    # another optimizer, another seed
    for flag, value, field in (("--optimizer", "adam", "optimizer"), ("--seed", "7", "seed")):
        r = paralab("train", "single", *VGG, flag, value, "--num-batches", "4", "--resume", str(a.out),
                    out=tmp_path / "x2")
        assert r.returncode == 2 and field in r.stderr and not (tmp_path / "x2").exists(), r.stderr
    # the global batch would change (--per-worker-batch over another number of replicas)
    p = paralab("train", "ddp", "--workers", "2", *VGG, "--per-worker-batch", "16", "--num-batches", "2",
                out=tmp_path / "p")
    r = paralab("train", "fsdp", "--workers", "4", *VGG, "--per-worker-batch", "16", "--num-batches", "4",
                "--resume", str(p.out), out=tmp_path / "x3")
    assert p.returncode == 0 and r.returncode == 2 and "global batch" in r.stderr, r.stderr
    # a missing rank file of the old layout
    kept = checkpoint.checkpoint_path(a.out, 1)
    kept.rename(tmp_path / "rank1.pt")
    r = paralab("train", "single", *VGG, "--num-batches", "4", "--resume", str(a.out), out=tmp_path / "x4")
    assert r.returncode == 2 and "rank1.pt is missing" in r.stderr and not (tmp_path / "x4").exists(), r.stderr
    (tmp_path / "rank1.pt").rename(kept)
    assert _unchanged(a.out) == before


def test_shapes_that_do_not_fit_are_named(tmp_path):
    """A checkpoint whose tensors do not fit the run's model (here: another width written under this
    run's identity, as a hand-edited folder would be) is refused naming the tensors, before start."""
    from paralab.errors import UsageError
    from paralab.models import build_model
    from paralab.run.config import RunConfig
    cfg = RunConfig(strategy="ddp", workers=2, width=0.125, norm="none", dataset="synthetic").validate()
    wide = build_model("vgg11", width=0.25, norm="none", num_classes=10)
    state = {"model": wide.state_dict(), "optimizer": torch.optim.SGD(wide.parameters(), lr=0.1).state_dict()}
    single = RunConfig.from_dict({**cfg.to_dict(), "strategy": "single", "workers": 1}).validate()
    ident = checkpoint.identity(single)
    commit_generation(tmp_path, 3, ident, {0: {"step": 3, "identity": ident, "state": state, "losses": "[]"}}, 1)
    with pytest.raises(UsageError, match="shapes differ: 0.*weight"):
        checkpoint.check_resumable(tmp_path, cfg)


# ---------------------------------------------------------------------------------- the matrix
MATRIX = {
    "ddp-w2-to-single": (["ddp", "--workers", "2"], ["single"], VGG),
    "pipeline-w2-to-fsdp1-w2": (["pipeline", "--workers", "2", "--microbatches", "2", "--partition", "params"],
                                ["fsdp", "--workers", "2", "--zero-stage", "1"], VGG),
    "adam-fsdp3-w2-to-gather-scatter-w4": (["fsdp", "--workers", "2"], ["gather-scatter", "--workers", "4"], ADAM),
    "adam-allreduce-w2-to-fsdp1-pp2-w4": (["allreduce", "--workers", "2"],
                                          ["fsdp", "--workers", "4", "--zero-stage", "1", "--pp", "2",
                                           "--microbatches", "2", "--partition", "params"], ADAM),
    "vgg-tp-w2-to-torch-fsdp-w2": (["tp", "--workers", "2"], ["torch-fsdp", "--workers", "2"], VGG),
    "gpt-tp-w2-to-pipeline-w2": (["tp", "--workers", "2"],
                                 ["pipeline", "--workers", "2", "--microbatches", "2"], GPT),
    "gpt-3d-w4-to-fsdp2-w2": (["ddp", "--workers", "4", "--pp", "2", "--tp", "2", "--microbatches", "2"],
                              ["fsdp", "--workers", "2", "--zero-stage", "2"], GPT),
    "gpt-interleaved-to-torch-tp": (["pipeline", "--workers", "2", "--schedule", "interleaved-1f1b",
                                     "--virtual-stages", "2", "--microbatches", "2"], ["torch-tp", "--workers", "2"],
                                    GPT),
    "model-w2-to-torch-ddp-w2": (["model", "--workers", "2"], ["torch-ddp", "--workers", "2"], VGG),
    "torch-pipeline-w2-to-allreduce-accumulate": (["torch-pipeline", "--workers", "2", "--microbatches", "2",
                                                   "--partition", "params"],
                                                  ["allreduce", "--workers", "2", "--accumulate", "2"], VGG),
    "gpt-fsdp1-tp2-w4-to-tp-pp": (["fsdp", "--workers", "4", "--zero-stage", "1", "--tp", "2"],
                                  ["tp", "--workers", "4", "--pp", "2", "--microbatches", "2"], GPT),
    "gpt-pipeline-w2-to-tp-pp-w4": (["pipeline", "--workers", "2", "--microbatches", "2"],
                                    ["tp", "--workers", "4", "--pp", "2", "--microbatches", "2"], GPT),
}


def test_a_resume_says_what_it_cannot_carry():
    """PowerSGD's error feedback and warm start are not in a checkpoint: a resume from such a run says so
    at start; a run without them is not told."""
    from types import SimpleNamespace

    import torch.nn as nn

    from paralab.run.checkpoint import carried_notes
    new = SimpleNamespace(strategy="ddp", world=2, compress=None)
    model = nn.Sequential(nn.Linear(2, 2))
    said = carried_notes(SimpleNamespace(strategy="ddp", world=4, compress="powersgd"), new, model)
    assert any(n.startswith("NOT carried: PowerSGD") for n in said)
    assert not any("PowerSGD" in n for n in carried_notes(SimpleNamespace(strategy="ddp", world=4, compress=None),
                                                           new, model))



@pytest.mark.slow
@pytest.mark.parametrize("first,second,common", MATRIX.values(), ids=MATRIX.keys())
def test_layout_a_then_b_equals_one_process(paralab, tmp_path, single, first, second, common):
    _, b = resume_across(paralab, tmp_path, first, second, common)
    assert_equals_single(b, single(common))


def test_a_restart_goes_back_to_the_other_layouts_checkpoint(paralab, tmp_path, single):
    """--max-restarts on a resharded run: a rank that dies before this run's first checkpoint sends the
    group back to the checkpoint it resumed from, resharded again; the end is still one process's."""
    a = paralab("train", "fsdp", "--workers", "2", *VGG, "--num-batches", "5", out=tmp_path / "a")
    b = paralab("train", "ddp", "--workers", "2", *VGG, "--num-batches", "10", "--resume", str(a.out),
                "--checkpoint-every", "4", "--max-restarts", "1", out=tmp_path / "b",
                env={"PARALAB_FAULT": "1:6:raise:1"})
    assert a.returncode == b.returncode == 0, b.stdout + b.stderr
    restarts = b.summary["restarts"]
    assert len(restarts) == 1 and restarts[0]["resumed_from_step"] == 5 and restarts[0]["from"] == str(a.out)
    mine, theirs = consolidate(b.out)[0], consolidate(single(VGG))[0]
    assert max((mine[k] - theirs[k]).abs().max().item() for k in theirs) < WEIGHTS
