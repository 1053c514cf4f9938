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
  but keeps at most p-k microbatches alive on stage k instead of m.
- Bandwidth utilisation (HPML Lab 4 Q3.2): the bytes each rank moves in a
  ring all-reduce divided by the measured communication time,
  ``U = 2(N-1)/N x S / T_comm``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
def bubble_fraction(stages: int, microbatches: int) -> Formula:
    p, m = stages, microbatches
    v = (p - 1) / (m + p - 1)
    return Formula("pipeline bubble (GPipe and 1F1B)", "bubble = (p-1) / (m+p-1)",
                   f"bubble = ({p}-1) / ({m}+{p}-1) = {p - 1}/{m + p - 1}", 100 * v, "%",
                   note="fraction of each stage's step spent idle, equal stage times, free communication",
                   parts={"fraction": v})


def ideal_step_time(stages: int, microbatches: int, forward_s: float, backward_s: float) -> Formula:
    """Step time of a p-stage pipeline with per-microbatch stage times tf, tb (equal stages)."""
    p, m = stages, microbatches
    v = (m + p - 1) * (forward_s + backward_s)
    return Formula("ideal pipeline step time", "T = (m+p-1) x (tf+tb)",
                   f"T = ({m}+{p}-1) x ({g(forward_s)} s + {g(backward_s)} s)", v, "s",
                   note="tf, tb: one stage's forward and backward of one microbatch")


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[int]:
    """Peak microbatches whose activations are alive on each pipeline rank (interleaved-1f1b:
    (stage, microbatch) pairs, each a stage of 1/v of the rank's units)."""
    p, m, v = stages, microbatches, virtual
    if schedule == "gpipe":
        return [m] * p
    if schedule == "zb-h1":
        return [min(p, m)] * p
    if schedule == "zb-h2":
        return [min(2 * p - 1, m)] * p
    if schedule == "interleaved-1f1b":
        return [min((p - 1 - r) * 2 + (v - 1) * p + 1, m * v) for r in range(p)]
    return [min(p - k, m) for k in range(p)]


#: where each schedule's formulas come from
SCHEDULE_SOURCES = {
    "gpipe": "GPipe, Huang et al., NeurIPS 2019, sec. 2.3",
    "1f1b": "PipeDream-flush / 1F1B, Narayanan et al., ICML 2021 and SC 2021 sec. 2.2.1",
    "zb-h1": "Zero Bubble Pipeline Parallelism (ZB-H1), Qi et al., ICLR 2024, sec. 3",
    "zb-h2": "Zero Bubble Pipeline Parallelism (ZB-H2), Qi et al., ICLR 2024, sec. 3",
    "interleaved-1f1b": "Megatron-LM interleaved schedule, Narayanan et al., SC 2021, sec. 2.2.2",
}


def schedule_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Formula:
    """Each schedule's bubble (idle fraction of a step, equal stage times, free communication).

    zb-h1 takes T_F = T_I = T_W (a whole backward is twice a forward, split evenly): its idle time
    is (p-1)(T_F + T_I - T_W) against 1F1B's (p-1)(T_F + T_I + T_W) (exact for m >= p).
    zb-h2 at (or near) equal times idles only the pipeline's fill, (p-1) T_F, in a step on its own
    (the same as zb-h1 at equal times, less when T_I > T_W); steps run back to back without a
    synchronisation between them hide it (the paper's zero bubble).
    interleaved-1f1b: 1F1B's bubble time divided by v (exact for m a multiple of p).
    """
    p, m, v = stages, microbatches, virtual
    source = SCHEDULE_SOURCES.get(schedule, "")
    if schedule in ("zb-h1", "zb-h2"):  # equal at T_F = T_I = T_W; they part once T_I > T_W
        frac = (p - 1) / (3 * m + p - 1)
        title, formula, why = {
            "zb-h1": ("pipeline bubble (ZB-H1)",
                      "bubble = (p-1)(T_F+T_I-T_W) / (m(T_F+T_I+T_W) + (p-1)(T_F+T_I-T_W))",
                      "backward split into I (input gradient) and W (weights), W filling the drain"),
            "zb-h2": ("pipeline bubble (ZB-H2), one step on its own",
                      "bubble = the fill alone, (p-1)T_F / (m(T_F+T_I+T_W) + (p-1)T_F) at (or near) equal times",
                      "only the fill: no stage waits once started, with up to 2p-1 microbatches alive; steps "
                      "back to back without a synchronisation overlap by it (the paper's zero bubble)"),
        }[schedule]
        return Formula(title, f"{formula}; T_F = T_I = T_W: (p-1) / (3m+p-1)",
                       f"bubble = ({p}-1) / (3x{m}+{p}-1) = {p - 1}/{3 * m + p - 1}", 100 * frac, "%",
                       note=f"{source}; {why}; exact for m >= p"
                            + ("" if m >= p else " (here m < p: the schedule idles more)"),
                       parts={"fraction": frac, "source": source})
    if schedule == "interleaved-1f1b":
        frac = (p - 1) / (v * m + p - 1)
        return Formula("pipeline bubble (interleaved 1F1B)",
                       "bubble time = (p-1)/v x (T_F+T_B); fraction = (p-1) / (v·m + p-1)",
                       f"bubble = ({p}-1) / ({v}x{m}+{p}-1) = {p - 1}/{v * m + p - 1}", 100 * frac, "%",
                       note=f"{source}; v = {v} stages per rank; needs m a multiple of p",
                       parts={"fraction": frac, "source": source})
    f = bubble_fraction(p, m)
    f.note = f"{source}; {f.note}" if source else f.note
    f.parts["source"] = source
    return f


def schedule_memory(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Formula:
    """Peak activation memory per rank, in one microbatch's activations of one (non-interleaved) stage."""
    p, m, v = stages, microbatches, virtual
    per = in_flight(schedule, p, m, v)
    source = SCHEDULE_SOURCES.get(schedule, "")
    if schedule == "zb-h1":
        return Formula("ZB-H1: microbatches alive per stage (peak)", "alive(k) = min(p, m)",
                       f"alive(k) = min({p}, {m}) = {per[0]} for k = 0..{p - 1}", max(per), "microbatches",
                       note=f"{source}; 1F1B's peak (stage 0) on every stage: W holds a microbatch until it runs",
                       parts={"per_stage": per, "source": source})
    if schedule == "zb-h2":
        return Formula("ZB-H2: microbatches alive per stage (peak)", "alive(k) = min(2p-1, m)",
                       f"alive(k) = min(2x{p}-1, {m}) = {per[0]} for k = 0..{p - 1}", max(per), "microbatches",
                       note=f"{source}; the memory bought to leave no stage waiting: about twice 1F1B's peak",
                       parts={"per_stage": per, "source": source})
    if schedule == "interleaved-1f1b":
        return Formula("interleaved 1F1B: stage-microbatches alive per rank (peak)",
                       "alive(r) = min(2(p-1-r) + (v-1)p + 1, v·m), each 1/v of a rank's activations",
                       ", ".join(f"min(2({p}-1-{r}) + ({v}-1)x{p} + 1, {v}x{m}) = {a}" for r, a in enumerate(per)),
                       max(per) / v, "microbatches (rank 0, in whole-stage units)",
                       note=f"{source}; rank 0 holds {max(per)} chunks of 1/{v} stage each",
                       parts={"per_stage": per, "source": source})
    f = in_flight_formula(schedule, p, m)
    f.note = source
    f.parts["source"] = source
    return f


def in_flight_formula(schedule: str, stages: int, microbatches: int) -> Formula:
    per = in_flight(schedule, stages, microbatches)
    if schedule == "gpipe":
        return Formula("GPipe: microbatches alive per stage (peak)", "alive(k) = m",
                       f"alive(k) = {microbatches} for k = 0..{stages - 1}", max(per), "microbatches",
                       parts={"per_stage": per})
    return Formula("1F1B: microbatches alive per stage (peak)", "alive(k) = min(p-k, m)",
                   ", ".join(f"min({stages}-{k}, {microbatches}) = {v}" for k, v in enumerate(per)),
                   max(per), "microbatches (stage 0)", parts={"per_stage": per})


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
