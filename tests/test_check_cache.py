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


def test_the_same_reference_has_the_same_digest_and_anything_it_reads_changes_it():
    base = kept.digest(CFG, reference(), 3)
    assert kept.digest(CFG, reference(), 3) == base
    # only how the run is laid out, recorded or launched: the same reference
    for field, value in (("strategy", "fsdp"), ("bucket_mb", 0.5), ("workers", 2), ("log_every", 1)):
        assert kept.digest(dataclasses.replace(CFG, **{field: value}), reference(), 3) == base, field
    # what the reference reads: another one
    others = {
        "an option of the model": kept.digest(dataclasses.replace(CFG, width=0.5), reference(), 3),
        "the learning rate": kept.digest(CFG, reference(lr=0.1), 3),
        "the batches": kept.digest(CFG, reference(seed=1), 3),
        "the shards": kept.digest(CFG, reference(replicas=1), 3),
        "the microbatches": kept.digest(CFG, reference(microbatches=2), 3),
        "the BatchNorm rule over shards": kept.digest(CFG, reference(bn_rule="sequential"), 3),
        "the steps": kept.digest(CFG, reference(), 4),
    }
    ref = reference()
    with torch.no_grad():
        next(ref.model.parameters())[0].view(-1)[0] += 1e-7  # one starting weight, by one rounding step or so
    others["a starting weight"] = kept.digest(CFG, ref, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        others["the thread count"] = kept.digest(CFG, reference(), 3)
    finally:
        torch.set_num_threads(threads)
    assert all(d != base for d in others.values()), [k for k, d in others.items() if d == base]
    # one shard: its statistics are all of them, so the two BatchNorm rules agree
    assert kept.digest(CFG, reference(replicas=1, bn_rule="sequential"), 3) == others["the shards"]


def test_only_an_untrained_reference_without_compression_is_shared():
    ref = reference()
    assert kept.usable(CFG, ref)
    assert not kept.usable(dataclasses.replace(CFG, check_cache=None), ref)
    assert not kept.usable(CFG, SimpleNamespace(**{**vars(ref), "step": 2}))
    assert not kept.usable(CFG, SimpleNamespace(**{**vars(ref), "compression": object()}))


def test_kept_weights_load_and_anything_else_is_refused(tmp_path):
    trained = reference()
    with torch.no_grad():
        for p in trained.model.parameters():
            p.mul_(1.5)
    assert kept.keep(tmp_path, "a" * 64, trained.model) is None
    fresh = reference().model
    assert kept.load(tmp_path, "a" * 64, fresh) is None
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.model.state_dict().values()))
    assert kept.load(tmp_path, "b" * 64, reference().model) == "none kept yet"
    # a file under another digest's name (its first 32 digits agree), a damaged one, another model's
    kept.path_for(tmp_path, "a" * 32 + "c" * 32).write_bytes(kept.path_for(tmp_path, "a" * 64).read_bytes())
    assert "kept for another reference" in kept.load(tmp_path, "a" * 32 + "c" * 32, reference().model)
    kept.path_for(tmp_path, "d" * 64).write_bytes(kept.path_for(tmp_path, "a" * 64).read_bytes()[:1000])
    untouched = reference().model
    assert "did not load" in kept.load(tmp_path, "d" * 64, untouched)
    assert all(torch.equal(a, b) for a, b in zip(untouched.state_dict().values(),
                                                 reference().model.state_dict().values()))
    torch.manual_seed(0)
    assert kept.keep(tmp_path, "e" * 64, build_model("vgg11", width=0.25)) is None
    assert "other tensors" in kept.load(tmp_path, "e" * 64, reference().model)
    # a folder that cannot be written only means nothing is kept
    (tmp_path / "file").write_text("")
    assert kept.keep(tmp_path / "file" / "sub", "f" * 64, trained.model).startswith("not kept")


def test_runs_share_a_reference_and_are_still_checked_against_it(paralab, tmp_path):
    cache = tmp_path / "kept"
    args = ("--workers", "2", "--num-batches", "3", "--check", "--check-cache", str(cache))
    first = paralab("train", "ddp", *args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "check: training the single-process reference" in first.stdout
    (path,) = cache.glob("reference-*.pt")
    second = paralab("train", "allreduce", *args)  # another flavour, the same shards: the same reference
    assert second.returncode == 0, second.stderr[-2000:]
    assert "is the one an earlier run trained" in second.stdout
    assert second.summary["check"]["max_weight_dev"] == first.summary["check"]["max_weight_dev"] == 0.0
    # the loaded weights are what the run is compared with: a kept reference that is off fails the check
    saved = torch.load(path, weights_only=True)
    saved["state"]["0.0.weight"] += 1e-3
    torch.save(saved, path)
    third = paralab("train", "ddp", *args)
    assert third.returncode == 1
    assert "is the one an earlier run trained" in third.stdout and "check: FAIL" in third.stdout
