"""The report page of a plan: the ranked layouts, where each one's step goes, and its memory.

``paralab plan ... --report DIR`` writes ``DIR/plan.json`` (what ``--json``
prints), ``DIR/report.html`` and ``DIR/report.md``, and two figures: each
ranked layout's predicted step split into its terms (compute, tensor-parallel
communication, pipeline bubble, pipeline transfers, exposed data-parallel
communication, optimizer step), and its peak memory per device split into
model states and activations against the device's usable memory. The page is
built from the JSON alone, so a saved plan renders the same page again.
"""
from __future__ import annotations

from pathlib import Path

from .page import Report
from .plots import WORKER_COLORS, _plt, _save

#: the step's terms, in the order they are drawn, and their column names
TERMS = (("compute", "compute"), ("tp_comm", "tp comm"), ("cp_comm", "cp comm"), ("ep_comm", "ep comm"),
         ("bubble", "bubble"), ("pp_comm", "pp comm"), ("dp_comm", "dp comm"), ("optimizer", "optimizer"))


def _ms(x: float) -> str:
    return f"{x * 1e3:.4g}"


def plot_step_terms(plan: dict, path) -> Path:
    """One horizontal bar per ranked layout, stacked by the step's terms (ms)."""
    plt = _plt()
    ranked = plan["ranked"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranked) + 1.2))
    left = [0.0] * len(ranked)
    ys = range(len(ranked))
    for (key, name), color in zip(TERMS, WORKER_COLORS):
        widths = [1e3 * r.get(key, 0.0) for r in ranked]
        ax.barh(ys, widths, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(list(ys), [f"#{i} {r['layout']['label']}" for i, r in enumerate(ranked, 1)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted ms per step")
    ax.legend(fontsize=8, ncols=6, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    return _save(fig, path)


def plot_memory(plan: dict, path) -> Path:
    """Peak memory per device of each ranked layout, by part, against the device's usable memory."""
    plt = _plt()
    ranked = plan["ranked"]
    parts = [k for k in ("model_states", "activations") if any(k in r["memory_parts"] for r in ranked)]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranked) + 1.2))
    left = [0.0] * len(ranked)
    ys = range(len(ranked))
    for part, color in zip(parts, WORKER_COLORS):
        widths = [r["memory_parts"].get(part, 0.0) / 1e9 for r in ranked]
        ax.barh(ys, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    c = plan["cluster"]
    ax.axvline(c["memory_gb"] * c["usable_fraction"], color="#b42318", ls="--", label="usable per device")
    ax.set_yticks(list(ys), [f"#{i} {r['layout']['label']}" for i, r in enumerate(ranked, 1)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted peak GB per device")
    ax.legend(fontsize=8, ncols=3, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    return _save(fig, path)


def build_plan_report(plan: dict, out_dir: Path) -> Report:
    """The page of a plan (``commands/plan.to_json``'s dict); figures go to ``out_dir``."""
    out_dir = Path(out_dir)
    c, s = plan["cluster"], plan["setting"]
    rep = Report(f"paralab plan: {plan['model']} on {plan['workers']} x {c['name']}")
    sec = rep.section("Ranking")
    sec.para(f"Global batch {s['global_batch']}, {s['precision']} precision, {s['optimizer']}. "
             f"{plan['considered']} layouts divide the model and the workers, {plan['fitting']} fit in memory; "
             f"the fastest {len(plan['ranked'])} are ranked by predicted step time (pipeline bubbles from the "
             "schedule simulator on per-stage times).")
    gpt = "context" in plan["shape"]
    rows = [[i, r["layout"]["label"], _ms(r["step"]), *(_ms(r.get(k, 0.0)) for k, _ in TERMS), f"{r['memory'] / 1e9:.4g}",
             f"{100 * r['mfu']:.1f}", f"{r['tokens_per_s' if gpt else 'samples_per_s']:.4g}"]
            for i, r in enumerate(plan["ranked"], 1)]
    per = "tokens/s" if gpt else "samples/s"
    sec.table(["#", "layout", "step ms", *(n for _, n in TERMS), "mem GB", "MFU %", per], rows,
              "predicted per step; dp comm is what the strategy's overlap leaves exposed")
    if plan.get("why"):
        sec.para("Why the first beats the second: " + plan["why"])
    sec.code(plan["command"])
    sec = rep.section("Where the step goes")
    sec.figure(plot_step_terms(plan, out_dir / "plots" / "step.png"), "plots/step.png",
               "Each layout's predicted step, by term.")
    sec = rep.section("Memory per device")
    sec.figure(plot_memory(plan, out_dir / "plots" / "memory.png"), "plots/memory.png",
               "Each layout's predicted peak per device, by part; dashed: the usable memory.")
    sec = rep.section("Cluster")
    sec.table(["field", "value"], [[k, v] for k, v in c.items() if k != "source"])
    sec.para("Source: " + c["source"])
    return rep
