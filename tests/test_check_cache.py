"""--check-cache (check/kept.py): a reference is shared only where it is the same, and a shared one is
still what the run is checked against."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from paralab.check import kept
from paralab.models import build_model
from paralab.run.config import RunConfig


class Batches:
    """A data source as the reference reads it: ``batch(step, rank)``, from a seed."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def batch(self, step: int, rank: int | None = None):
        g = torch.Generator().manual_seed(1000 * self.seed + 10 * step + (rank or 0))
        return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def reference(lr=0.05, replicas=2, microbatches=1, bn_rule="first-replica", seed=0):
    torch.manual_seed(0)
    model = build_model("vgg11", width=0.125)
    return SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                           replicas=replicas, microbatches=microbatches, bn_rule=bn_rule, step=0,
                           lr_for=lambda step: lr, source=Batches(seed), compression=None)


CFG = RunConfig(check=True, check_cache="unused")
STEPS = [1, 2, 3]  # the checked steps


def test_the_same_reference_has_the_same_digest_and_anything_it_reads_changes_it():
    base = kept.digest(CFG, reference(), STEPS)
    assert kept.digest(CFG, reference(), STEPS) == base
    # only how the run is laid out, recorded or launched: the same reference
    for field, value in (("strategy", "fsdp"), ("bucket_mb", 0.5), ("workers", 2), ("log_every", 1)):
        assert kept.digest(dataclasses.replace(CFG, **{field: value}), reference(), STEPS) == base, field
    # what the reference reads: another one
    others = {
        "an option of the model": kept.digest(dataclasses.replace(CFG, width=0.5), reference(), STEPS),
        "the learning rate": kept.digest(CFG, reference(lr=0.1), STEPS),
        "the batches": kept.digest(CFG, reference(seed=1), STEPS),
        "the shards": kept.digest(CFG, reference(replicas=1), STEPS),
        "the microbatches": kept.digest(CFG, reference(microbatches=2), STEPS),
        "the BatchNorm rule over shards": kept.digest(CFG, reference(bn_rule="sequential"), STEPS),
        "the steps": kept.digest(CFG, reference(), [1, 2, 4]),
        "the checked steps": kept.digest(CFG, reference(), [1, 3]),
        "a strategy's lossy wire (the band's)": kept.digest(CFG, reference(), STEPS, torch.float16),
        "held to exact (no band kept)": kept.digest(CFG, reference(), STEPS, held=True),
    }
    ref = reference()
    with torch.no_grad():
        next(ref.model.parameters())[0].view(-1)[0] += 1e-7  # one starting weight, by one rounding step or so
    others["a starting weight"] = kept.digest(CFG, ref, STEPS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        others["the thread count"] = kept.digest(CFG, reference(), STEPS)
    finally:
        torch.set_num_threads(threads)
    assert all(d != base for d in others.values()), [k for k, d in others.items() if d == base]
    # one shard: its statistics are all of them, so the two BatchNorm rules agree
    assert kept.digest(CFG, reference(replicas=1, bn_rule="sequential"), STEPS) == others["the shards"]


def test_only_an_untrained_reference_without_compression_is_shared():
    ref = reference()
    assert kept.usable(CFG, ref)
    assert not kept.usable(dataclasses.replace(CFG, check_cache=None), ref)
    assert not kept.usable(CFG, SimpleNamespace(**{**vars(ref), "step": 2}))
    assert not kept.usable(CFG, SimpleNamespace(**{**vars(ref), "compression": object()}))


def snapshots(model, steps=STEPS, scale=1.0) -> dict:
    """What a reference keeps: its weights (scaled) and optimizer state after each checked step."""
    from paralab.check.reference import optimizer_state
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return {s: kept.Snapshot(s, {k: v.clone() for k, v in model.state_dict().items()}, optimizer_state(model, opt))
            for s in steps}


LOSSES = {step: [2.0 + step, 2.5 + step] for step in range(3)}


def test_kept_snapshots_load_and_anything_else_is_refused(tmp_path):
    trained = reference()
    kept_snaps = snapshots(trained.model, scale=1.5)
    assert kept.keep(tmp_path, "a" * 64, kept_snaps, LOSSES) is None
    fresh = reference().model
    loaded, why = kept.load(tmp_path, "a" * 64, fresh, STEPS, 2)
    assert why is None and loaded["losses"] == LOSSES
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.model.state_dict().values()))
    for step in STEPS:
        snap = loaded["snapshots"][step]
        assert snap.step == step and set(snap.optimizer) == set(kept_snaps[step].optimizer)
        assert all(torch.equal(snap.optimizer[n]["momentum_buffer"], kept_snaps[step].optimizer[n]["momentum_buffer"])
                   for n in snap.optimizer)
    assert kept.load(tmp_path, "b" * 64, reference().model, STEPS, 2) == (None, "none kept yet")
    # other checked steps or shards than the file holds
    assert "other steps or shards" in kept.load(tmp_path, "a" * 64, reference().model, [1, 2, 4], 2)[1]
    assert "other steps or shards" in kept.load(tmp_path, "a" * 64, reference().model, STEPS, 3)[1]
    # a file under another digest's name (its first 32 digits agree), a damaged one, another model's
    kept.path_for(tmp_path, "a" * 32 + "c" * 32).write_bytes(kept.path_for(tmp_path, "a" * 64).read_bytes())
    assert "kept for another reference" in kept.load(tmp_path, "a" * 32 + "c" * 32, reference().model, STEPS, 2)[1]
    kept.path_for(tmp_path, "d" * 64).write_bytes(kept.path_for(tmp_path, "a" * 64).read_bytes()[:1000])
    untouched = reference().model
    assert "did not load" in kept.load(tmp_path, "d" * 64, untouched, STEPS, 2)[1]
    assert all(torch.equal(a, b) for a, b in zip(untouched.state_dict().values(),
                                                 reference().model.state_dict().values()))
    torch.manual_seed(0)
    assert kept.keep(tmp_path, "e" * 64, snapshots(build_model("vgg11", width=0.25)), LOSSES) is None
    assert "other tensors" in kept.load(tmp_path, "e" * 64, reference().model, STEPS, 2)[1]
    # a folder that cannot be written only means nothing is kept
    (tmp_path / "file").write_text("")
    assert kept.keep(tmp_path / "file" / "sub", "f" * 64, kept_snaps, LOSSES).startswith("not kept")


def test_runs_share_a_reference_and_are_still_checked_against_it(paralab, tmp_path):
    cache = tmp_path / "kept"
    args = ("--workers", "2", "--num-batches", "3", "--check", "--check-cache", str(cache))
    first = paralab("train", "ddp", *args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "check: the single-process reference trains beside the run" in first.stdout
    (path,) = cache.glob("reference-*.pt")
    second = paralab("train", "allreduce", *args)  # another flavour, the same shards: the same reference
    assert second.returncode == 0, second.stderr[-2000:]
    assert "is the one an earlier run trained" in second.stdout
    assert second.summary["check"]["max_weight_dev"] == first.summary["check"]["max_weight_dev"] == 0.0
    # what was loaded is what the run is compared with: a kept reference that is off in any part (the
    # weights after step 2 only, the momentum after step 1 only, one step's loss) fails the check
    pristine = torch.load(path, weights_only=True)
    for change, kind in ((lambda k: k["snapshots"][1]["weights"]["0.0.weight"].add_(1e-3), "weights"),
                         (lambda k: k["snapshots"][0]["optimizer"]["0.0.weight"]["momentum_buffer"].add_(1e-3),
                          "optimizer"),
                         (lambda k: k["losses"][1].add_(1e-3), "loss")):
        saved = torch.load(path, weights_only=True)
        change(saved)
        torch.save(saved, path)
        third = paralab("train", "ddp", *args)
        assert third.returncode == 1, kind
        assert "is the one an earlier run trained" in third.stdout and "check: FAIL" in third.stdout
        assert third.summary["check"]["failed"] == [kind]
        torch.save(pristine, path)
