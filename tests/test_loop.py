"""The loop's seams, in one process: injected faults fire at their moment and nowhere else (run/faults.py), the
step's norm and skip reach its result through the base class whatever context a composed strategy derives
(strategies/base.py: run_step), and a step value is gone once its driver is done (training/step.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paralab.errors import UsageError
from paralab.run.faults import Faults, parse
from paralab.strategies.base import Context, StepResult, Strategy
from paralab.training import step as steps


def fires(faults: Faults, moment: str, step: int) -> bool:
    try:
        faults.at(moment, step)
    except RuntimeError as exc:
        assert "(PARALAB_FAULT)" in str(exc)
        return True
    return False


def test_a_fault_fires_on_its_rank_step_and_attempt_alone():
    faults = Faults(rank=1, attempt=2, total=5, spec="1:3,0:2,1:4:raise:1,1:1:raise:2")
    assert [s for s in range(6) if fires(faults, "step", s)] == [1, 3]  # rank 0's and attempt 1's left out
    assert not any(fires(faults, moment, 3) for moment in ("save", "records", "done"))  # a step's, not a moment's
    assert not fires(Faults(rank=0, attempt=1, total=5, spec="1:3"), "step", 3)


def test_a_moment_fault_does_not_fire_at_a_step_and_nan_never_raises():
    faults = Faults(rank=0, attempt=1, total=4, spec="0:2:save,0:4:records,0:4:done,0:1:nan")
    assert not any(fires(faults, "step", s) for s in range(5))
    with faults.around_step(steps.Step(index=0)):  # not the poisoned step: the loss as it is
        assert torch.isfinite(Context.cross_entropy(_ctx(), torch.zeros(2, 3), torch.tensor([0, 1])))
    with faults.around_step(steps.Step(index=1)):
        assert torch.isnan(Context.cross_entropy(_ctx(), torch.zeros(2, 3), torch.tensor([0, 1])))
    assert torch.isfinite(Context.cross_entropy(_ctx(), torch.zeros(2, 3), torch.tensor([0, 1])))  # restored


def test_a_fault_of_an_unknown_kind_is_refused():
    with pytest.raises(UsageError, match="the kind must be raise, kill"):
        parse("0:1:explode")
    assert parse("") == [] and parse(None) == []


def _ctx() -> Context:
    return Context(0, 1, torch.device("cpu"), comm=None, recorder=None)


class _Outer(Strategy):
    """A composed strategy's shape: it runs an inner one on a context derived from its own."""

    def __init__(self, ctx):
        super().__init__(ctx, None, None)
        self.inner = _Inner(dataclasses.replace(ctx, precision="fp64"))

    def train_step(self, x, y):
        return self.inner.train_step(x, y)


class _Inner(Strategy):
    def __init__(self, ctx):
        super().__init__(ctx, None, None)

    def train_step(self, x, y):
        self.ctx.guard.norm, self.ctx.guard.skipping = 2.5, "step 1: the loss is not finite on rank 0"
        return StepResult(0.5, len(y))


def test_run_step_reports_the_norm_and_skip_an_inner_strategy_decided_and_clears_them_each_step():
    outer = _Outer(_ctx())
    result = outer.run_step(torch.zeros(4, 3), torch.zeros(4))
    assert (result.grad_norm, result.skipped, result.loss) == (2.5, "step 1: the loss is not finite on rank 0", 0.5)
    outer.inner.train_step = lambda x, y: StepResult(0.25, len(y))  # a step that neither clips nor skips
    result = outer.run_step(torch.zeros(4, 3), torch.zeros(4))
    assert (result.grad_norm, result.skipped) == (None, "")


def test_a_step_value_is_the_drivers_for_its_with_alone():
    inner = steps.Step(index=3, rows=8, first=4)
    with steps.entered(inner):
        steps.split([2, 2])
        with steps.microbatch(1):
            assert steps.current().offset == 2 and steps.current().first == 4
        assert steps.current().offsets == (0, 2)
    assert steps.current() == steps.Step()
    with pytest.raises(ValueError):
        with steps.entered(inner):
            raise ValueError
    assert steps.current() == steps.Step()  # restored whatever happened inside
