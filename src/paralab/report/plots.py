"""Figures and their tables, drawn from run directories only (``analysis.runs``).

Each kind has a table function (``*_table(runs) -> (headers, rows)``, what
``paralab plot KIND RUN...`` prints without ``-o``) and a drawing function
(``plot_*(runs, path)``, a PNG through matplotlib's Agg backend):

- ``throughput``: global samples/s by strategy and worker count;
- ``split-time``: seconds per iteration of every rank, stacked by category
  (data, compute, comm, optimizer, idle, other); overlapped (asynchronous)
  communication is drawn beside the stack since it is not part of the total;
- ``scaling``: seconds per iteration vs workers, one panel per strategy, with
  the ideal T1/N line (CS744 figures 2-4);
- ``timeline``: one step of each run, one row per rank: forward and backward
  with microbatch numbers, communication, idle; asynchronous communication on
  its own thin row under its rank; where the ranks report pipeline stages and
  their schedule, the ideal timeline of that schedule is drawn beside it;
- ``memory``: bytes per rank, from ``strategy_details`` in summary.json where
  the strategy reports them, else the cost model's estimate (hatched);
- ``deviation``: the largest weight deviation from the single-process
  reference vs step (runs made with ``--check --check-every K``), log scale,
  each run's tolerance dotted: put an fp32 run beside an fp64 run to see
  rounding differences grow.

What is drawn follows from what the records hold (``Run.stages``,
``Run.pipeline``, asynchronous communication, memory figures), never from a
strategy's name. Speed-ups are measured against a strategy's own 1-worker
run, else the single-process baseline's (``paralab.strategies.strategy_for``).

Sweeps draw with :func:`plot_epoch_time` and :func:`plot_speedup`.
"""
from __future__ import annotations

from pathlib import Path

from ..analysis.runs import Run, sort_runs
from ..kinds import HELD, UNSEEN

KINDS = ("throughput", "split-time", "timeline", "scaling", "memory", "deviation", "moe-load", "grad-norm")

SPLIT_COLORS = {"data": "#9e9e9e", "compute": "#4c72b0", "comm": "#dd8452", "optimizer": "#55a868",
                "idle": "#f2b5b5", "other": "#d9d9d9"}
SPLIT_ORDER = ("data", "compute", "comm", "optimizer", "idle", "other")
TIMELINE_COLORS = {"forward": "#4c72b0", "backward": "#8172b3", "compute": "#64b5cd", "comm": "#dd8452",
                   "optimizer": "#55a868", "data": "#9e9e9e", "idle": "#f2b5b5", "async": "#c44e52",
                   "backward_input": "#b07aa1", "backward_weight": "#5a3d8a"}
#: a pipeline's compute spans and the letter drawn in their boxes (zero-bubble: I and W apart)
PIPELINE_LETTERS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
WORKER_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def _ms(x) -> float | None:
    return None if x is None else 1000 * x


def _fmt(x, spec=".3g", none="-"):
    return none if x is None else format(x, spec)


# ======================================================================== throughput
def throughput_table(runs: list[Run]):
    runs = sort_runs(runs)
    rows = [[r.label, r.strategy, r.workers, r.get("global_batch"), _fmt(r.seconds_per_iter, ".4f"),
             _fmt(r.samples_per_s, ".1f"), str(r.path)] for r in runs]
    return ["run", "strategy", "workers", "global batch", "s/iter", "samples/s", "directory"], rows


def plot_throughput(runs: list[Run], path) -> Path:
    plt = _plt()
    runs = [r for r in sort_runs(runs) if r.samples_per_s]
    strategies = list(dict.fromkeys(r.series for r in runs))  # a compressed variant is its own group
    workers = sorted({r.workers for r in runs})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(strategies) * max(1, len(workers)) ** 0.5 + 2), 4.2))
    width = 0.8 / max(len(workers), 1)
    for j, w in enumerate(workers):
        xs, ys = [], []
        for i, s in enumerate(strategies):
            match = [r for r in runs if r.series == s and r.workers == w]
            if match:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(max(m.samples_per_s for m in match))
        bars = ax.bar(xs, ys, width * 0.95, label=f"{w} worker{'s' if w > 1 else ''}",
                      color=WORKER_COLORS[j % len(WORKER_COLORS)])
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(strategies)), strategies, rotation=20 if len(strategies) > 5 else 0)
    ax.set_xlabel("strategy")
    ax.set_ylabel("throughput (samples/s, global)")
    ax.set_title("Training throughput by strategy and worker count")
    ax.legend(title="workers", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)
    return _save(fig, path)


# ======================================================================== split time
def split_table(runs: list[Run]):
    rows = []
    for r in sort_runs(runs):
        for rank in r.ranks:
            sp = r.split(rank)
            rows.append([r.label, rank] + [_fmt(_ms(sp.get(c, 0.0)), ".2f") for c in SPLIT_ORDER]
                        + [_fmt(_ms(sp.get("comm_async", 0.0)), ".2f"), _fmt(_ms(sp.get("step")), ".2f")])
    return (["run", "rank"] + [f"{c} ms" for c in SPLIT_ORDER] + ["async comm ms", "step ms"]), rows


def plot_split_time(runs: list[Run], path) -> Path:
    plt = _plt()
    bars = [(r, rank) for r in sort_runs(runs) for rank in r.ranks]
    has_async = any(r.split(k).get("comm_async", 0) > 0 for r, k in bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(bars) + 2.5), 4.6))
    xs = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    w = 0.6 if has_async else 0.75
    for cat in SPLIT_ORDER:
        vals = [1000 * r.split(k).get(cat, 0.0) for r, k in bars]
        if not any(vals):
            continue
        ax.bar([x - (0.12 if has_async else 0) for x in xs], vals, w, bottom=bottom, label=cat,
               color=SPLIT_COLORS[cat], edgecolor="white", linewidth=0.4)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if has_async:
        vals = [1000 * r.split(k).get("comm_async", 0.0) for r, k in bars]
        ax.bar([x + 0.33 for x in xs], vals, 0.18, label="async comm (overlapped, not in total)",
               facecolor="none", edgecolor=TIMELINE_COLORS["async"], hatch="////", linewidth=0.8)
    # group separators and labels: one group per run
    labels = [f"{r.label}\nrank {k}" for r, k in bars]
    ax.set_xticks(xs, labels, rotation=90 if len(bars) > 5 else 0, fontsize=7)
    prev = None
    for x, (r, _) in enumerate(bars):
        if prev is not None and r is not prev:
            ax.axvline(x - 0.5, color="#cccccc", linewidth=0.6)
        prev = r
    ax.set_ylabel("time per iteration (ms)")
    ax.set_xlabel("run and rank")
    ax.set_title("Split time per rank (mean of measured steps)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


# ======================================================================== scaling
def baseline_strategy() -> str | None:
    """The single-process strategy speed-ups fall back on (``single``), or None."""
    try:
        from ..strategies import strategy_for
        return strategy_for("baseline")
    except Exception:  # noqa: BLE001 - without a registry: no baseline, each run against its own
        return None


def scaling_rows(runs: list[Run], baseline: str | None = None):
    """Per strategy (``Run.series``: a compressed variant is its own) and worker count: s/iter, the
    ideal T1/N, speedup and efficiency.

    T1 is the strategy's own 1-worker run, else the 1-worker run of ``baseline`` (default: the
    single-process strategy), named in the row.
    """
    runs = sort_runs(runs)
    baseline = baseline or baseline_strategy()
    single = [r for r in runs if baseline and r.strategy == baseline and r.workers == 1 and r.seconds_per_iter]
    out = []
    for s in dict.fromkeys(r.series for r in runs):  # a compressed variant scales on its own
        mine = sorted((r for r in runs if r.series == s and r.seconds_per_iter), key=lambda r: r.workers)
        base = next((r for r in mine if r.workers == 1), None)
        base = base or (single[0] if single else None)
        for r in mine:
            t1 = base.seconds_per_iter if base else None
            ideal = t1 / r.workers if t1 else None
            speed = t1 / r.seconds_per_iter if t1 else None
            out.append({"strategy": s, "workers": r.workers, "run": r, "seconds_per_iter": r.seconds_per_iter,
                        "baseline": base.label if base else None, "ideal": ideal, "speedup": speed,
                        "efficiency": speed / r.workers if speed else None})
    return out


def scaling_table(runs: list[Run], baseline: str | None = None):
    rows = [[e["strategy"], e["workers"], _fmt(e["seconds_per_iter"], ".4f"), _fmt(e["ideal"], ".4f"),
             _fmt(e["speedup"], ".2f"), _fmt(None if e["efficiency"] is None else 100 * e["efficiency"], ".0f"),
             e["baseline"] or "-"] for e in scaling_rows(runs, baseline)]
    return ["strategy", "workers", "s/iter", "ideal T1/N", "speedup", "efficiency %", "T1 from"], rows


def plot_scaling(runs: list[Run], path, baseline: str | None = None) -> Path:
    plt = _plt()
    baseline = baseline or baseline_strategy()
    entries = scaling_rows(runs, baseline)
    strategies = list(dict.fromkeys(e["strategy"] for e in entries))
    if not strategies:
        raise ValueError("no run with a measured time per iteration")
    cols = min(4, len(strategies))
    nrows = (len(strategies) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.3 * cols + 0.5, 2.9 * nrows + 0.6), squeeze=False)
    all_w = sorted({e["workers"] for e in entries} | {1})
    single = next((e for e in entries if e["strategy"] == baseline and e["workers"] == 1), None)
    for i, s in enumerate(strategies):
        ax = axes[i // cols][i % cols]
        mine = [e for e in entries if e["strategy"] == s]
        ws = [e["workers"] for e in mine]
        ax.plot(ws, [e["seconds_per_iter"] for e in mine], "o-", color="#4c72b0", label="measured")
        top = max(e["seconds_per_iter"] for e in mine)
        for e in mine:
            ax.annotate(f"{e['seconds_per_iter']:.3g}", (e["workers"], e["seconds_per_iter"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
        base = next((e for e in mine if e["ideal"]), None)
        if base and (len(mine) > 1 or mine[0]["workers"] > 1):
            t1 = base["ideal"] * base["workers"]
            grid = [w for w in all_w if w <= max(ws)]
            ax.plot(grid, [t1 / w for w in grid], "--", color="#888888", label=f"ideal T1/N (T1: {base['baseline']})")
            top = max(top, t1)
        if single and s != baseline:
            ax.axhline(single["seconds_per_iter"], color="#c44e52", linestyle=":", linewidth=1,
                       label=f"{baseline} (1 worker)")
            top = max(top, single["seconds_per_iter"])
        ax.set_title(s, fontsize=10)
        ax.set_xticks(all_w)
        ax.set_xlim(min(all_w) - 0.3, max(all_w) + 0.3)
        ax.set_xlabel("workers")
        ax.set_ylabel("time per iteration (s)")
        ax.set_ylim(0, top * 1.18)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for j in range(len(strategies), nrows * cols):
        axes[j // cols][j % cols].set_visible(False)
    fig.suptitle("Seconds per iteration vs workers (dashed: ideal 1/N scaling)", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# ======================================================================== timeline
def default_step(run: Run) -> int:
    measured = run.measured_steps()
    if not measured:
        raise ValueError(f"{run.path}: no training steps recorded")
    return measured[-1]


def timeline_spans(run: Run, step: int | None = None):
    """The spans of one step, times in ms from the step's first span (over all ranks)."""
    step = default_step(run) if step is None else step
    spans = [s for s in run.step_spans(step)]
    if not spans:
        raise ValueError(f"{run.path}: step {step} has no spans (steps recorded: "
                         f"{run.measured_steps()[:1]}..{run.measured_steps()[-1:]})")
    t0 = min(s["t0"] for s in spans)
    return step, t0, spans


def _span_kind(s: dict) -> str:
    if s.get("args", {}).get("async"):
        return "unseen" if s["args"].get(UNSEEN) else "async"
    if s["category"] == "compute":
        return s["name"] if s["name"] in PIPELINE_LETTERS else "compute"
    return s["category"]


def timeline_table(runs: list[Run], step: int | None = None):
    rows = []
    for r in sort_runs(runs):
        st, t0, spans = timeline_spans(r, step)
        for s in sorted(spans, key=lambda s: (s["rank"], s["t0"])):
            mb = s.get("args", {}).get("mb")
            rows.append([r.label, st, s["rank"], f"{1000 * (s['t0'] - t0):.2f}", f"{1000 * (s['t1'] - t0):.2f}",
                         f"{1000 * (s['t1'] - s['t0']):.2f}", _span_kind(s), s["name"],
                         "" if mb is None else mb, s.get("bytes") or ""])
    return ["run", "step", "rank", "start ms", "end ms", "ms", "kind", "name", "mb", "bytes"], rows


def _draw_boxes(ax, boxes, total, y_of, height_of):
    """boxes: (rank, start, end, kind, text, async?)."""
    for rank, a, b, kind, text, asynchronous in boxes:
        y, h = y_of(rank, asynchronous), height_of(asynchronous)
        color = TIMELINE_COLORS.get(kind, "#cccccc")
        hatch = "xx" if kind == "idle" else None
        if kind == "unseen":  # launched, done by its wait at the latest: an outline, never a filled overlap
            ax.broken_barh([(a, max(b - a, total * 1e-4))], (y, h), facecolors="none",
                           edgecolor=TIMELINE_COLORS["async"], linewidth=0.6, linestyle=":")
            continue
        ax.broken_barh([(a, max(b - a, total * 1e-4))], (y, h), facecolors=color, edgecolor="white",
                       linewidth=0.3, hatch=hatch, alpha=0.85 if asynchronous else 1.0)
        if text and (b - a) > total * 0.025 and not asynchronous:
            ax.text((a + b) / 2, y + h / 2, text, ha="center", va="center", fontsize=6.5, color="white",
                    clip_on=True)


def _legend(ax, kinds):
    from matplotlib.patches import Patch
    names = {"forward": "forward", "backward": "backward", "backward_input": "backward: input gradient (I)",
             "backward_weight": "backward: weight gradients (W)", "compute": "compute (other)",
             "comm": "communication (blocking)", "async": "async communication (overlapped)",
             "unseen": "async send/recv, until its wait (completion not reported)",
             "optimizer": "optimizer", "data": "data", "idle": "idle (waiting on a peer)"}
    handles = [Patch(facecolor="none", edgecolor=TIMELINE_COLORS["async"], linestyle=":", label=names[k])
               if k == "unseen" else
               Patch(facecolor=TIMELINE_COLORS[k], hatch="xx" if k == "idle" else None, label=names[k])
               for k in names if k in kinds]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _run_boxes(run: Run, step: int | None):
    st, t0, spans = timeline_spans(run, step)
    boxes = []
    for s in sorted(spans, key=lambda s: (s["t0"], -s["t1"])):  # outer spans first: nested ones draw on top
        kind = _span_kind(s)
        mb = s.get("args", {}).get("mb")
        letter = PIPELINE_LETTERS.get(kind, "")
        unit = s.get("args", {}).get("unit")
        text = (f"{letter}{mb}" if letter and mb is not None else
                f"{letter} u{unit}" if letter and unit is not None else letter)
        if kind == "comm" and (s["t1"] - s["t0"]) > 0:
            text = ""
        boxes.append((s["rank"], 1000 * (s["t0"] - t0), 1000 * (s["t1"] - t0), kind, text,
                      kind in ("async", "unseen")))
    return st, boxes


def ideal_schedule_boxes(run: Run):
    """The ideal timeline of the run's pipeline schedule on the measured stage times, or (None, reason)
    (``analysis/pipeline.ideal_timeline``), as boxes to draw."""
    from ..analysis.pipeline import ideal_timeline
    ideal, why = ideal_timeline(run)
    if ideal is None:
        return None, why
    timed, v, m, n = ideal.timed, ideal.virtual, ideal.microbatches, ideal.stages
    known, schedule = ideal.known, ideal.schedule
    boxes = []
    for row in timed:
        for t in row:
            kind = str(getattr(t.action.kind, "value", t.action.kind))
            if kind in PIPELINE_LETTERS:
                text = f"{PIPELINE_LETTERS[kind]}{t.action.microbatch}" + (f"s{t.action.stage}" if v > 1 else "")
                boxes.append((t.rank, t.t0, t.t1, kind, text, False))
            elif kind.startswith("recv") and t.t1 > t.t0:
                boxes.append((t.rank, t.t0, t.t1, "idle", "", False))
    desc = (f"{schedule}, {n} stages{f' x {v} virtual' if v > 1 else ''}, {m} microbatch{'es' if m > 1 else ''}"
            if known or m > 1 else f"model parallelism, {n} stages, whole batch (no pipelining)")
    return (boxes, desc), None


def plot_timeline(runs: list[Run], path, step: int | None = None, ideal: bool = True) -> Path:
    plt = _plt()
    runs = sort_runs(runs)
    panels = []
    notes = []
    for r in runs:
        st, boxes = _run_boxes(r, step)
        ideal_panel, why = ideal_schedule_boxes(r) if ideal else (None, None)
        if ideal and why and r.pipeline is not None:
            notes.append(f"{r.label}: no ideal timeline ({why})")
        panels.append((r, st, boxes, ideal_panel))
    with_ideal = any(p[3] for p in panels)
    heights = [max(1.4, 0.55 * r.workers * (1.35 if any(b[5] for b in boxes) else 1) + 0.9)
               for r, _, boxes, _ in panels]
    fig, axes = plt.subplots(len(panels), 2 if with_ideal else 1, squeeze=False,
                             figsize=(13 if with_ideal else 10, sum(heights) + 0.4),
                             gridspec_kw={"height_ratios": heights, **({"width_ratios": [3, 2]} if with_ideal else {})})
    kinds_seen = set()
    for i, (r, st, boxes, ideal_panel) in enumerate(panels):
        ax = axes[i][0]
        has_async = any(b[5] for b in boxes)
        pitch = 1.4 if has_async else 1.0

        def y_of(rank, asynchronous, pitch=pitch):
            return rank * pitch + (0.82 if asynchronous else 0.0)

        def height_of(asynchronous):
            return 0.38 if asynchronous else 0.76

        total = max((b[2] for b in boxes), default=1.0)
        _draw_boxes(ax, boxes, total, y_of, height_of)
        kinds_seen |= {b[3] for b in boxes}
        ticks = [y_of(k, False) + 0.38 for k in range(r.workers)]
        labels = [f"rank {k}" for k in range(r.workers)]
        if has_async:
            ticks += [y_of(k, True) + 0.19 for k in range(r.workers)]
            labels += [f"rank {k} async" for k in range(r.workers)]
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.set_ylim(-0.15, (r.workers - 1) * pitch + (1.3 if has_async else 0.9))
        ax.invert_yaxis()
        ax.set_xlim(0, total * 1.01)
        ax.set_xlabel("time since the step's first span (ms)")
        ax.set_title(f"{r.label}: step {st} (measured)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        if with_ideal:
            ax2 = axes[i][1]
            if ideal_panel:
                iboxes, desc = ideal_panel
                itotal = max(b[2] for b in iboxes)
                _draw_boxes(ax2, iboxes, itotal, lambda k, a: k, lambda a: 0.76)
                kinds_seen |= {b[3] for b in iboxes}
                n = r.num_stages
                ax2.set_yticks([k + 0.38 for k in range(n)], [f"stage {k}" for k in range(n)], fontsize=7)
                ax2.set_ylim(-0.15, n - 0.1)
                ax2.invert_yaxis()
                ax2.set_xlim(0, itotal * 1.01)
                ax2.set_xlabel("ideal time (ms): measured compute, free communication")
                ax2.set_title(f"ideal {desc}", fontsize=9)
                ax2.grid(axis="x", alpha=0.3)
            else:
                ax2.set_visible(False)
    _legend(axes[0][-1] if with_ideal and panels[0][3] else axes[0][0], kinds_seen)
    title = "Per-rank timeline of one training step"
    if notes:
        title += "\n" + "; ".join(notes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


# ======================================================================== memory
PARAMETER_KEYS = ("stage_parameters", "shard_parameters", "local_parameters")
COMPONENT_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                   "peak_activation": "peak activations"}


def _component(name: str) -> str:
    name = name[:-6] if name.endswith("_bytes") else name
    return COMPONENT_NAMES.get(name, name.replace("_", " "))


def _numeric_dict(d) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not k.startswith("total")}


#: the memory part every strategy's row shows beside its model states (run/held.py measures it on every rank)
SAVED = "saved activations (peak)"


def memory_by_rank(run: Run) -> dict[int, dict]:
    """Per rank: ``{"parts": {component: (bytes, estimated?)}, "predicted": bytes | None}``.

    Sources, in order: what the rank measured it holds (``held``: model
    states and the peak of saved activations, ``run/held.py``, the one place
    a run measures memory), beside the cost model's prediction where the
    strategy records the ``memory`` model it holds (fsdp, torch-fsdp: its
    parts are then the ledgers' resident peak, which that model predicts) or
    else the planner's for the run's layout; for records from before
    ``held``, the strategy's own ``memory`` figures (``{component: bytes}``
    or a ledger's ``{"measured": {"resident_peak_split": {...}}}``), or
    otherwise the model state estimated with the cost model
    (``analysis.memory``, DDP formula) for the parameters the rank holds
    (``stage_parameters`` / ``shard_parameters`` when reported, else the
    whole model). Reported ``*_bytes`` figures (e.g. a pipeline stage's peak
    activations) are added as measured parts.
    """
    out: dict[int, dict] = {}
    for rank in (run.ranks or [0]):
        det = run.details.get(str(rank))
        det = det if isinstance(det, dict) else {}
        mem = det.get("memory")
        if mem is None and isinstance(det.get("data_parallel"), dict):  # a stage flavour's ledger (old records)
            mem = det["data_parallel"].get("memory")
        parts: dict[str, tuple[float, bool]] = {}
        predicted = predicted_peak = None
        held = det.get(HELD) if isinstance(det.get(HELD), dict) else None
        if isinstance(mem, dict):
            measured = (held or {}).get("ledger") or mem.get("measured")  # (the latter: records before held)
            split = _numeric_dict(measured.get("resident_peak_split")) if isinstance(measured, dict) else {}
            flat = _numeric_dict(mem)
            if split:
                parts = {_component(k): (v, False) for k, v in split.items()}
            elif flat:
                parts = {_component(k): (v, False) for k, v in flat.items()}
            pred = mem.get("predicted")
            if isinstance(pred, dict):
                pb = pred.get("bytes", pred)
                if isinstance(pb, dict):
                    predicted = pb.get("total") if isinstance(pb.get("total"), (int, float)) else (
                        sum(_numeric_dict(pb).values()) or None)
                    if isinstance(pb.get("peak"), (int, float)) and pb["peak"] != predicted:
                        predicted_peak = pb["peak"]  # model states + the largest unit's working set
        if parts and held:  # a ledger counts model states: the saved activations beside them, as for the rest
            parts.setdefault(SAVED, (float(held.get("saved_activations_peak_bytes", 0)), False))
        if not parts and held:  # measured on any device (run/held.py)
            states = _numeric_dict(held.get("model_states_bytes"))
            parts = {("optimizer state" if k == "optimizer" else f"{k} held" if k == "other" else k): (v, False)
                     for k, v in states.items() if v}
            parts[SAVED] = (float(held.get("saved_activations_peak_bytes", 0)), False)
            guess = held.get("predicted") or {}  # the planner's, for the run's layout (analysis/plan/from_run.py)
            out[rank] = {"parts": parts, "predicted": guess.get("model_states_bytes"),
                         "predicted_peak": guess.get("total_bytes")}
            continue
        if not parts:
            counted = next((det[k] for k in PARAMETER_KEYS if isinstance(det.get(k), (int, float))), None)
            parts = {k: (v, True) for k, v in estimate_model_state(run, counted).items()}
        for k, v in det.items():
            if k.endswith("_bytes") and isinstance(v, (int, float)) and not k.startswith("total"):
                parts[_component(k)] = (float(v), False)
        if parts:
            out[rank] = {"parts": parts, "predicted": predicted, "predicted_peak": predicted_peak}
    return out


def estimate_model_state(run: Run, parameters: float | None = None) -> dict[str, float]:
    """Parameters, gradients and optimizer state of ``parameters`` (default: the whole model), unsharded."""
    p = parameters if parameters is not None else run.get("parameters")
    if not p:
        return {}
    from ..analysis.memory import memory_per_worker, optimizer_kind
    precision = "mixed" if run.config.get("precision", "fp32") != "fp32" else "fp32"
    est = memory_per_worker(int(p), 1, 0, optimizer_kind(run.config.get("optimizer", "sgd"),
                                                         run.config.get("momentum", 0.9)), precision)
    return {"parameters": est.params.value, "gradients": est.grads.value, "optimizer state": est.optimizer_state.value}


def memory_table(runs: list[Run]):
    rows = []
    for r in sort_runs(runs):
        for rank, m in sorted(memory_by_rank(r).items()):
            parts = m["parts"]
            est = [k for k, (_, e) in parts.items() if e]
            rows.append([r.label, rank, f"{sum(v for v, _ in parts.values()) / 1e6:.3f}",
                         _fmt(None if m["predicted"] is None else m["predicted"] / 1e6, ".3f"),
                         _fmt(None if m.get("predicted_peak") is None else m["predicted_peak"] / 1e6, ".3f"),
                         ", ".join(f"{k} {v / 1e6:.3f}" for k, (v, _) in parts.items()),
                         ("estimated: " + ", ".join(est)) if est else "measured / reported"])
    return ["run", "rank", "total MB", "predicted model states MB", "predicted peak MB", "components (MB)",
            "source"], rows


def plot_memory(runs: list[Run], path) -> Path:
    plt = _plt()
    bars = []
    for r in sort_runs(runs):
        for rank, m in sorted(memory_by_rank(r).items()):
            bars.append((r, rank, m))
    if not bars:
        raise ValueError("no run has memory figures or a parameter count")
    comps_all = list(dict.fromkeys(k for _, _, m in bars for k in m["parts"]))
    colors = dict(zip(comps_all, WORKER_COLORS * 3))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(bars) + 2.5), 4.6))
    bottom = [0.0] * len(bars)
    any_est = False
    for comp in comps_all:
        for x, (_, _, m) in enumerate(bars):
            v, est = m["parts"].get(comp, (0.0, False))
            if not v:
                continue
            any_est |= est
            ax.bar(x, v / 1e6, 0.7, bottom=bottom[x], color=colors[comp], edgecolor="white",
                   hatch=".." if est else None, label=comp if comp not in ax.get_legend_handles_labels()[1] else None)
            bottom[x] += v / 1e6
    for x, (_, _, m) in enumerate(bars):
        for key, style, label in (("predicted", "-", "predicted model states (cost model)"),
                                  ("predicted_peak", "--", "predicted peak: + working set or activations")):
            if m.get(key):
                ax.plot([x - 0.42, x + 0.42], [m[key] / 1e6] * 2, color="black", linewidth=1.6, linestyle=style,
                        label=label if label not in ax.get_legend_handles_labels()[1] else None)
    ax.set_xticks(range(len(bars)), [f"{r.label}\nrank {k}" for r, k, _ in bars],
                  rotation=90 if len(bars) > 5 else 0, fontsize=7)
    ax.set_ylabel("memory per rank (MB, 1 MB = 10^6 B)")
    ax.set_xlabel("run and rank")
    title = "Memory per rank: model states and saved activations"
    if any_est:
        title += ("\ndotted: estimated by the cost model for the parameters the rank holds; "
                  "solid: measured by the strategy")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


# ======================================================================== sweeps
def plot_epoch_time(points, path) -> Path:
    """Epoch time vs per-device batch size: ``points`` is [(batch, {"epoch_s", "epoch_no_data_s"})]."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [b for b, _ in points]
    ax.plot(xs, [t["epoch_no_data_s"] for _, t in points], "o-", label="without data loading")
    ax.plot(xs, [t["epoch_s"] for _, t in points], "s--", label="with data loading")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size per device (samples)")
    ax.set_ylabel("epoch time (s)")
    ax.set_title("Second-epoch training time vs batch size")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_speedup(curves, workers: list[int], title: str, ylabel: str, path) -> Path:
    """Speedup vs workers with the ideal linear line: ``curves`` is [(label, matplotlib style,
    [(workers, speedup)])], drawn in turn in the worker colours."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, style, pts) in enumerate(curves):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=WORKER_COLORS[i % len(WORKER_COLORS)],
                label=label)
    ax.plot(workers, [w / workers[0] for w in workers], ":", color="#888888", label="ideal (linear)")
    ax.set_xticks(workers)
    ax.set_xlabel("workers")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ======================================================================== dispatch
# ---------------------------------------------------------------- deviation from the reference
def deviation_history(run: Run) -> list[dict]:
    """Per checked step of ``--check`` (every K steps with ``--check-every K``, and at the end): the largest
    weight deviation over the ranks (``max_weight_dev``) and, below fp64, the worst ratio of the weights' and
    the optimizer state's deviation to their noise band (``weights_ratio``, ``optimizer_ratio``)."""
    check = run.get("check") or {}
    return list(check.get("history") or [])


def _precision(run: Run) -> str:
    return (run.get("check") or {}).get("precision") or run.config.get("precision", "fp32")


def deviation_table(runs: list[Run]):
    def ratio(h, kind):
        return _fmt(h.get(f"{kind}_ratio"), ".3g")
    rows = [[r.label, _precision(r), h["step"], f"{h['max_weight_dev']:.3e}",
             _fmt(((r.get("check") or {}).get("tolerances") or {}).get("weights"), ".0e"),
             ratio(h, "weights"), ratio(h, "optimizer")]
            for r in runs for h in deviation_history(r)]
    return ["run", "precision", "step", "max |weight - reference|", "exact within", "weights / band",
            "optimizer / band"], rows


def _log_by_step(ax, ylabel: str, title: str) -> None:
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)


def plot_deviation(runs: list[Run], path) -> Path:
    """Left: each run's largest weight deviation per checked step, with fp64's tolerance (what "exact" means).
    Right, where a run was checked below fp64: the worst ratio of the weights' and the optimizer state's
    deviation to the noise band measured for that run (check/band.py): above 1 is a bug."""
    curves = [(r, deviation_history(r)) for r in runs]
    curves = [(r, h) for r, h in curves if h]
    if not curves:
        raise ValueError("no run holds a deviation history: train with --check --check-every K")
    banded = any("weights_ratio" in h for _, history in curves for h in history)
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if banded else 1, figsize=(12.0 if banded else 7.0, 4.2), squeeze=False)
    ax = axes[0][0]
    for k, (r, history) in enumerate(curves):
        color = WORKER_COLORS[k % len(WORKER_COLORS)]
        # a deviation of exactly 0 (the same operations as the reference) cannot sit on a log axis
        ax.plot([h["step"] for h in history], [max(h["max_weight_dev"], 1e-18) for h in history], marker="o",
                color=color, label=f"{r.label} ({_precision(r)})")
        tol = ((r.get("check") or {}).get("tolerances") or {}).get("weights")
        if tol:
            ax.axhline(tol, color=color, linestyle=":", linewidth=1)
    _log_by_step(ax, "max |weight - reference| (over ranks)",
                 "deviation from the single-process reference\n(dotted: exact within fp64's tolerance)")
    if banded:
        ax = axes[0][1]
        for k, (r, history) in enumerate(curves):
            color = WORKER_COLORS[k % len(WORKER_COLORS)]
            for kind, style in (("weights", "-"), ("optimizer", "--")):
                points = [(h["step"], max(h[f"{kind}_ratio"], 1e-6)) for h in history if f"{kind}_ratio" in h]
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=color,
                            label=f"{r.label} ({_precision(r)}) {kind}")
        ax.axhline(1.0, color="black", linewidth=1)
        _log_by_step(ax, "worst deviation / its noise band", "bug or rounding (above 1: outside the band, a bug)")
    return _save(fig, path)


def moe_load(run: Run) -> dict | None:
    """A mixture-of-experts run's routing from its steps.jsonl: per rank the tokens it routed to each expert
    (every step and layer), and per step the load imbalance (max over mean, the worst layer, over all ranks'
    tokens) and the dropped choices; None for a run without MoE records."""
    rows = [r for r in run.steps if r.get("moe")]
    if not rows:
        return None
    per_rank: dict[int, list[int]] = {}
    per_step: dict[int, dict] = {}
    for r in rows:
        totals = per_rank.setdefault(r["rank"], [0] * len(r["moe"][0]["counts"]))
        step = per_step.setdefault(r["step"], {"counts": {}, "dropped": 0})
        for i, layer in enumerate(r["moe"]):  # by the layer it names (a pipeline stage holds some of them)
            totals[:] = [a + b for a, b in zip(totals, layer["counts"])]
            at = layer.get("layer", i)
            step["counts"][at] = [a + b for a, b in zip(step["counts"].get(at) or [0] * len(layer["counts"]),
                                                        layer["counts"])]
            step["dropped"] += layer["dropped"]
    over_time = [(st, max(max(c) / (sum(c) / len(c)) if sum(c) else 1.0 for c in v["counts"].values()),
                  v["dropped"])
                 for st, v in sorted(per_step.items())]
    return {"per_rank": per_rank, "over_time": over_time}


def moe_table(runs: list[Run]):
    rows = []
    for r in runs:
        load = moe_load(r)
        if load is None:
            continue
        for rank, counts in sorted(load["per_rank"].items()):
            rows.append([r.label, rank, " ".join(str(c) for c in counts),
                         _fmt(max(counts) / (sum(counts) / len(counts)) if sum(counts) else None, ".3f")])
    return ["run", "rank", "tokens routed to each expert (all steps and layers)", "max / mean"], rows


def plot_moe_load(runs: list[Run], path) -> Path:
    loads = [(r, moe_load(r)) for r in runs]
    loads = [(r, load) for r, load in loads if load]
    if not loads:
        raise ValueError("no run holds mixture-of-experts records: train --model gpt --experts E")
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    width = 0.8 / sum(len(load["per_rank"]) for _, load in loads)
    k = 0
    for r, load in loads:
        for rank, counts in sorted(load["per_rank"].items()):
            xs = [e + k * width for e in range(len(counts))]
            left.bar(xs, counts, width, color=WORKER_COLORS[k % len(WORKER_COLORS)], label=f"{r.label} rank {rank}")
            k += 1
    experts = len(next(iter(loads[0][1]["per_rank"].values())))
    left.set_xticks([e + (k - 1) * width / 2 for e in range(experts)], [str(e) for e in range(experts)])
    left.set_xlabel("expert")
    left.set_ylabel("tokens routed (all steps and layers)")
    left.set_title("load per expert, by the rank that routed the tokens")
    left.legend(fontsize=7)
    for j, (r, load) in enumerate(loads):
        steps = [st for st, _, _ in load["over_time"]]
        right.plot(steps, [imb for _, imb, _ in load["over_time"]], marker="o", markersize=3,
                   color=WORKER_COLORS[j % len(WORKER_COLORS)], label=f"{r.label}")
        dropped = [d for _, _, d in load["over_time"]]
        if any(dropped):
            right.plot(steps, [1 + d / max(max(dropped), 1) for d in dropped], linestyle=":",
                       color=WORKER_COLORS[j % len(WORKER_COLORS)], label=f"{r.label}: dropped (scaled)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("step")
    right.set_ylabel("max / mean tokens per expert (worst layer)")
    right.set_title("imbalance over time (1: even)")
    right.legend(fontsize=7)
    return _save(fig, path)


# ---------------------------------------------------------------- the gradient norm (--clip-grad)
def grad_norms(run: Run) -> list[tuple[int, float]]:
    """(step, the whole model's gradient norm before clipping) as rank 0 recorded it (every rank records the
    same norm: one all-reduce gives it to all); empty for a run without --clip-grad."""
    return sorted((r["step"], r["grad_norm"]) for r in run.steps if r.get("rank") == 0 and r.get("grad_norm") is not None)


def _clip(run: Run) -> float | None:
    return run.config.get("clip_grad")


def grad_norm_table(runs: list[Run]):
    rows = [[r.label, step, f"{norm:.6g}", _fmt(_clip(r), "g"), "yes" if _clip(r) and norm > _clip(r) else "no"]
            for r in runs for step, norm in grad_norms(r)]
    return ["run", "step", "gradient norm (before clipping)", "--clip-grad", "clipped"], rows


def plot_grad_norm(runs: list[Run], path) -> Path:
    curves = [(r, grad_norms(r)) for r in runs]
    curves = [(r, h) for r, h in curves if h]
    if not curves:
        raise ValueError("no run holds gradient norms: train with --clip-grad NORM")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for k, (r, history) in enumerate(curves):
        color = WORKER_COLORS[k % len(WORKER_COLORS)]
        ax.plot([s for s, _ in history], [n for _, n in history], marker="o", markersize=3, color=color,
                label=r.label)
        if _clip(r):
            ax.axhline(_clip(r), color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("whole-model gradient norm, before clipping")
    ax.set_title("gradient norm per step (dotted: each run's --clip-grad)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


TABLES = {"throughput": throughput_table, "split-time": split_table, "timeline": timeline_table,
          "scaling": scaling_table, "memory": memory_table, "deviation": deviation_table, "moe-load": moe_table,
          "grad-norm": grad_norm_table}
PLOTS = {"throughput": plot_throughput, "split-time": plot_split_time, "timeline": plot_timeline,
         "scaling": plot_scaling, "memory": plot_memory, "deviation": plot_deviation, "moe-load": plot_moe_load,
         "grad-norm": plot_grad_norm}
