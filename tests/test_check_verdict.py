"""What ``--check`` compares, and when: check/verdict.py in one process, with bugs seeded into a real run.

A strategy that is right at the end but wrong in between, or right in its
weights but wrong in the loss it reports, must FAIL: the verdict is the worst
deviation of any kind, at any checked step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paralab.check.verdict import Check, checked_steps, unexercised
from paralab.data.loader import to_device
from paralab.run.config import RunConfig
from paralab.run.worker import build_optimizer_factory, set_up


@pytest.mark.parametrize("start,total,every,steps", [
    (0, 3, None, [1, 2, 3]),           # the first, the second (momentum has history), the last
    (0, 1, None, [1]),
    (0, 2, None, [1, 2]),
    (5, 10, None, [6, 7, 10]),         # a resumed run: its own first steps
    (0, 20, 5, [1, 2, 5, 10, 15, 20]),
    (0, 7, 3, [1, 2, 3, 6, 7]),
])
def test_checked_steps(start, total, every, steps):
    assert checked_steps(start, total, every) == steps


def one_process(tmp_path, **options):
    cfg = RunConfig(strategy="single", dataset="synthetic", synthetic_size=64, width=0.125, batch_size=8,
                    num_batches=3, check=True, eval_batches=1, progress=False, **options).validate()
    return cfg, set_up(cfg, 0, 1, torch.device("cpu"), "gloo", tmp_path)


def run(cfg, s, perturb=None, misreport=None, checks: list | None = None) -> dict:
    """Train ``s``'s strategy with its check as the worker does; ``perturb(step)`` is added to every weight the
    check reads after that step, ``misreport(step)`` to the loss it reports; the check goes into ``checks``."""
    strategy = s.strategy
    whole = strategy.full_state_dict
    if perturb:
        strategy.full_state_dict = lambda: {k: v + perturb(step) if v.is_floating_point() else v
                                            for k, v in whole().items()}
    check = Check(cfg, strategy, s.source, s.model_fn, build_optimizer_factory(cfg), s.lr_for, s.comm,
                  lambda *a: None, start=0, total=s.total_steps)
    if checks is not None:
        checks.append(check)
    losses = []
    for step in range(s.total_steps):
        x, y = s.source.batch(step)
        loss = strategy.train_step(to_device(x, x.device, s.dtype), y).loss
        losses.append([step, loss + (misreport(step) if misreport else 0.0)])
        step += 1  # the step just finished, as the check counts them
        check.after_step(step)
    return check.finish(losses, 0)


def test_exact_in_fp64_at_every_checked_step(tmp_path):
    cfg, s = one_process(tmp_path)
    verdict = run(cfg, s)
    assert verdict["passed"] and cfg.precision == "fp64" and verdict["steps"] == [1, 2, 3]
    assert [h["step"] for h in verdict["history"]] == [1, 2, 3]
    for kind in ("weight", "optimizer", "loss", "output"):
        assert verdict[f"max_{kind}_dev"] is not None and verdict[f"max_{kind}_dev"] <= 1e-12, kind


def test_a_deviation_that_comes_and_goes_fails(tmp_path):
    """Off after step 2 only, exact at the end: the last step alone would PASS it."""
    cfg, s = one_process(tmp_path)
    verdict = run(cfg, s, perturb=lambda step: 1e-3 if step == 2 else 0.0)
    assert not verdict["passed"] and verdict["failed"] == ["weights"]
    assert verdict["history"][1] == {"step": 2, "max_weight_dev": pytest.approx(1e-3)}
    assert verdict["history"][2]["max_weight_dev"] <= 1e-12  # the last step is exact


def test_a_loss_reported_wrong_at_one_step_fails(tmp_path):
    cfg, s = one_process(tmp_path)
    verdict = run(cfg, s, misreport=lambda step: 0.5 if step == 1 else 0.0)
    assert not verdict["passed"] and verdict["failed"] == ["loss"]
    line = verdict["ranks"][0]["lines"][-2]
    assert line.startswith("loss: FAIL") and "step 2" in line  # the second step, counted from 1


def forget_optimizer_state(s) -> None:
    """Seed a bug into ``s``'s strategy: the optimizer's state dropped after each step (momentum starts over)."""
    step = s.strategy.dp.step

    def forgetful():
        step()
        s.strategy.dp.optimizer.state.clear()
    s.strategy.dp.step = forgetful


def test_lost_optimizer_state_fails(tmp_path):
    cfg, s = one_process(tmp_path)
    forget_optimizer_state(s)
    verdict = run(cfg, s)
    assert not verdict["passed"] and "optimizer" in verdict["failed"]


def test_what_a_check_leaves_out_is_said(tmp_path):
    cfg, s = one_process(tmp_path)
    notes = unexercised(dataclasses.replace(cfg, num_batches=1), s.strategy, 0, 1)
    assert any(n.startswith("one step:") and "--num-batches 2" in n for n in notes)
    assert not unexercised(cfg, s.strategy, 0, 3)
    sgd = dataclasses.replace(cfg, momentum=0.0)
    assert not unexercised(sgd, s.strategy, 0, 1)  # plain SGD keeps no state: one step leaves nothing out


def test_the_compare_reports_check_column_names_what_failed():
    from paralab.report.page import check_text
    passed = {"check": {"result": "PASS", "failed": [], "max_weight_dev": 1e-14, "max_optimizer_dev": 3e-13,
                        "max_loss_dev": 0.0, "max_output_dev": 2e-13}}
    assert check_text(passed) == "PASS (3e-13)"  # the largest deviation of any kind
    failed = {"check": {"result": "FAIL", "failed": ["loss"], "max_weight_dev": 1e-14, "max_optimizer_dev": 3e-13,
                        "max_loss_dev": 2.6, "max_output_dev": 2e-13}}
    assert check_text(failed) == "FAIL loss (2.6e+00)"
    older = {"check": {"result": "PASS", "max_weight_dev": 1e-6, "max_output_dev": 2e-5}}  # before losses were
    assert check_text(older) == "PASS (2e-05)" and check_text(None) == "-"
    # the verdict's word where a run has one: exact, within rounding (with its worst ratio to the band), a bug's ratio
    assert check_text({"check": passed["check"] | {"verdict": "exact"}}) == "PASS exact (3e-13)"
    rounding = passed["check"] | {"verdict": "within rounding", "worst_ratio": 0.314}
    assert check_text({"check": rounding}) == "PASS within rounding (0.31 of band)"
    bug = failed["check"] | {"verdict": "bug", "worst_ratio": 1234.5}
    assert check_text({"check": bug}) == "FAIL loss (2.6e+00, 1.23e+03 x band)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_chunked_deviation_is_the_whole_tensors(monkeypatch, dtype):
    """check/reference.py compares a chunk at a time (no model-sized float64 temporaries): the same max |m - r|
    as the whole tensors in float64, wherever the worst element falls against the chunks, and NaN kept."""
    from paralab.check import reference
    monkeypatch.setattr(reference, "CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5, 11, generator=g).to(dtype)
    for at in (0, 6, 7, 54):  # a chunk's first and last elements, the tensor's last
        r = m.clone()
        r.view(-1)[at] += 0.5
        r.view(-1)[3] -= 0.25
        whole = float((m.double() - r.double()).abs().max())
        assert reference.max_abs_diff(m, r) == whole > 0
    assert reference.max_abs_diff(m, m.clone()) == 0.0
    nan = m.clone()
    nan.view(-1)[40] = float("nan")
    assert reference.max_abs_diff(m, nan) != reference.max_abs_diff(m, nan)
    worst = reference.compare_tensors("weights", {"w": m}, {"w": nan}, 1e-5)
    assert worst.max_abs == float("inf") and not worst.ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_narrow_dtypes_deviation_is_exact_though_subtracted_in_its_own_dtype_first(dtype):
    """max_abs_diff subtracts float32/16 tensors in their own dtype to find where the worst can be, then those
    again in float64: the answer is float64's exactly, on values of every scale, near-ties (differences that
    round alike) and a difference that overflows the dtype."""
    from paralab.check import reference
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        scale = 10.0 ** int(torch.randint(-6, 4, (1,), generator=g))
        m = (torch.randn(n, generator=g) * scale).to(dtype)
        noise = torch.randn(n, generator=g, dtype=torch.float64) * scale * 10.0 ** int(torch.randint(-6, 0, (1,), generator=g))
        r = (m.double() + noise).to(dtype)
        assert reference.max_abs_diff(m, r) == float((m.double() - r.double()).abs().max()), trial
    big = torch.finfo(dtype).max / 1.5
    m, r = torch.tensor([big, 1.0], dtype=dtype), torch.tensor([-big, 1.0], dtype=dtype)
    assert reference.max_abs_diff(m, r) == 2 * float(m[0].double())


def test_the_replicas_comparison_reads_bits_and_a_differing_nan_fails():
    """check/verdict.py broadcasts rank 0's weights as bytes: equal bits (an equal NaN too) are 0, a one-ulp
    difference is its size as a number, a NaN on one side only is inf (a FAIL), across dtypes of odd sizes."""
    from paralab.check.reference import bits_deviation
    mine = [torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16), torch.tensor([0.5, float("nan")]),
            torch.arange(3, dtype=torch.float64)]

    def theirs(change=None):
        copy = [t.clone() for t in mine]
        if change:
            change(copy)
        return torch.cat([t.view(torch.uint8) for t in copy])
    assert bits_deviation(mine, theirs()) == 0.0

    def ulp(c):
        c[2][1] = torch.nextafter(c[2][1], torch.tensor(2.0, dtype=torch.float64))
    assert bits_deviation(mine, theirs(ulp)) == float(torch.finfo(torch.float64).eps)

    def nan(c):
        c[0][0] = float("nan")
    assert bits_deviation(mine, theirs(nan)) == float("inf")


DRIFTS = '''import torch
from paralab.strategies.replicas import Replicas


class RankOneKeepsItsOwn(Replicas):
    """Rank 0 takes the mean gradient; rank 1 joins the all-reduce but steps on its own gradient."""
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            mine = p.grad.clone()
            self.comm.all_reduce(p.grad)
            p.grad.copy_(p.grad / self.comm.world if self.comm.rank == 0 else mine)
'''

def _rank_lines(stdout: str) -> dict[int, str]:
    return {int(line.split()[2].rstrip(":")): line for line in stdout.splitlines() if line.startswith("check rank ")}


def _deviation(line: str, kind: str) -> float:
    return float(line.split(f"{kind}: ")[1].split("max |diff| ")[1].split()[0])


def test_a_rank_whose_weights_differ_from_rank_0s_is_compared_with_the_reference_itself(tmp_path):
    """The reference trains on rank 0 only: a rank whose weights hold rank 0's bits has rank 0's deviation, and
    one whose weights differ (a replica that drifted, a view with other tensors) is sent the reference's weights
    and compared with them, so its own deviation is found, not rank 0's. One step: rank 0's is then exact."""
    from conftest import run_paralab
    small = ["--workers", "2", "--dataset", "synthetic", "--width", "0.125", "--num-batches", "1",
             "--batch-size", "32", "--precision", "fp64", "--check", "--no-first-divergence"]
    (tmp_path / "drifts.py").write_text(DRIFTS)
    r = run_paralab("train", str(tmp_path / "drifts.py"), *small, out=tmp_path / "drifts")
    assert r.returncode == 1 and "check: FAIL" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _rank_lines(r.stdout)
    assert "weights: PASS" in lines[0] and _deviation(lines[0], "weights") < 1e-12, lines[0]
    # rank 1 against the reference: as far as from rank 0, which equals the reference to rounding
    assert "weights: FAIL" in lines[1] and "replicas: FAIL" in lines[1], lines[1]
    assert _deviation(lines[1], "weights") > 1e-6
    assert _deviation(lines[1], "weights") == pytest.approx(_deviation(lines[1], "replicas"), rel=1e-6)



class _RankOne:
    """Rank 1 of 2, whose peers' collectives are played from what rank 0 holds."""
    rank, world = 1, 2

    def __init__(self, rank0: dict):
        self.rank0 = rank0

    def all_gather_objects(self, mine):
        return [[[k, str(v.dtype), list(v.shape)] for k, v in self.rank0.items()], mine]

    def broadcast(self, t, src, name):
        t.copy_(torch.cat([v.contiguous().reshape(-1).view(torch.uint8) for v in self.rank0.values()]))


@pytest.mark.parametrize("change,deviation,where", [
    (None, 0.0, "bit-identical to rank 0"),
    (lambda w: w["b"].add_(1), 1.0, "bit-identical to rank 0"),           # an integer buffer counts too
    (lambda w: w.update(extra=torch.zeros(2)), float("inf"), "other tensors than rank 0's"),
    (lambda w: w.update(a=w["a"].float()), float("inf"), "other tensors than rank 0's"),
])
def test_a_replica_is_compared_bit_by_bit_where_its_tensors_are_rank_0s(change, deviation, where):
    """A view whose names, dtypes or shapes differ from rank 0's is not laid against rank 0's bytes (a broadcast
    of another size would fail or hang): it is infinitely far, and then compared with the reference itself."""
    from types import SimpleNamespace
    rank0 = {"a": torch.arange(4, dtype=torch.float64), "b": torch.tensor([3])}
    mine = {k: v.clone() for k, v in rank0.items()}
    if change:
        change(mine)
    c = Check.replicas_comparison(SimpleNamespace(comm=_RankOne(rank0)), mine, step=1)
    assert (c.what, c.max_abs, c.worst, c.step) == ("replicas", deviation, where, 1)


def test_an_epochs_short_last_batch_is_said_where_no_step_held_one(paralab):
    """A check whose steps all held the full batch says so with the --num-batches that reaches the epoch's short
    last batch; the same run taken there (a step of 4 rows per rank instead of 8) says nothing of it."""
    common = ("train", "ddp", "--workers", "2", "--synthetic-size", "40", "--batch-size", "16", "--check")
    before = paralab(*common, "--num-batches", "2")
    reached = paralab(*common, "--num-batches", "3")
    assert before.returncode == 0 and reached.returncode == 0, before.stderr[-2000:] + reached.stderr[-2000:]
    note = ("the run ends at step 2, before the epoch's short last batch (step 3: 8 samples, the others 16), so an "
            "epoch's short last batch (fewer rows on every rank than the batch configured) is not exercised: "
            "--num-batches 3")
    assert f"check: not exercised: {note}" in before.stdout and note in before.summary["check"]["unexercised"][-1]
    assert "short last batch" not in reached.stdout
    assert not any("short last batch" in n for n in reached.summary["check"]["unexercised"])


def test_a_dataset_that_divides_into_full_batches_is_said_and_drop_last_never():
    from types import SimpleNamespace

    from paralab.check.verdict import short_batch_note
    from paralab.data.loader import BatchSource

    def source(name, n, drop_last=False):
        data = SimpleNamespace(name=name, train_y=torch.zeros(n, dtype=torch.long))
        return SimpleNamespace(data=data, per_rank_batch=8, replicas=2, global_batch=16, drop_last=drop_last,
                               steps_per_epoch=BatchSource.steps_per_epoch.fget(
                                   SimpleNamespace(data=data, replicas=2, per_rank_batch=8, drop_last=drop_last)))
    whole, = short_batch_note(source("fashion-mnist", 64), 3)
    assert whole.startswith("every batch held all 16 samples (the 64 training samples divide into them)")
    assert whole.endswith("a --batch-size that does not divide 64, with --num-batches reaching an epoch's end")
    synthetic, = short_batch_note(source("synthetic", 64), 3)
    assert "--synthetic-size 40 and --num-batches 3" in synthetic
    assert short_batch_note(source("synthetic", 40, drop_last=True), 1) == []
