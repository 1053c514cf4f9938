"""The schedules by name: each one's builder, its paper and its formulas, in one registry.

:data:`REGISTRY` maps a schedule's name (``--schedule``) to a
:class:`ScheduleSpec`: the builder of its compute order (``builders.py``),
the paper it comes from, whether it holds several stages per rank, and its
two formulas, at equal stage times and free communication: the bubble (the
fraction of a step a rank idles) and the peak microbatches alive per rank
(its activation memory). :func:`build_schedule`, :func:`layout_problem`,
``--schedule``'s choices and the cost model all read the registry, so adding
a schedule is adding its builder and one entry here.

Why the formulas live here and not in ``analysis/cost.py``: they describe the
schedule as much as its order does (the tests hold each builder to its own
entry), and the analysis imports the strategies, never the reverse. So an
entry holds plain data: the values as functions of ``(p, m, v)``, and the
text as a :class:`Law` (a title, the formula in symbols, the formula with the
numbers substituted, a note on when it holds). ``analysis/cost.py`` wraps
them in its ``Formula`` (value, unit, citation) and names no schedule.

Notation: ``p`` pipeline ranks, ``m`` microbatches, ``v`` stages per rank;
``T_F``, ``T_B``: a stage's forward and backward of one microbatch, the
backward split as ``T_I + T_W`` (zero bubble). The zero-bubble formulas take
``T_F = T_I = T_W`` (a whole backward twice a forward, split evenly); each
entry's :class:`IdleLaw` gives its paper's idle time at any given times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .actions import Action, Schedule, ScheduleError, with_transfers
from .builders import gpipe, interleaved_1f1b, one_f_one_b, virtual_gpipe, zb_h1, zb_h2

#: PyTorch's V-shaped zero-bubble schedules, which only ``torch-pipeline`` runs (see its module)
TORCH_ONLY = ("zbv", "dualpipev")


def _nothing(p: int, m: int, v: int) -> str:
    return ""


@dataclass(frozen=True)
class Law:
    """A formula as text; its value comes from the :class:`ScheduleSpec` that holds it."""
    title: str
    formula: str                                      # in symbols
    substituted: Callable[[int, int, int], str]       # (p, m, v) -> the formula with the numbers in
    note: Callable[[int, int, int], str] = _nothing   # (p, m, v) -> when or why it holds ("" if nothing to add)
    unit: str = ""                                    # what the value counts (a bubble: a fraction, no unit)


@dataclass(frozen=True)
class IdleLaw:
    """Idle time of a rank per step at given stage times, as the schedule's paper gives it: a value of
    ``(p, v, T_F, T_I, T_W)`` and its text (``T_B = T_I + T_W`` for a schedule that runs it whole)."""
    formula: str                                                  # in symbols
    value: Callable[[int, int, float, float, float], float]       # (p, v, T_F, T_I, T_W) -> idle time
    substituted: Callable[..., str]                               # (p, v, F, I, W, B: times as written) -> text
    note: str = ""                                                # when it holds
    #: (p, m, v, T_F, T_I, T_W) -> whether the closed form holds there (it underestimates, even below 0,
    #: outside): :meth:`bounded` then takes 1F1B's fill and drain, which no schedule here idles more than
    holds: Callable[[int, int, int, float, float, float], bool] = lambda p, m, v, f, i, w: True

    def bounded(self, p: int, m: int, v: int, f: float, i: float, w: float) -> float:
        """The idle time where the closed form holds, else (p-1)(T_F+T_I+T_W): never below what it is."""
        if self.holds(p, m, v, f, i, w):
            return max(self.value(p, v, f, i, w), 0.0)
        return (p - 1) * (f + i + w)


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: how to build it, where it comes from, and what it costs (bubble, memory)."""
    name: str
    build: Callable[..., list[list[Action]]]         # (p, m), or (p, m, v) if virtual -> per-rank compute orders
    paper: str                                        # where the schedule and its formulas come from
    bubble: Callable[[int, int, int], float]          # (p, m, v) -> fraction of a step each rank idles
    alive: Callable[[int, int, int], list[int]]       # (p, m, v) -> peak (stage, microbatch) pairs alive per rank
    bubble_law: Law
    alive_law: Law
    virtual: bool = False  # v stages per rank (--virtual-stages), microbatches fed in groups of p
    idle: IdleLaw | None = None  # idle time per step at unequal stage times (a step's work is m(T_F+T_I+T_W))
    split_backward: bool = False  # runs each backward as I (input gradient) then W (weight gradient)

    def peak(self, p: int, m: int, v: int) -> float:
        """The busiest rank's peak, in microbatches of one whole (non-interleaved) stage."""
        most = max(self.alive(p, m, v))
        return most / v if self.virtual else most


# ---------------------------------------------------------------- the formulas
def _fill_and_drain(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


def _zero_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (3 * m + p - 1)


_FILL_AND_DRAIN = Law("pipeline bubble (GPipe and 1F1B)", "bubble = (p-1) / (m+p-1)",
                      lambda p, m, v: f"bubble = ({p}-1) / ({m}+{p}-1) = {p - 1}/{m + p - 1}",
                      lambda p, m, v: "fraction of each stage's step spent idle, equal stage times, free communication")


def _zero_bubble_law(title: str, formula: str, why: str) -> Law:
    """ZB-H1 and ZB-H2 share their value at equal times, its substitution and its ``m >= p`` condition."""
    return Law(title, f"{formula}; T_F = T_I = T_W: (p-1) / (3m+p-1)",
               lambda p, m, v: f"bubble = ({p}-1) / (3x{m}+{p}-1) = {p - 1}/{3 * m + p - 1}",
               lambda p, m, v: f"{why}; exact for m >= p"
                               + ("" if m >= p else " (here m < p: the schedule idles more)"))


_FILL_AND_DRAIN_IDLE = IdleLaw("idle = (p-1)(T_F+T_B)", lambda p, v, f, i, w: (p - 1) * (f + i + w),
                               lambda p, v, F, I, W, B: f"({p}-1)({F} + {B})",
                               "the fill and the drain, whatever the ratio of T_F to T_B")


def _interleaved_alive(p: int, m: int, v: int) -> list[int]:
    """Rank ``r``'s warm-up forwards plus the one it runs before its first backward, capped at all of them."""
    return [min((p - 1 - r) * 2 + (v - 1) * p + 1, m * v) for r in range(p)]


_QI_2024 = "Zero Bubble Pipeline Parallelism ({}), Qi et al., ICLR 2024, sec. 2"

#: every schedule of ours, in the order ``--schedule`` lists them
REGISTRY: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec(
        "gpipe", gpipe, "GPipe, Huang et al., NeurIPS 2019, sec. 2.3",
        bubble=_fill_and_drain,
        alive=lambda p, m, v: [m] * p,
        bubble_law=_FILL_AND_DRAIN, idle=_FILL_AND_DRAIN_IDLE,
        alive_law=Law("GPipe: microbatches alive per stage (peak)", "alive(k) = m",
                      lambda p, m, v: f"alive(k) = {m} for k = 0..{p - 1}", unit="microbatches")),
    ScheduleSpec(
        # 1F1B idles as long as GPipe, (p-1)(T_F + T_B) per step, but keeps fewer microbatches alive
        "1f1b", one_f_one_b, "PipeDream-flush / 1F1B, Narayanan et al., ICML 2021 and SC 2021 sec. 2.2.1",
        bubble=_fill_and_drain,
        alive=lambda p, m, v: [min(p - k, m) for k in range(p)],
        bubble_law=_FILL_AND_DRAIN, idle=_FILL_AND_DRAIN_IDLE,
        alive_law=Law("1F1B: microbatches alive per stage (peak)", "alive(k) = min(p-k, m)",
                      lambda p, m, v: ", ".join(f"min({p}-{k}, {m}) = {min(p - k, m)}" for k in range(p)),
                      unit="microbatches (stage 0)")),
    ScheduleSpec(
        # idles (p-1)(T_F + T_I - T_W) per step where 1F1B idles (p-1)(T_F + T_I + T_W)
        "zb-h1", zb_h1, _QI_2024.format("ZB-H1"),
        bubble=_zero_bubble,
        alive=lambda p, m, v: [min(p, m)] * p,
        bubble_law=_zero_bubble_law(
            "pipeline bubble (ZB-H1)",
            "bubble = (p-1)(T_F+T_I-T_W) / (m(T_F+T_I+T_W) + (p-1)(T_F+T_I-T_W))",
            "backward split into I (input gradient) and W (weights), W filling the drain"),
        idle=IdleLaw("idle = (p-1)(T_F+T_I-T_W)", lambda p, v, f, i, w: (p - 1) * (f + i - w),
                     lambda p, v, F, I, W, B: f"({p}-1)({F} + {I} - {W})",
                     "each W fills a slot of the drain; for T_W <= T_F + T_I and m >= p",
                     holds=lambda p, m, v, f, i, w: m >= p and w <= f + i),
        split_backward=True,
        alive_law=Law("ZB-H1: microbatches alive per stage (peak)", "alive(k) = min(p, m)",
                      lambda p, m, v: f"alive(k) = min({p}, {m}) = {min(p, m)} for k = 0..{p - 1}",
                      lambda p, m, v: "1F1B's peak (stage 0) on every stage: W holds a microbatch until it runs",
                      unit="microbatches")),
    ScheduleSpec(
        # a step on its own idles only the fill, (p-1) T_F: ZB-H1's at equal times, less when T_I > T_W;
        # steps back to back without a synchronisation between them hide the fill too (the paper's zero
        # bubble: each stage starts its next step T_F after the stage before)
        "zb-h2", zb_h2, _QI_2024.format("ZB-H2"),
        bubble=_zero_bubble,
        alive=lambda p, m, v: [min(2 * p - 1, m)] * p,
        bubble_law=_zero_bubble_law(
            "pipeline bubble (ZB-H2), one step on its own",
            "bubble = the fill alone, (p-1)T_F / (m(T_F+T_I+T_W) + (p-1)T_F) at (or near) equal times",
            "only the fill: no stage waits once started, with up to 2p-1 microbatches alive; steps "
            "back to back without a synchronisation overlap by it (the paper's zero bubble)"),
        idle=IdleLaw("idle = (p-1)T_F, one step on its own", lambda p, v, f, i, w: (p - 1) * f,
                     lambda p, v, F, I, W, B: f"({p}-1) x {F}",
                     "only the fill; for m >= 2p-1 and T_I, T_W not far from T_F",
                     holds=lambda p, m, v, f, i, w: m >= 2 * p - 1),
        split_backward=True,
        alive_law=Law("ZB-H2: microbatches alive per stage (peak)", "alive(k) = min(2p-1, m)",
                      lambda p, m, v: f"alive(k) = min(2x{p}-1, {m}) = {min(2 * p - 1, m)} for k = 0..{p - 1}",
                      lambda p, m, v: "the memory bought to leave no stage waiting: about twice 1F1B's peak",
                      unit="microbatches")),
    ScheduleSpec(
        # 1F1B's bubble time divided by v (exact for m a multiple of p)
        "interleaved-1f1b", interleaved_1f1b,
        "Megatron-LM interleaved schedule, Narayanan et al., SC 2021, sec. 2.2.2",
        bubble=lambda p, m, v: (p - 1) / (v * m + p - 1),
        alive=_interleaved_alive,
        bubble_law=Law("pipeline bubble (interleaved 1F1B)",
                       "bubble time = (p-1)/v x (T_F+T_B); fraction = (p-1) / (v·m + p-1)",
                       lambda p, m, v: f"bubble = ({p}-1) / ({v}x{m}+{p}-1) = {p - 1}/{v * m + p - 1}",
                       lambda p, m, v: f"v = {v} stages per rank; needs m a multiple of p"),
        idle=IdleLaw("idle = (p-1)/v x (T_F+T_B)", lambda p, v, f, i, w: (p - 1) / v * (f + i + w),
                     lambda p, v, F, I, W, B: f"({p}-1)/{v} x ({F} + {B})",
                     "T_F, T_B: a rank's forward and backward of one microbatch over its v stages"),
        alive_law=Law("interleaved 1F1B: stage-microbatches alive per rank (peak)",
                      "alive(r) = min(2(p-1-r) + (v-1)p + 1, v·m), each 1/v of a rank's activations",
                      lambda p, m, v: ", ".join(f"min(2({p}-1-{r}) + ({v}-1)x{p} + 1, {v}x{m}) = {a}"
                                                for r, a in enumerate(_interleaved_alive(p, m, v))),
                      lambda p, m, v: f"rank 0 holds {max(_interleaved_alive(p, m, v))} chunks of 1/{v} stage each",
                      unit="microbatches (rank 0, in whole-stage units)"),
        virtual=True),
)}
SCHEDULES = tuple(REGISTRY)
#: schedules that hold several stages per rank (``--virtual-stages``)
VIRTUAL = tuple(name for name, spec in REGISTRY.items() if spec.virtual)


# ---------------------------------------------------------------- building
def is_own(name: str) -> bool:
    """Whether ``name`` is a schedule from the user's file: ``PATH.py[:FUNCTION]``, where ``FUNCTION(p, m)``
    (the file's first function if not named) returns each of the ``p`` ranks' compute actions in order
    (``Action("forward", mb, stage=r)``, ``"backward"``; or ``"backward_input"`` and ``"backward_weight"``);
    the sends and receives are added (``with_transfers``) and the whole checked before it runs
    (docs/own-strategy.md)."""
    from ..user import is_file
    return is_file(name)


def own_schedule(name: str, workers: int, microbatches: int) -> Schedule:
    """The user's schedule for this layout, checked: every rank's list complete and in order, and the ranks
    together free of deadlock (``simulate``). Raises UsageError naming the file, the line and the problem."""
    from ...errors import UsageError
    from ..user import load_function, where
    from .simulate import check_local, simulate
    build = load_function(name, "pipeline schedule")
    placement = tuple(range(workers))
    try:
        compute = [[a if isinstance(a, Action) else Action(*a) for a in row] for row in build(workers, microbatches)]
        if len(compute) != workers:
            raise ScheduleError(f"it returned {len(compute)} lists of actions for {workers} ranks")
        schedule = Schedule(name, microbatches, placement, with_transfers(compute, placement))
        for rank in range(workers):
            check_local(schedule[rank], rank, workers, microbatches, placement)
        simulate(schedule)
    except ScheduleError as exc:
        raise UsageError(f"{where(build)}: the schedule {build.__name__}({workers}, {microbatches}) cannot run: "
                         f"{exc}") from None
    except Exception as exc:  # noqa: BLE001 - an error in the user's builder is theirs to fix
        raise UsageError(f"{where(build)}: {build.__name__}({workers}, {microbatches}) failed: "
                         f"{type(exc).__name__}: {exc}") from None
    return schedule


def _unknown(name: str) -> str | None:
    """Why ``name`` is not a schedule of ours (None if it is), in words for the user."""
    if is_own(name):
        return None
    if name in TORCH_ONLY:
        return (f"{name} is run by torch-pipeline only (PyTorch's schedule); ours are {', '.join(SCHEDULES)}: "
                f"'paralab train torch-pipeline --schedule {name}'")
    if name not in REGISTRY:
        return f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    return None


def spec_of(name: str) -> ScheduleSpec:
    """The registry's entry for ``name``; ValueError, saying why, if there is none."""
    problem = _unknown(name)
    if problem:
        raise ValueError(problem)
    return REGISTRY[name] if name in REGISTRY else own_spec(name)


def own_spec(name: str) -> ScheduleSpec:
    """A user's schedule as the registry's entries are: its bubble and memory simulated (equal stage times,
    a backward twice a forward), as no paper gives them."""
    def timeline(p, m, v):
        from .simulate import simulate
        return simulate(own_schedule(name, p, m))

    def bubble(p, m, v):
        from .simulate import simulated_bubble
        return max(simulated_bubble(timeline(p, m, v)))

    def alive(p, m, v):
        from .simulate import peak_in_flight
        return [peak_in_flight(row) for row in own_schedule(name, p, m)]
    return ScheduleSpec(
        name, lambda p, m: own_schedule(name, p, m).actions, f"your file ({name})", bubble=bubble, alive=alive,
        bubble_law=Law("pipeline bubble (your schedule, simulated)", "simulated: T_B = 2 T_F, no transfer time",
                       lambda p, m, v: f"bubble = {bubble(p, m, v):.3f} (simulated, p={p}, m={m})"),
        alive_law=Law("your schedule: microbatches alive per stage (peak, simulated)", "counted along each list",
                      lambda p, m, v: ", ".join(map(str, alive(p, m, v))), unit="microbatches"),
        split_backward=False)


def placement_for(name: str, workers: int, virtual: int = 1) -> tuple[int, ...]:
    """Which rank holds each stage: one stage per rank, or ``v`` interleaved (stage s on rank s mod p)."""
    stages = workers * (virtual if name in VIRTUAL else 1)
    return tuple(s % workers for s in range(stages))


def layout_problem(name: str, workers: int, microbatches: int, virtual: int = 1) -> str | None:
    """Why schedule ``name`` cannot run this layout (None if it can), in words for the user."""
    problem = _unknown(name)
    if problem:
        return problem
    if is_own(name):
        from ...errors import UsageError
        if virtual != 1:
            return f"--virtual-stages {virtual} applies to {', '.join(VIRTUAL)} only, not a schedule from a file"
        try:
            own_schedule(name, workers, microbatches)
        except UsageError as exc:
            return str(exc)
        return None
    if REGISTRY[name].virtual:
        if virtual < 2:
            return f"{name} holds several stages per rank: give --virtual-stages 2 or more"
        if microbatches % workers:
            return (f"{name} feeds microbatches in groups of one per pipeline rank: --microbatches "
                    f"{microbatches} must be a multiple of the {workers} pipeline stages")
    elif virtual != 1:
        return f"--virtual-stages {virtual} applies to {', '.join(VIRTUAL)} only, not {name}"
    return None


def build_schedule(name: str, workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Every rank's ordered action list for schedule ``name``.

    A virtual schedule with ``m`` not a multiple of ``p`` (only an epoch's
    short last batch: the configured ``m`` is checked before start) runs
    GPipe's order over the same interleaved layout.
    """
    if workers < 1 or microbatches < 1:
        raise ValueError("workers and microbatches must be positive")
    if is_own(name):
        return own_schedule(name, workers, microbatches)
    problem = layout_problem(name, workers, microbatches, virtual)
    short_batch = name in VIRTUAL and virtual >= 2 and microbatches % workers
    if problem and not short_batch:
        raise ValueError(problem)
    spec = REGISTRY[name]
    if short_batch:
        compute = virtual_gpipe(workers, microbatches, virtual)
    elif spec.virtual:
        compute = spec.build(workers, microbatches, virtual)
    else:
        compute = spec.build(workers, microbatches)
    placement = placement_for(name, workers, virtual)
    return Schedule(name, microbatches, placement, with_transfers(compute, placement))
