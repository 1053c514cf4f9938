"""A plan: every layout that divides the model, predicted, the ones that fit ranked by step time.

Two passes, so a 1024-worker search takes seconds: every layout is first
predicted with its schedule's closed form (the registry's idle law on the
slowest rank's times; where the law does not hold, a zero-bubble schedule
with fewer microbatches than stages, a lower bound); the fastest
``shortlist`` of those that fit, and up to four times as many of the
bounded ones whose bound beats the last of them, are then predicted again
with the schedule simulator on their per-stage times, and ranked by that.
Every row a plan shows is simulated. :func:`why_first` says, in one
sentence, which terms make the first beat the second.

Both passes run on every core this process may use (a forked pool): the
simulations one layout at a time, the closed forms in chunks of a few
hundred returning only (step, memory, fits), so that what crosses back costs
little beside the work. Most layouts differ from others only in their ZeRO
stage and HSDP replication, which change neither their stages nor their
pipeline: those go out side by side, and a chunk works their pipeline out
once (``predict``'s ``memo``). Python's cycle collector is paused while they
run (:func:`_uncollected`): a search allocates millions of objects that hold
no reference cycles.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import multiprocessing
import os
from dataclasses import dataclass, field, replace

from .cluster import Cluster
from .layouts import Layout, devices_problem, enumerate_layouts, why_none
from .predict import Prediction, Setting, predict
from .workload import Workload


class NoLayout(ValueError):
    """No layout divides the model, or none fits: the message says what to change."""


@dataclass
class Plan:
    work: Workload
    cluster: Cluster
    setting: Setting
    workers: int
    ranked: list[Prediction]
    considered: int
    fitting: int
    smallest: Prediction | None = None  # the layout with the least memory (also when nothing fits)
    notes: list = field(default_factory=list)
    rough: list[float] = field(default_factory=list)  # every fitting layout's first-pass step, fastest first


def _predict(work: Workload, cluster: Cluster, setting: Setting, simulate: bool, layout: Layout) -> Prediction:
    return predict(work, layout, cluster, setting, simulate_pipeline=simulate)


def _rough(work: Workload, cluster: Cluster, setting: Setting, memo: dict, layout: Layout
           ) -> tuple[float, float, bool, bool]:
    """The first pass's answer for one layout, as little as crosses a process boundary: (step, memory, fits,
    whether the step is a lower bound: a pipeline no closed form holds for). ``memo``: :func:`predict`'s, kept
    for a chunk of layouts."""
    x = predict(work, layout, cluster, setting, simulate_pipeline=False, memo=memo)
    return x.step, x.memory, x.fits, x.bounded


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def _uncollected():
    """Python's cycle collector paused (as it was after). A search builds schedules of up to hundreds of
    thousands of actions, keeps dozens of them (``predict._schedule``'s cache) and allocates millions of
    short-lived tuples: none of it holds a reference cycle, so reference counting frees it all, but the
    collector, set off by allocations, walks the live ones over and over (more than a quarter of a 175B
    search's time on 1,024 workers, measured: docs/plan.md "The search")."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _map(job, items: list, tick, chunk: int) -> list:
    """``job`` over ``items`` in order, on the cores this process may use (a forked pool where there are several
    and enough items to pay for it; it inherits the paused collector), ``tick(n)`` after every ``n`` done."""
    with _uncollected():
        return _map_now(job, items, tick, chunk)


def _map_now(job, items: list, tick, chunk: int) -> list:
    if _cores() < 2 or len(items) < 8 or "fork" not in multiprocessing.get_all_start_methods():
        out = []
        for item in items:
            out.append(job(item))
            if tick:
                tick(1)
        return out
    out = []
    with multiprocessing.get_context("fork").Pool(_cores()) as pool:
        for x in pool.imap(job, items, chunksize=chunk):
            out.append(x)
            if tick:
                tick(1)
    return out


def predict_many(work: Workload, layouts: list[Layout], cluster: Cluster, setting: Setting, simulate: bool,
                 tick=None) -> list[Prediction]:
    """:func:`predict` of each layout, in order, on the cores this process may use; ``tick(n)`` after every
    ``n`` done."""
    return _map(functools.partial(_predict, work, cluster, setting, simulate), layouts, tick, 1)


def rough_many(work: Workload, layouts: list[Layout], cluster: Cluster, setting: Setting,
               tick=None) -> list[tuple[float, float, bool, bool]]:
    """The first pass (closed forms) over every layout, on the cores this process may use: (step, memory,
    fits, lower bound) each, in order; chunks of a few hundred layouts, so what returns costs little beside the
    work. Layouts that differ only in ZeRO stage and HSDP replication go out side by side, so that a chunk
    works their pipeline out once (:func:`predict`'s ``memo``: one per chunk in a forked pool, one for the whole
    call in one process; it holds this search's layouts alone)."""
    alike: dict[Layout, list[int]] = {}
    for i, lay in enumerate(layouts):
        alike.setdefault(replace(lay, zero=0, replicate=1), []).append(i)
    order = [i for group in alike.values() for i in group]
    out = _map(functools.partial(_rough, work, cluster, setting, {}), [layouts[i] for i in order], tick, 256)
    answers: list = [None] * len(layouts)
    for i, x in zip(order, out):
        answers[i] = x
    return answers


def make_plan(work: Workload, cluster: Cluster, setting: Setting, workers: int, *, fixed: dict | None = None,
              top: int = 10, shortlist: int | None = None, progress=None) -> Plan:
    """``progress``: a callable ``(done, total)`` told at every hundredth of the two passes (the command's bar)."""
    fixed = fixed or {}
    layouts = enumerate_layouts(work, workers, setting.global_batch, cluster.devices_per_node, fixed=fixed)
    if not layouts:
        raise NoLayout(why_none(work, workers, setting.global_batch, cluster.devices_per_node, fixed))
    keep = shortlist if shortlist is not None else max(4 * top, 40)
    total, done = len(layouts) + keep, [0]

    def tick(n: int) -> None:
        before, done[0] = done[0], done[0] + n
        if progress and (100 * done[0] // total != 100 * before // total or done[0] == total):
            progress(done[0], total)

    rough = rough_many(work, layouts, cluster, setting, tick=tick)
    least = min(range(len(layouts)), key=lambda i: rough[i][1])
    smallest = predict(work, layouts[least], cluster, setting, simulate_pipeline=False)
    fitting = sorted((step, i) for i, (step, _, fits, _) in enumerate(rough) if fits)
    if not fitting:
        parts = smallest.memory_parts
        raise NoLayout(
            f"no layout fits in {cluster.memory_gb:g} GB x {cluster.usable_fraction:g} usable per device: the "
            f"smallest found needs {smallest.memory / 1e9:.4g} GB ({smallest.layout.label()}: model states "
            f"{parts['model_states'] / 1e9:.4g} GB, activations {parts['activations'] / 1e9:.4g} GB); give more "
            "--workers, a smaller --global-batch or model, or a cluster with more memory")
    # the fastest ``keep`` by their closed forms, and of the pipelines no closed form holds for (ranked by a
    # lower bound, loose: many variants of one pipeline share it) the 4 x ``keep`` whose bound beats the last
    # of those: simulated (the variants' simulations are shared)
    closed = [i for _, i in fitting if not rough[i][3]][:keep]
    cut = rough[closed[-1]][0] if len(closed) == keep else float("inf")
    bounded = [i for step, i in fitting if rough[i][3] and step < cut][:4 * keep]
    total = len(layouts) + len(closed) + len(bounded)  # the progress bar's (tick reads it)
    final = predict_many(work, [layouts[i] for i in closed + bounded], cluster, setting, simulate=True, tick=tick)
    final = [x for x in final if x.fits]
    final.sort(key=lambda x: (x.step, x.memory))
    return Plan(work, cluster, setting, workers, final[:top], len(layouts), len(fitting), smallest,
                rough=[step for step, _ in fitting])


@dataclass
class Evaluation:
    """One named layout, predicted (simulated) whether or not it fits, and where the search ranks it."""
    prediction: Prediction
    plan: Plan | None      # the unpinned search on the same model, cluster and batch (None: nothing fits)
    rank: int | None       # 1-based among the plan's simulated layouts; None if it does not fit or is slower
                           # than every one of them
    rank_all: int | None = None  # 1-based among every layout that fits, all by the first pass's closed forms
    rough_step: float | None = None  # its own first-pass step, which ``rank_all`` places

    @property
    def top_percent(self) -> float | None:
        """Where ``rank_all`` falls in the list of every layout that fits, as a percentage (1st of 200: 0.5)."""
        return None if self.rank_all is None else 100 * self.rank_all / self.plan.fitting

    def where(self) -> str:
        x, plan = self.prediction, self.plan
        if not x.fits:
            return "it does not fit, so the search leaves it out"
        if plan is None:
            return "no layout the search lists fits"
        of = f"of the {len(plan.ranked)} fastest the search simulated ({plan.fitting} fit of {plan.considered})"
        among = (f"; by the first pass's closed forms, {self.rank_all} of the {plan.fitting} that fit (the fastest "
                 f"{self.top_percent:.2g} %)")
        if self.rank is None:
            return f"slower than all {of}" + among
        return f"{self.rank} {of}" + ("" if self.rank == 1 else
                                      f"; the first, {plan.ranked[0].layout.label()}, takes "
                                      f"{plan.ranked[0].step * 1e3:.4g} ms") + among


def evaluate(work: Workload, cluster: Cluster, setting: Setting, workers: int, layout: Layout, *,
             ranked: int = 40) -> Evaluation:
    """``layout`` predicted with the simulator, fitting or not, and ranked among the ``ranked`` fastest layouts
    of the unpinned search (:func:`make_plan`), and among every layout that fits by the closed forms the search's
    first pass ranks them with (its own closed form against theirs: like against like); NoLayout saying why if
    the layout does not divide the model, the workers and the batch, or is not one paralab runs."""
    pins = layout.pins()
    if layout not in enumerate_layouts(work, workers, setting.global_batch, cluster.devices_per_node, fixed=pins):
        per_replica = setting.global_batch / layout.dp
        why = devices_problem(layout, workers) or (
            f"m x b = {layout.microbatches * layout.microbatch}, not the replica's batch (global batch / dp = "
            f"{per_replica:g})" if layout.microbatches * layout.microbatch != per_replica else
            why_none(work, workers, setting.global_batch, cluster.devices_per_node, pins))
        raise NoLayout(f"layout {layout.label()}: not one the planner lists for this model: {why}")
    x = predict(work, layout, cluster, setting)
    try:
        plan = _unpinned(work, cluster, setting, workers, ranked)
    except NoLayout:
        return Evaluation(x, None, None)
    if not x.fits:
        return Evaluation(x, plan, None)
    faster = sum(y.step < x.step or (y.step == x.step and y.memory < x.memory) for y in plan.ranked)
    rough = predict(work, layout, cluster, setting, simulate_pipeline=False).step
    return Evaluation(x, plan, faster + 1 if faster < len(plan.ranked) else None,
                      bisect.bisect_left(plan.rough, rough) + 1, rough)


#: evaluate()'s last unpinned search, (its arguments, the plan): the next layout evaluated on the same model,
#: cluster, batch and workers (another `plan --layout` of a served session, a test's) is placed in the same
#: search instead of a new one. Arguments compare by value; a plan is read, never changed.
_LAST_SEARCH: list = []


def _unpinned(work: Workload, cluster: Cluster, setting: Setting, workers: int, ranked: int) -> Plan:
    key = (work, cluster, setting, workers, ranked)
    if not (_LAST_SEARCH and _LAST_SEARCH[0][0] == key):
        _LAST_SEARCH[:] = [(key, make_plan(work, cluster, setting, workers, top=ranked, shortlist=ranked))]
    return _LAST_SEARCH[0][1]


TERMS = (("compute", "compute"), ("tp_comm", "tensor-parallel communication"),
         ("cp_comm", "context-parallel communication"), ("ep_comm", "expert-parallel all-to-alls"),
         ("bubble", "pipeline bubble"),
         ("pp_comm", "pipeline transfers"), ("dp_comm", "exposed data-parallel communication"),
         ("optimizer", "optimizer step"))


def why_first(a: Prediction, b: Prediction) -> str:
    """One sentence: by how much ``a`` beats ``b`` and which terms of the step account for it."""
    if b.step <= 0:
        return ""
    gap = b.step - a.step
    diffs = sorted(((getattr(b, k) - getattr(a, k), words) for k, words in TERMS), reverse=True)
    gains = [(d, w) for d, w in diffs if d > 0.02 * max(gap, 1e-12)]
    losses = [(d, w) for d, w in diffs if d < -0.02 * max(gap, 1e-12)]
    if gap <= 1e-12 * max(b.step, 1) and abs(a.memory - b.memory) <= 1e-9 * max(b.memory, 1):
        return (f"{a.layout.label()} and {b.layout.label()} predict the same step time and memory (the model "
                "does not tell them apart); the first is listed first in enumeration order")
    if gap <= 1e-12 * max(b.step, 1):
        return (f"{a.layout.label()} and {b.layout.label()} predict the same step time; the first is listed first "
                f"for its smaller memory ({a.memory / 1e9:.3g} GB vs {b.memory / 1e9:.3g} GB)")
    text = (f"{a.layout.label()} is {100 * gap / b.step:.1f} % faster than {b.layout.label()}: "
            + ", ".join(f"{_ms(d)} less {w}" for d, w in gains[:2]))
    if losses:
        text += " outweigh " + ", ".join(f"{_ms(-d)} more {w}" for d, w in losses[:2])
    return text


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
