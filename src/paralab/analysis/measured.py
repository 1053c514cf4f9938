"""Measured runs against the planner: every row of a table of measured iteration times planned with its own
layout pinned, the errors, and the cost model's free parameters fitted to the table.

A table is a CSV with one measured run a row, in the columns of vTrain's validation set (:data:`COLUMNS`:
GPUs, global batch, micro batch, hidden size, heads, layers, sequence length, tp, dp, pp, iteration ms). What
a row does not say is the same for every row and given apart (:class:`Facts`; its defaults are how vTrain's
validation runs were made: Megatron-DeepSpeed's GPT with GPT-2's vocabulary padded to a multiple of 128 x tp,
its output layer tied to the token table, 1F1B, full recomputation, 16-bit training with Adam).

:func:`report` gives what a planner is judged by: each row's error (predicted / measured - 1), their median
and worst, the same per model size (hidden x layers), and per group of rows that differ only in their layout
(same model, GPUs and global batch: a choice a user makes) the rank correlation between predicted and
measured times and the regret of running the layout predicted fastest (its measured time over the group's
fastest, less one).

:func:`fit` finds the values of :data:`FREE` (a handful of physical parameters of a
:class:`~.plan.cluster.Cluster`, each bounded by what it can physically be) that minimise the mean squared
log error over the rows, by Nelder and Mead's simplex in the logarithms of the parameters (deterministic: the
same table and start give the same cluster). The matmul efficiency by size is the two-parameter ramp
``efficiency x f / (f + half)`` of a matmul of ``f`` FLOPs (:func:`ramp`), written into the cluster's
``matmul`` points. A fit spreads the rows over worker processes (:class:`Predictor`, one per core by
default): each predicts its share and the parent puts the times back in row order, so the losses, and the
fit, are bit-for-bit a single process's. ``paralab measured`` (``commands/measured.py``) prints both; docs/plan.md shows them for
the shipped set.
"""
from __future__ import annotations

import csv
import math
import multiprocessing
import os
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from ..errors import UsageError
from .plan.cluster import Cluster
from .plan.layouts import Layout
from .plan.predict import Setting, predict
from .plan.workload import gpt_workload

#: the columns of a table, as vTrain's ground_truth_single.csv names them
COLUMNS = ("# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
           "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism",
           "iteration time (ms)")

#: the shipped table: vTrain's 1,440 single-node A100 runs (data/README.md says where from)
SHIPPED = Path(__file__).with_name("data") / "vtrain-single.csv"


@dataclass(frozen=True)
class Facts:
    """What every row of a table shares and does not say (defaults: vTrain's validation runs)."""
    vocab: int = 50257          # GPT-2's tokens ...
    vocab_multiple: int = 128   # ... padded by Megatron to a multiple of this x tp
    schedule: str = "1f1b"
    recompute: str = "full"
    tied_embeddings: bool = True
    precision: str = "mixed"
    optimizer: str = "adam"


@dataclass(frozen=True)
class Row:
    gpus: int
    global_batch: int
    microbatch: int
    hidden: int
    heads: int
    layers: int
    context: int
    tp: int
    dp: int
    pp: int
    ms: float

    @property
    def size(self) -> str:
        return f"{self.hidden}x{self.layers}"

    @property
    def group(self) -> tuple:
        """Rows with the same group differ only in their layout."""
        return self.gpus, self.hidden, self.layers, self.global_batch

    def layout(self, facts: Facts) -> Layout:
        pipe = dict(schedule=facts.schedule) if self.pp > 1 else {}
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, microbatch=self.microbatch,
                      microbatches=self.global_batch // (self.dp * self.microbatch), recompute=facts.recompute,
                      **pipe)


def read_table(path: str | Path) -> list[Row]:
    """The rows of a table; UsageError naming the file, the line and what to change for anything else."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such file (a CSV of measured runs with the columns {', '.join(COLUMNS)})")
    try:
        lines = list(csv.reader(p.read_text(encoding="utf-8-sig").splitlines()))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UsageError(f"{path}: not a CSV text file ({exc})") from None
    if not lines or tuple(c.strip() for c in lines[0]) != COLUMNS:
        raise UsageError(f"{path}: the first line must name the columns {', '.join(COLUMNS)} (vTrain's "
                         f"ground_truth_single.csv); it is {', '.join(lines[0]) if lines else 'empty'}")
    rows = []
    for n, cells in enumerate(lines[1:], start=2):
        if not cells:
            continue
        where = f"{path}:{n}"
        if len(cells) != len(COLUMNS):
            raise UsageError(f"{where}: {len(cells)} values, expected {len(COLUMNS)}")
        try:
            *ints, ms = cells
            values = [int(v) for v in ints]
            ms = float(ms)
        except ValueError:
            raise UsageError(f"{where}: the first {len(COLUMNS) - 1} values must be whole numbers and the last a "
                             f"time in ms (got {', '.join(cells)})") from None
        if min(values) < 1 or not (math.isfinite(ms) and ms > 0):
            raise UsageError(f"{where}: every value must be positive and the time finite (got {', '.join(cells)})")
        row = Row(*values, ms)
        if row.tp * row.dp * row.pp != row.gpus:
            raise UsageError(f"{where}: tp {row.tp} x dp {row.dp} x pp {row.pp} is not the {row.gpus} GPUs")
        if row.global_batch % (row.dp * row.microbatch):
            raise UsageError(f"{where}: the global batch {row.global_batch} is not a whole number of micro batches "
                             f"of {row.microbatch} on each of the {row.dp} data-parallel replicas")
        if row.heads % row.tp or row.hidden % row.heads:
            raise UsageError(f"{where}: tp {row.tp} must divide the {row.heads} heads, which divide hidden "
                             f"{row.hidden}")
        rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no rows under the header")
    return rows


@lru_cache(maxsize=256)
def _workload(layers: int, hidden: int, heads: int, context: int, vocab: int, tied: bool):
    return gpt_workload(layers, hidden, heads, context, vocab, "published", tied_embeddings=tied)


def predicted(rows: list[Row], cluster: Cluster, facts: Facts = Facts()) -> list[float]:
    """Each row's predicted iteration time in ms, its own layout pinned (simulated, as a plan's rows are)."""
    out = []
    for r in rows:
        pad = facts.vocab_multiple * r.tp
        work = _workload(r.layers, r.hidden, r.heads, r.context, -(-facts.vocab // pad) * pad, facts.tied_embeddings)
        x = predict(work, r.layout(facts), cluster, Setting(r.global_batch, facts.precision, facts.optimizer))
        out.append(x.step * 1e3)
    return out


def report(rows: list[Row], times: list[float]) -> dict:
    """The errors of ``times`` (ms, predicted) against the rows' measured times (module docstring)."""
    errors = [t / r.ms - 1 for r, t in zip(rows, times)]
    size: dict[str, list[float]] = {}
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        size.setdefault(r.size, []).append(abs(errors[i]))
        groups.setdefault(r.group, []).append(i)
    rhos, regrets = [], []
    for idx in groups.values():
        if len(idx) < 2:
            continue
        got, real = [times[i] for i in idx], [rows[i].ms for i in idx]
        rhos.append(spearman(got, real))
        regrets.append(real[min(range(len(idx)), key=got.__getitem__)] / min(real) - 1)
    worst = max(range(len(rows)), key=lambda i: abs(errors[i]))
    return {"rows": len(rows), "median": statistics.median(map(abs, errors)),
            "mean": statistics.fmean(map(abs, errors)), "worst": abs(errors[worst]), "worst_row": worst,
            "median_ratio": statistics.median(t / r.ms for r, t in zip(rows, times)),
            "by_size": {k: {"rows": len(v), "median": statistics.median(v), "worst": max(v)}
                        for k, v in sorted(size.items())},
            "groups": len(rhos), "rank_median": statistics.median(rhos) if rhos else None,
            "rank_worst": min(rhos, default=None), "groups_below_0.9": sum(r < 0.9 for r in rhos),
            "regret_median": statistics.median(regrets) if regrets else None,
            "regret_worst": max(regrets, default=None), "errors": errors}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties at their mean rank); 1 where either side has one value only."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 1.0


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=v.__getitem__)
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


# ---------------------------------------------------------------- the fit
#: the parameters a fit finds: (name, start, lowest, highest, what it means). The highest is what the device can
#: do at all (the datasheet's figure, or the whole peak); the lowest keeps a parameter away from nothing.
FREE = (
    ("efficiency", 0.85, 0.05, 1.0, "the fraction of the dense peak the largest matmuls reach"),
    ("half_gflop", 25.0, 0.01, 1e4, "the size (GFLOP) of a matmul that reaches half of it"),
    ("launch_us", 800.0, 1.0, 1e5, "the host's time to launch a unit's forward of one microbatch"),
    ("intra_latency_us", 15.0, 0.1, 1e3, "the latency of one step of a collective inside a node"),
    ("intra_gbps", 2000.0, 10.0, None, "the bandwidth of a device's link inside a node, Gb/s each way"),
    ("p2p_overhead_us", 600.0, 0.0, 1e5, "the processor time of a pipeline's send or receive"),
    ("memory_gbs", 1400.0, 10.0, None, "the device memory bandwidth elementwise kernels and the optimizer reach"),
)


ROUNDS = 3  # simplexes a fit runs, each from the best point of the one before


def ramp(efficiency: float, half_gflop: float) -> tuple:
    """The matmul points of ``efficiency x f / (f + half)``: 25 sizes from 10 MFLOP to 10 PFLOP."""
    return tuple((f, efficiency * f / (f + half_gflop * 1e9)) for f in (10 ** (7 + k / 4) for k in range(25)))


def with_parameters(base: Cluster, values: dict) -> Cluster:
    """``base`` with the fitted ``values`` (:data:`FREE`'s names) in place, its ramp from ``efficiency`` and
    ``half_gflop``, and no additive per-unit cost (the fitted ``launch_us`` stands for it); every other figure
    is base's."""
    v = dict(values)
    return replace(base, matmul=ramp(v.pop("efficiency"), v.pop("half_gflop")), efficiency=values["efficiency"],
                   unit_overhead_us=0.0, **v)


def _bounds(base: Cluster) -> list[tuple[float, float]]:
    ceiling = {"intra_gbps": base.intra_gbps, "memory_gbs": base.memory_gbs}
    return [(lo, hi if hi is not None else ceiling[name]) for name, _, lo, hi, _ in FREE]


def fit(rows: list[Row], base: Cluster, facts: Facts = Facts(), iterations: int = 300, start: dict | None = None,
        progress=None, workers: int | None = None) -> tuple[Cluster, dict]:
    """(``base`` with :data:`FREE` fitted to ``rows``, the fitted values). ``start``: where the simplex starts
    (default each parameter's start in :data:`FREE`, clipped to its bounds); ``progress(done, total, loss)``;
    ``workers``: the processes that predict the rows (:class:`Predictor`; default one per core), which
    changes how long a fit takes, not what it finds."""
    bounds = _bounds(base)
    names = [name for name, *_ in FREE]
    x0 = [math.log(min(max((start or {}).get(n, s), max(lo, 1e-3)), hi))
          for (n, s, *_), (lo, hi) in zip(FREE, bounds)]

    def values(x) -> dict:
        return {n: min(max(math.exp(v), lo), hi) for n, v, (lo, hi) in zip(names, x, bounds)}

    best = x0
    with Predictor(rows, facts, workers) as times:
        def loss(x) -> float:
            cluster = with_parameters(base, values(x))
            return squared_log_error(rows, cluster, facts, times(cluster))

        for round in range(ROUNDS):  # a fresh simplex around the best point: out of a valley the last one shrank into
            best = simplex(loss, best, iterations // ROUNDS,
                           progress and (lambda done, total, low, k=round: progress(k * total + done, iterations, low)))
    found = values(best)
    return with_parameters(base, found), found


def squared_log_error(rows: list[Row], cluster: Cluster, facts: Facts = Facts(), times: list[float] | None = None
                      ) -> float:
    """What a fit minimises: the mean over the rows of log(predicted / measured) squared (``times``: the rows'
    predicted times, if already known)."""
    times = predicted(rows, cluster, facts) if times is None else times
    return statistics.fmean(math.log(t / r.ms) ** 2 for t, r in zip(times, rows))


_SHARE: tuple[list[Row], Facts] | None = None  # a Predictor's worker: its rows and facts, set once when it starts


def _keep_share(rows: list[Row], facts: Facts) -> None:
    global _SHARE
    _SHARE = (rows, facts)


def _predict_share(cluster: Cluster) -> list[float]:
    return predicted(_SHARE[0], cluster, _SHARE[1])


class Predictor:
    """:func:`predicted` over ``rows``, spread over ``workers`` processes (a contiguous share of the rows each,
    sent once when they start; then only a cluster goes out and times come back), the times in row order:
    each row's time is computed by the same code on the same numbers, so it is the same float as in one
    process. One worker, or a platform without ``fork``: no processes. A context manager: the workers end
    with it."""

    def __init__(self, rows: list[Row], facts: Facts = Facts(), workers: int | None = None):
        self.rows, self.facts = rows, facts
        n = max(1, min(workers or os.cpu_count() or 1, len(rows)))
        self.pools = []
        if n > 1 and "fork" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("fork")  # the rows are inherited, not pickled: no torch start-up
            cuts = [len(rows) * k // n for k in range(n + 1)]
            self.pools = [ctx.Pool(1, _keep_share, (rows[a:b], facts)) for a, b in zip(cuts, cuts[1:])]

    def __call__(self, cluster: Cluster) -> list[float]:
        if not self.pools:
            return predicted(self.rows, cluster, self.facts)
        pending = [pool.apply_async(_predict_share, (cluster,)) for pool in self.pools]
        return [t for share in pending for t in share.get()]

    def __enter__(self) -> "Predictor":
        return self

    def __exit__(self, *exc) -> None:
        for pool in self.pools:
            pool.terminate()
            pool.join()


def fitted_values(cluster: Cluster) -> dict:
    """The values of :data:`FREE` a cluster holds (its ramp's half size read back from its first point)."""
    f, e = cluster.matmul[0]
    return {name: (f * (cluster.efficiency / e - 1) / 1e9 if name == "half_gflop" else getattr(cluster, name))
            for name, *_ in FREE}


def simplex(f, x0: list[float], iterations: int, progress=None, step: float = 0.3) -> list[float]:
    """Nelder and Mead's downhill simplex from ``x0`` (a first simplex of ``step`` along each axis), for
    ``iterations`` moves: reflect the worst point through the others' centre, expand, contract, or shrink."""
    n = len(x0)
    points = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    scores = [f(p) for p in points]
    for it in range(iterations):
        order = sorted(range(n + 1), key=scores.__getitem__)
        points, scores = [points[i] for i in order], [scores[i] for i in order]
        centre = [sum(p[j] for p in points[:-1]) / n for j in range(n)]
        toward = lambda t: [c + t * (c - w) for c, w in zip(centre, points[-1])]  # noqa: E731
        reflected = toward(1.0)
        r = f(reflected)
        if r < scores[0]:
            expanded = toward(2.0)
            e = f(expanded)
            points[-1], scores[-1] = (expanded, e) if e < r else (reflected, r)
        elif r < scores[-2]:
            points[-1], scores[-1] = reflected, r
        else:
            contracted = toward(-0.5)
            c = f(contracted)
            if c < scores[-1]:
                points[-1], scores[-1] = contracted, c
            else:
                points = [points[0]] + [[b + 0.5 * (v - b) for b, v in zip(points[0], p)] for p in points[1:]]
                scores = [scores[0]] + [f(p) for p in points[1:]]
        if progress:
            progress(it + 1, iterations, min(scores))
    return points[min(range(n + 1), key=scores.__getitem__)]
