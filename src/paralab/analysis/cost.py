"""The cost model's formulas (memory lives in ``analysis/memory.py``).

Every function returns a :class:`Formula`: the expression in symbols, the same
expression with the numbers substituted, and the result with its unit, so
``paralab calc`` can show the arithmetic and tests can check the value.

Conventions: sizes in bytes, 1 GB = 10^9 B (as in the ZeRO paper); link
bandwidth in gigabits per second (1 Gb/s = 10^9 / 8 B/s); latency in seconds.

- Ring all-reduce (Patarasuk & Yuan 2009, the algorithm HPML Lab 4 assumes):
  each of N ranks sends and receives 2(N-1)/N x S bytes in 2(N-1) steps, so
  ``T = 2(N-1)/N x S/B + 2(N-1) x a`` for one message of S bytes.
- Gather/scatter through a root (CS744 Task 2a): the root receives N-1
  copies of S and sends N-1 back over its one link:
  ``T = 2(N-1) x S/B + 2(N-1) x a``.
- Pipeline bubble (GPipe, sec. 2.3): with p equal stages and m microbatches,
  the idle fraction of a step is ``(p-1)/(m+p-1)``; 1F1B has the same bubble
  but keeps at most p-k microbatches alive on stage k instead of m. Every
  schedule's formulas, with their papers, are entries of the schedule
  registry (``strategies/pipeline/schedules.py``); the functions here wrap
  them in Formulas and name no schedule but GPipe's classic bubble.
- Bandwidth utilisation (HPML Lab 4 Q3.2): the bytes each rank moves in a
  ring all-reduce divided by the measured communication time,
  ``U = 2(N-1)/N x S / T_comm``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..strategies.pipeline.schedules import REGISTRY, ScheduleSpec, spec_of

GB = 1e9


@dataclass
class Formula:
    title: str
    formula: str
    substituted: str
    value: float
    unit: str
    note: str = ""
    parts: dict = field(default_factory=dict)  # named intermediate values, for tests and tables

    def lines(self) -> list[str]:
        out = [f"{self.title}", f"  formula:     {self.formula}", f"  substituted: {self.substituted}",
               f"  result:      {fmt_value(self.value, self.unit)}"]
        if self.note:
            out.append(f"  note:        {self.note}")
        return out

    def text(self) -> str:
        return "\n".join(self.lines())


# ---------------------------------------------------------------- formatting
def g(x: float, digits: int = 4) -> str:
    """A number the way one writes it in arithmetic: 4 significant digits, no trailing noise."""
    if x == 0:
        return "0"
    if isinstance(x, int) or (abs(x) >= 1 and float(x).is_integer() and abs(x) < 1e15):
        return f"{int(x):,}".replace(",", "_") if abs(x) >= 1e5 else str(int(x))
    return f"{x:.{digits}g}"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if abs(s) >= 1:
        return f"{s:.4g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} us"


def fmt_value(value: float, unit: str) -> str:
    if unit == "s":
        return fmt_seconds(value) if value == 0 or abs(value) >= 1 else f"{fmt_seconds(value)}  ({value:.6g} s)"
    if unit == "B":
        return f"{fmt_bytes(value)}  ({value:,.0f} B)"
    if unit == "%":
        return f"{value:.2f} %"
    if unit == "GB/s":
        return f"{value:.4g} GB/s  ({value * 8:.4g} Gb/s)"
    return f"{value:.6g} {unit}".rstrip()


def bytes_per_second(gbit_per_s: float) -> float:
    """Gb/s (network convention) to bytes per second."""
    return gbit_per_s * 1e9 / 8


# ---------------------------------------------------------------- all-reduce
def ring_allreduce_time(size_bytes: float, workers: int, bandwidth_gbps: float, latency_s: float = 0.0,
                        messages: int = 1) -> Formula:
    """Time of a ring all-reduce of ``size_bytes`` split in ``messages`` calls (each pays the latency)."""
    n, s, b = workers, float(size_bytes), bytes_per_second(bandwidth_gbps)
    transfer = 2 * (n - 1) / n * s / b if n > 1 else 0.0
    latency = 2 * (n - 1) * latency_s * messages
    k = "" if messages == 1 else f" x {messages}"
    ks = "" if messages == 1 else " x k"
    return Formula(
        "ring all-reduce time",
        f"T = 2(N-1)/N x S / B + 2(N-1) x a{ks}",
        f"T = 2({n}-1)/{n} x {g(s)} B / ({g(bandwidth_gbps)} Gb/s = {g(b)} B/s) + 2({n}-1) x {g(latency_s)} s{k}"
        f" = {fmt_seconds(transfer)} + {fmt_seconds(latency)}",
        transfer + latency, "s",
        note="k = number of separate all-reduce calls (one per tensor or bucket), each paying 2(N-1) latencies",
        parts={"transfer_s": transfer, "latency_s": latency, "bytes_per_rank": 2 * (n - 1) / n * s if n else 0},
    )


def gather_scatter_time(size_bytes: float, workers: int, bandwidth_gbps: float, latency_s: float = 0.0,
                        messages: int = 1) -> Formula:
    """Gradient averaging through rank 0: gather N-1 copies in, scatter N-1 copies out, one link."""
    n, s, b = workers, float(size_bytes), bytes_per_second(bandwidth_gbps)
    transfer = 2 * (n - 1) * s / b
    latency = 2 * (n - 1) * latency_s * messages
    k = "" if messages == 1 else f" x {messages}"
    ks = "" if messages == 1 else " x k"
    return Formula(
        "gather/scatter through a root",
        f"T = 2(N-1) x S / B + 2(N-1) x a{ks}",
        f"T = 2({n}-1) x {g(s)} B / {g(b)} B/s + 2({n}-1) x {g(latency_s)} s{k}"
        f" = {fmt_seconds(transfer)} + {fmt_seconds(latency)}",
        transfer + latency, "s",
        note="the root's link carries every copy, so the time grows with N instead of staying near 2 S/B",
        parts={"transfer_s": transfer, "latency_s": latency, "root_bytes": 2 * (n - 1) * s},
    )


def allreduce_bytes_per_rank(size_bytes: float, workers: int) -> Formula:
    n, s = workers, float(size_bytes)
    v = 2 * (n - 1) / n * s
    return Formula("bytes each rank sends (ring all-reduce)", "V = 2(N-1)/N x S",
                   f"V = 2({n}-1)/{n} x {g(s)} B", v, "B")


# ---------------------------------------------------------------- pipeline
# Each schedule's formulas are the registry's (strategies/pipeline/schedules.py): plain values and text,
# which these functions only wrap in Formulas (adding the unit and the paper), whatever the schedule.
#: where each schedule's formulas come from
SCHEDULE_SOURCES = {name: spec.paper for name, spec in REGISTRY.items()}


def _cited(source: str, note: str) -> str:
    return "; ".join(x for x in (source, note) if x)


def _bubble(spec: ScheduleSpec, p: int, m: int, v: int, source: str) -> Formula:
    law, frac = spec.bubble_law, spec.bubble(p, m, v)
    parts = {"fraction": frac, "source": source} if source else {"fraction": frac}
    return Formula(law.title, law.formula, law.substituted(p, m, v), 100 * frac, "%",
                   note=_cited(source, law.note(p, m, v)), parts=parts)


def _alive(spec: ScheduleSpec, p: int, m: int, v: int, source: str) -> Formula:
    law, per = spec.alive_law, spec.alive(p, m, v)
    parts = {"per_stage": per, "source": source} if source else {"per_stage": per}
    return Formula(law.title, law.formula, law.substituted(p, m, v), spec.peak(p, m, v), law.unit,
                   note=_cited(source, law.note(p, m, v)), parts=parts)


def bubble_fraction(stages: int, microbatches: int) -> Formula:
    """GPipe's (and 1F1B's) bubble, ``(p-1)/(m+p-1)``, without its citation."""
    return _bubble(spec_of("gpipe"), stages, microbatches, 1, "")


def ideal_step_time(stages: int, microbatches: int, forward_s: float, backward_s: float) -> Formula:
    """Step time of a p-stage pipeline with per-microbatch stage times tf, tb (equal stages)."""
    p, m = stages, microbatches
    v = (m + p - 1) * (forward_s + backward_s)
    return Formula("ideal pipeline step time", "T = (m+p-1) x (tf+tb)",
                   f"T = ({m}+{p}-1) x ({g(forward_s)} s + {g(backward_s)} s)", v, "s",
                   note="tf, tb: one stage's forward and backward of one microbatch")


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[int]:
    """Peak microbatches whose activations are alive on each pipeline rank (a virtual schedule:
    (stage, microbatch) pairs, each a stage of 1/v of the rank's units)."""
    return spec_of(schedule).alive(stages, microbatches, virtual)


def schedule_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Formula:
    """A schedule's bubble (idle fraction of a step, equal stage times, free communication), cited."""
    return _bubble(spec_of(schedule), stages, microbatches, virtual, SCHEDULE_SOURCES[schedule])


def schedule_memory(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Formula:
    """Peak activation memory per rank, in one microbatch's activations of one (non-interleaved) stage."""
    return _alive(spec_of(schedule), stages, microbatches, virtual, SCHEDULE_SOURCES[schedule])


def schedule_times(schedule: str, stages: int, microbatches: int, virtual: int = 1, *, forward_s: float,
                   input_s: float, weight_s: float) -> Formula:
    """A schedule's ideal step time at given stage times (``T_F``; the backward as ``T_I + T_W``, one rank's
    over all its stages), free communication: the paper's closed form (the registry's :class:`IdleLaw`:
    step = m(T_F+T_I+T_W) + idle), and the same schedule run by the simulator at these times beside it.
    A schedule that runs its backward whole gets ``T_B = T_I + T_W``."""
    from ..strategies.pipeline.schedules import build_schedule
    from ..strategies.pipeline.simulate import simulate, simulated_bubble
    spec, p, m, v = spec_of(schedule), stages, microbatches, virtual
    f, i, w = forward_s, input_s, weight_s
    law = spec.idle
    idle = law.value(p, v, f, i, w)
    work = m * (f + i + w)
    step = work + idle
    timeline = simulate(build_schedule(schedule, p, m, v), f / v, (i + w) / v, input_time=i / v, weight_time=w / v)
    sim_step = max(t.t1 for row in timeline for t in row)
    sim_bubble = max(simulated_bubble(timeline))

    def ms(x: float) -> str:
        return f"{g(x * 1e3)} ms"
    F, I, W, B = ms(f), ms(i), ms(w), ms(i + w)
    backward = "(T_F+T_I+T_W)" if spec.split_backward else "(T_F+T_B)"
    times = f"{F} + {I} + {W}" if spec.split_backward else f"{F} + {B}"
    return Formula(
        f"{schedule}: ideal step time at these stage times (free communication)",
        f"T = m{backward} + idle; {law.formula}",
        f"T = {m} x ({times}) + {law.substituted(p, v, F, I, W, B)} = {ms(work)} + {ms(idle)}", step, "s",
        note=_cited(SCHEDULE_SOURCES[schedule],
                    f"bubble = idle / T = {100 * idle / step:.2f} %; {law.note}; simulated (this schedule's "
                    f"order run on these times): step {ms(sim_step)}, bubble {100 * sim_bubble:.2f} % "
                    "(the rank idling most)"),
        parts={"idle": idle, "fraction": idle / step, "simulated_step": sim_step,
               "simulated_fraction": sim_bubble})


def in_flight_formula(schedule: str, stages: int, microbatches: int) -> Formula:
    """``schedule_memory`` with one stage per rank, without its citation."""
    return _alive(spec_of(schedule), stages, microbatches, 1, "")


# ---------------------------------------------------------------- measured
def bandwidth_utilisation(size_bytes: float, workers: int, comm_seconds: float) -> Formula:
    """HPML Lab 4 Q3.2: bytes a rank moves in a ring all-reduce / measured communication time."""
    n, s, t = workers, float(size_bytes), comm_seconds
    moved = 2 * (n - 1) / n * s
    v = moved / t / GB if t > 0 else 0.0
    return Formula("bandwidth utilisation (ring all-reduce)", "U = 2(N-1)/N x S / T_comm",
                   f"U = 2({n}-1)/{n} x {g(s)} B / {g(t)} s = {g(moved)} B / {g(t)} s", v, "GB/s",
                   parts={"bytes_moved": moved})


def link_share(utilisation_gbs: float, bandwidth_gbps: float) -> Formula:
    link = bandwidth_gbps / 8
    v = 100 * utilisation_gbs / link if link else 0.0
    return Formula("share of the link", "share = U / B",
                   f"share = {g(utilisation_gbs)} GB/s / ({g(bandwidth_gbps)} Gb/s = {g(link)} GB/s)", v, "%")


def boundary_traffic(boundaries: list[tuple[int, tuple, int]], batch: int) -> Formula:
    """Model/pipeline traffic per step: activations forward and gradients back over each boundary.

    ``boundaries`` is [(after_stage, shape incl. batch, bytes)] for one batch.
    """
    acts = sum(b for _, _, b in boundaries)
    terms = " + ".join(f"{g(b)}" for _, _, b in boundaries) or "0"
    return Formula("boundary traffic per step (model / pipeline)",
                   "V = sum over boundaries of 2 x batch x activation elements x 4 B",
                   f"V = 2 x ({terms}) B", 2 * acts, "B",
                   note=f"forward activations and backward gradients (same shape), batch {batch}, fp32",
                   parts={"forward_bytes": acts, "backward_bytes": acts})
