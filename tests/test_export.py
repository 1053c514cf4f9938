"""`paralab export`: one plain state_dict from any strategy's checkpoint, and (issue 13, item 4) rank files
of replicated strategies that agree.

Every layout is trained for 2 steps at lr 1e-3 and exported offline (one process, no process group):

- without BatchNorm (``--norm none``) data parallelism computes what one process computes, so each
  layout's export must equal ``single``'s within the --check tolerance (atol 1e-5): a full model per rank
  (ddp), padded flat shards (fsdp stage 3 on 3 workers: the units do not divide by 3), DTensor chunks
  (torch-fsdp on 3 workers: uneven dim-0 chunks), per-stage key sets (pipeline, 2 microbatches, 1f1b)
  and data x pipeline (fsdp --zero-stage 1 --pp 2: ZeRO-1 stages on 2 replicas);
- with BatchNorm each replica normalises its own shard, so data parallelism is *not* single's
  arithmetic (--check replays the split instead); there every data-parallel layout must equal ``ddp``'s
  (itself checked with --check), BatchNorm statistics included, and ``model`` (one stage at a time, the
  whole batch) must equal ``single``'s;
- ``--save-init`` keeps every layout's starting state: its export is the seeded model, bit for bit.

That matrix (14 short runs, about 2 minutes on 2 cores) is marked ``slow`` (``make test-slow``); the
default suite keeps one torch-ddp run (the stale BatchNorm statistics of item 4, and its export) and the
refusals, which need no training.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import commit_generation, run_paralab
from paralab.run.checkpoint import load
from paralab.cli import main
from paralab.models import build_model

ATOL = 1e-5  # --check's tolerance on weights
STEPS = ["--num-batches", "2", "--lr", "1e-3", "--batch-size", "48", "--save-init"]

RUNS = {
    # --norm none: every layout against single
    "single-none": ["single", "--norm", "none"],
    "ddp-none": ["ddp", "--workers", "2", "--norm", "none"],
    "fsdp3-w3-none": ["fsdp", "--zero-stage", "3", "--workers", "3", "--norm", "none"],
    "torch-fsdp-w3-none": ["torch-fsdp", "--workers", "3", "--norm", "none"],
    "pipeline-none": ["pipeline", "--workers", "2", "--microbatches", "2", "--schedule", "1f1b", "--norm", "none"],
    "fsdp1-pp2-none": ["fsdp", "--zero-stage", "1", "--workers", "4", "--pp", "2", "--norm", "none"],
    # BatchNorm: the replicated data-parallel strategies against ddp, model against single
    "single": ["single"],
    "model": ["model", "--workers", "2"],
    "ddp": ["ddp", "--workers", "2", "--check"],
    "gather-scatter": ["gather-scatter", "--workers", "2"],
    "allreduce": ["allreduce", "--workers", "2"],
    "torch-ddp": ["torch-ddp", "--workers", "2"],
    "fsdp1": ["fsdp", "--zero-stage", "1", "--workers", "2"],
    "fsdp2": ["fsdp", "--zero-stage", "2", "--workers", "2"],
}
AGAINST = {name: "single-none" for name in RUNS if name.endswith("-none") and name != "single-none"} | {
    "model": "single", "gather-scatter": "ddp", "allreduce": "ddp", "torch-ddp": "ddp", "fsdp1": "ddp",
    "fsdp2": "ddp"}
REPLICATED = ("gather-scatter", "allreduce", "ddp", "torch-ddp", "fsdp1", "fsdp2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, args in RUNS.items():
        r = run_paralab("train", *args, *STEPS, out=root / name)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        if "--check" in args:
            assert "check: PASS" in r.stdout, r.stdout[-2000:]
        out[name] = r.out
    return out


def export(run: Path, *args: str) -> dict[str, torch.Tensor]:
    target = run / "exported" / ("init.pt" if "--init" in args else "model.pt")
    assert main(["export", str(run), "-o", str(target), "--force", *args]) == 0
    return torch.load(target, weights_only=True)


def seeded_model(norm: str) -> torch.nn.Module:
    torch.manual_seed(0)  # as every rank builds it (worker.build_model_factory, --seed 0)
    return build_model("vgg11", width=0.125, norm=norm, num_classes=10)


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert list(a) == list(b)
    return max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first of these trains every run
@pytest.mark.parametrize("name", sorted(AGAINST))
def test_export_equals_the_same_arithmetic_in_one_process(runs, name, capsys):
    mine = export(runs[name])
    assert f"exported {RUNS[name][0]}'s weights at step 2" in capsys.readouterr().out
    reference = export(runs[AGAINST[name]])
    worst, key = max_diff(mine, reference)
    assert worst <= ATOL, f"{name} vs {AGAINST[name]}: {key} differs by {worst:.3g}"
    print(f"{name} vs {AGAINST[name]}: max |diff| {worst:.3g} ({key})")
    norm = "none" if name.endswith("-none") else "batch"
    model = seeded_model(norm)
    moved, _ = max_diff(mine, model.state_dict())
    assert moved > 10 * ATOL, moved  # training moved the weights: the comparison above is not vacuous
    model.load_state_dict(mine)  # strict: the plain model's keys and shapes
    if norm == "batch":  # BatchNorm statistics came along, and training moved them
        assert any(k.endswith("running_mean") and v.abs().sum() > 0 for k, v in mine.items())
        assert all(mine[k].item() == 2 for k in mine if k.endswith("num_batches_tracked"))


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first of these trains every run
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_starting_weights_export_bit_for_bit(runs, name):
    init = export(runs[name], "--init")
    expected = seeded_model("none" if name.endswith("-none") else "batch").state_dict()
    assert list(init) == list(expected)
    assert all(torch.equal(init[k], expected[k]) for k in expected)


def assert_rank_files_agree(run: Path, name: str) -> None:
    states = [load(run, r)["state"] for r in (0, 1)]
    if name.startswith("fsdp"):  # the parameters are this rank's shards; the buffers are the replica's
        tensors = [s["buffers"] for s in states]
        assert len(states[0]["shards"]) == len(states[1]["shards"])
    else:
        tensors = [s["model"] for s in states]
    assert any(k.endswith("running_var") for k in tensors[0])
    assert list(tensors[0]) == list(tensors[1])
    different = [k for k in tensors[0] if not torch.equal(tensors[0][k], tensors[1][k])]
    assert not different, f"{name}: rank files differ in {different}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first of these trains every run
@pytest.mark.parametrize("name", REPLICATED)
def test_replicated_rank_files_hold_identical_model_tensors(runs, name):
    """Item 4: rank 1's file holds rank 0's BatchNorm statistics, not its own (torch-ddp broadcast them
    only at its next forward), and every replica's weights."""
    assert_rank_files_agree(runs[name], name)


def test_torch_ddp_rank_files_hold_rank0s_batchnorm_statistics(tmp_path, capsys):
    """Item 4 in the default suite: PyTorch's DDP leaves each rank its own statistics after the last
    step (up to 7e-3 apart); the checkpoint synchronises them first. The export is rank 0's model."""
    r = run_paralab("train", "torch-ddp", "--workers", "2", *STEPS, out=tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_rank_files_agree(r.out, "torch-ddp")
    exported = export(r.out)
    saved = load(r.out, 0)["state"]["model"]
    assert list(exported) == list(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert "exported torch-ddp's weights at step 2 (TorchDDP, 2 rank file(s))" in capsys.readouterr().out


def fake_run(run: Path, strategy: str, workers: int, ranks) -> Path:
    """A run directory holding the checkpoint a data-parallel run of the seeded model would commit (the files
    of ``ranks``; the manifest lists every rank's)."""
    from paralab.run import checkpoint
    from paralab.run.config import RunConfig
    cfg = RunConfig(strategy=strategy, workers=workers, width=0.125, norm="none", dataset="synthetic").validate()
    identity = checkpoint.identity(cfg)
    payload = {"step": 3, "identity": identity, "losses": "[]",
               "state": {"model": seeded_model("none").state_dict(), "optimizer": {}}}
    commit_generation(run, 3, identity, {rank: payload for rank in ranks}, workers)
    return run


def test_export_refuses_what_it_cannot_do(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "has no complete checkpoint" in err and "--checkpoint-every" in err and not (empty / "model.pt").exists()
    assert main(["export", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err

    # --init needs a run made with --save-init
    run = fake_run(tmp_path / "ddp", "ddp", 2, ranks=(0, 1))
    assert main(["export", str(run), "--init"]) == 2
    assert "--save-init" in capsys.readouterr().err

    # an existing output is kept unless --force
    target = tmp_path / "model.pt"
    target.write_text("keep me")
    assert main(["export", str(run), "-o", str(target)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and target.read_text() == "keep me"
    assert main(["export", str(run), "-o", str(target), "--force"]) == 0
    assert "weights at step 3" in capsys.readouterr().out
    exported, expected = torch.load(target, weights_only=True), seeded_model("none").state_dict()
    assert list(exported) == list(expected) and all(torch.equal(exported[k], expected[k]) for k in expected)

    # every rank's file is needed (a sharded layout could not do without it)
    run = fake_run(tmp_path / "half", "ddp", 2, ranks=(0,))
    assert main(["export", str(run), "-o", str(tmp_path / "other.pt")]) == 2
    assert "rank1.pt is missing" in capsys.readouterr().err and not (tmp_path / "other.pt").exists()


class Payload:
    """What a crafted checkpoint would carry: a call made while unpickling."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_refused_without_running_anything(tmp_path, capsys):
    """Even committed (its manifest's sum matches it), a file holding a pickled call is read with
    weights_only: refused, and the call never made."""
    marker = tmp_path / "ran"
    commit_generation(tmp_path / "run", 1, {"world": 1}, {0: {"step": 1, "identity": {"world": 1},
                                                             "state": Payload(marker)}}, 1)
    assert main(["export", str(tmp_path / "run")]) == 2
    assert "not a readable paralab checkpoint" in capsys.readouterr().err
    assert not marker.exists()
