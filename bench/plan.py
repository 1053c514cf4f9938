"""paralab plan against real runs: predict, then run a spread of layouts over the emulated network.

``python bench/plan.py [--model gpt|vgg11] [--workers 4] [--rates 100mbit,1gbit] [--layouts 6] [--steps 10]``
``python bench/plan.py --memory-only [--model vgg11] [--add 'LABEL;...']``: memory only (no network, 2 steps a
run; ``--add``: named layouts beside the spread)
``python bench/plan.py --repredict FILE [FILE ...]``: no runs; each file's measured steps predicted again by
the model as it is now, from that file's own calibration and in-situ collectives, beside what it recorded

For each link rate: the cluster is ``this-machine`` (its calibration,
measured again at the start: the matmul rate, a real unit's rate with the
workers running at once, a unit's fixed cost), its collectives measured
on the emulated link itself (``analysis/plan/collectives.py``: the workers
in their namespaces compute a block, then call an all-reduce, all-gather,
reduce-scatter or all-to-all, for each group size and four sizes, a
latency and a bandwidth fitted to them), so a call costs what it costs
between chunks of compute on shared cores, not what it costs on an idle wire.
``paralab plan``'s model ranks every layout of the gpt on the workers
(recomputation left out: it adds compute only); ``--layouts`` of them, spread
evenly over that ranking and each a different dp x tp x pp / ZeRO / schedule,
are then trained with ``paralab train ... --network RATE`` on synthetic text,
and each one's measured step (the mean of the slowest rank's steps after
``--warmup``: what the run costs a step; a few collectives over an emulated
link take several times the typical one, and the median would leave them
out) is set beside its prediction, and so is its peak memory per
device: the busiest rank's model states (what the rank measured it holds,
``run/held.py``, with the strategy's own ledgers where it keeps any) plus the
peak of its saved activations (``training/saved.py``), against the plan's model states
plus activations, with what paralab's own gpt keeps (``activations=
"paralab"``). Each pipeline run is given the plan's cut (``--partition``).
Per rate: every row's relative error of step time and of memory, their
median and worst absolute error, the Spearman rank correlation of predicted
and measured order, and whether the predicted best is among the two fastest
measured.

Writes ``bench/results/plan.json`` (with the CPU named from ``lscpu``) and
prints a table per rate. Runs take about 10 s each on a 2-core VM; run it under
the shared CPU lock on a busy machine.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from common import RESULTS, SRC, cpu_name, gpt_args, gpt_options, paralab_train, step_seconds, write_result

sys.path.insert(0, str(SRC))

from paralab.analysis.plan import Layout, Setting, cnn_workload, gpt_workload, make_plan, predict  # noqa: E402
from paralab.analysis.plan.calibrate import at_speed, calibration, speed_probe, this_machine  # noqa: E402
from paralab.run.network import parse  # noqa: E402


def spread(ranked: list, count: int) -> list:
    """``count`` predictions evenly spaced over the ranking, each a different layout beyond its microbatches."""
    seen, distinct = set(), []
    for x in ranked:
        lay = x.layout
        key = (lay.dp, lay.tp, lay.pp, lay.zero, lay.sp, lay.schedule, lay.virtual)
        if key not in seen:
            seen.add(key)
            distinct.append(x)
    if len(distinct) <= count:
        return distinct
    step = (len(distinct) - 1) / (count - 1)
    return [distinct[round(i * step)] for i in range(count)]


def added(ranked: list, labels: str, chosen: list) -> list:
    """The predictions of the layouts named in ``labels`` (';'-separated) that ``chosen`` lacks."""
    names = [x.strip() for x in labels.split(";") if x.strip()]
    by_label = {x.layout.label(): x for x in ranked}
    unknown = [n for n in names if n not in by_label]
    if unknown:
        raise ValueError(f"--add: no layout labelled {', '.join(map(repr, unknown))} in the plan; name one as the "
                         f"plan prints it, e.g. {ranked[0].layout.label()!r}")
    have = {x.layout.label() for x in chosen}
    return [by_label[n] for n in dict.fromkeys(names) if n not in have]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def measure_collectives(rate: str, workers: int) -> dict:
    """The collectives' fits on ``workers`` ranks joined to an emulated ``rate`` link (root or user namespaces)."""
    from paralab.analysis.plan.collectives import measure
    from paralab.run import network
    spec = network.parse(rate)
    print(f"bench plan: {rate}: timing the collectives between chunks of compute ...", flush=True)
    with network.Network(spec, workers) as net:
        return measure(workers, spec.gbps, join=network.join, record=net.record(), init_method=net.init_method())


def model_args(args) -> list[str]:
    if args.model == "gpt":
        return [*gpt_args(args), "--dataset", "synthetic-text"]
    return ["--model", args.model, "--width", str(args.width), "--dataset", "synthetic"]


def partition(work, lay) -> list[str]:
    """The plan's cut as ``--partition`` counts (all ``pp x v`` stages), so the run's stages are the ones
    predicted."""
    if lay.pp == 1:
        return []
    return ["--partition", ",".join(str(hi - lo) for lo, hi in work.cut(lay.pp * lay.virtual))]


def measured_memory(summary: dict) -> tuple[float, dict] | None:
    """The busiest rank's model states plus saved-activation peak (``run/held.py``: with the strategy's
    own ledgers where it keeps any), and its parts."""
    best = None
    for rank, det in (summary.get("strategy_details") or {}).items():
        held = det.get("held") if isinstance(det, dict) else None
        if not held:
            continue
        states, activations = held["model_states_total_bytes"], held["saved_activations_peak_bytes"]
        parts = {"rank": int(rank), "model_states": states, "activations": activations,
                 "states_from": "held, with the strategy's ledgers" if "ledger" in held else "held"}
        if best is None or states + activations > best[0]:
            best = (states + activations, parts)
    return best


def cluster_for(cal: dict, workers: int, where: str, gbps: float, points: dict | None):
    """``this-machine`` from ``cal``, its link at ``gbps`` with the collectives measured in situ (``points``)."""
    import dataclasses
    return dataclasses.replace(this_machine(cal, workers, where), intra_gbps=gbps, inter_gbps=gbps,
                               collectives=points or None)


def run_layout(pred, work, args, rate: str | None, out: Path, at_speed_of=None) -> dict:
    """Run one layout; with ``at_speed_of`` ((probe before, probe after, layout) -> (speed factor, predicted
    step at that speed)), also probe the machine's speed just before and after the run and predict the
    layout again at it."""
    words = shlex.split(pred.layout.command(args.workers))[2:]  # drop "paralab train"
    argv = [*words, *partition(work, pred.layout), *model_args(args), "--batch-size", str(args.global_batch),
            "--num-batches", str(args.steps), "--warmup", str(args.warmup), "--eval-batches", "1", "--no-progress",
            "--log-every", str(args.steps), *(["--network", rate] if rate else [])]
    before = speed_probe() if at_speed_of else None
    p = paralab_train(argv, out)
    after = speed_probe() if at_speed_of else None
    row = {"layout": pred.layout.label(), "command": "paralab train " + " ".join(argv),
           "predicted_s": pred.step, "predicted_memory": pred.memory, "predicted": pred.to_dict()}
    if p.returncode != 0:
        return row | {"failed": p.stderr[-1500:]}
    import json
    memory = measured_memory(json.loads((out / "summary.json").read_text()))
    if memory:
        row |= {"measured_memory": memory[0], "measured_memory_parts": memory[1],
                "memory_error": (pred.memory - memory[0]) / memory[0]}
    if rate:
        rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        measured = statistics.fmean(step_seconds(rows, args.warmup))
        row |= {"measured_s": measured, "error": (pred.step - measured) / measured}
        if at_speed_of:
            factor, step = at_speed_of(before, after, pred.layout)
            row |= {"probe_s": [before, after], "speed_factor": factor, "predicted_at_speed_s": step,
                    "error_at_speed": (step - measured) / measured}
    return row


def errors_of(rows: list[dict], key: str) -> dict:
    errors = [abs(r[key]) for r in rows if key in r]
    return {"median": statistics.median(errors) if errors else None, "worst": max(errors) if errors else None}


def step_summary(rows: list[dict], predicted: str = "predicted_s", error: str = "error") -> dict:
    """Over the rows measured: step time's median and worst |error|, Spearman, the predicted best's place
    (``predicted``/``error``: which prediction, e.g. the one at the machine's speed of the moment)."""
    ok = [r for r in rows if "measured_s" in r and predicted in r]
    fastest = sorted(ok, key=lambda r: r["measured_s"])[:2]
    best = min(ok, key=lambda r: r[predicted]) if ok else None
    err = errors_of(ok, error)
    return {"median_abs_error": err["median"], "worst_abs_error": err["worst"],
            "spearman": spearman([r[predicted] for r in ok], [r["measured_s"] for r in ok]) if ok else None,
            "predicted_best_among_two_fastest": best in fastest if best else None}


def repredict(paths: list[str], p2p_us: float | None = None) -> int:
    """Each file's measured steps predicted again by the current model, from the file's calibration and
    in-situ collectives (transfers, which the model no longer takes from them, left out), side by side.
    ``p2p_us``: a pipeline send's or receive's processor time for files calibrated before it was measured."""
    import json

    for path in paths:
        data = json.loads(Path(path).read_text())
        st = data["settings"]
        work = gpt_workload(st["layers"], st["embed"], st["heads"], st["context"], 256, activations="paralab") \
            if st["model"] == "gpt" else cnn_workload(st["model"], st["width"])
        setting = Setting(st["global_batch"], "fp32", "sgd-momentum")
        cal = data["calibration"]
        if "p2p_overhead_s" not in cal:
            print(f"{path}: its calibration predates the send/receive time: "
                  + (f"{p2p_us} us given" if p2p_us is not None else "0 (give one with --p2p-us)"))
            cal = {**cal, "p2p_overhead_s": (p2p_us or 0.0) * 1e-6}
        for rate, v in data["rates"].items():
            pts = {op: by for op, by in ((v.get("collectives") or {}).get("points") or {}).items() if op != "send"}
            cluster = cluster_for(cal, st["workers"], path, parse(rate).gbps, pts)
            rows = []
            for r in v["rows"]:
                if "measured_s" not in r:
                    continue
                lay = Layout(**{k: x for k, x in r["predicted"]["layout"].items() if k != "label"})
                step = predict(work, lay, cluster, setting).step  # the plan's cut: what the run was given
                rows.append({"layout": r["layout"], "predicted_s": step, "measured_s": r["measured_s"],
                             "error": (step - r["measured_s"]) / r["measured_s"], "recorded": r["error"]})
            now, then = step_summary(rows), step_summary([{**r, "error": r["recorded"]} for r in rows])
            print(f"{path} {rate}: median |error| {100 * then['median_abs_error']:.1f} % -> "
                  f"{100 * now['median_abs_error']:.1f} %, worst {100 * then['worst_abs_error']:.1f} % -> "
                  f"{100 * now['worst_abs_error']:.1f} %, Spearman {now['spearman']:.2f}, predicted best among the "
                  f"two fastest: {now['predicted_best_among_two_fastest']}")
            for r in rows:
                print(f"  {r['layout']:<44} {100 * r['recorded']:+6.1f} % -> {100 * r['error']:+6.1f} %")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "vgg11"))
    p.add_argument("--width", type=float, default=0.25, help="the CNN's width")
    p.add_argument("--memory-only", action="store_true",
                   help="compare memory only: no network, 2 steps a run (memory does not depend on the link)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--layouts", type=int, default=6)
    p.add_argument("--add", default="", help="layouts run beside the spread, by their labels as the plan prints "
                   "them, ';'-separated (e.g. 'dp4 m1xb4 zero3 hsdp2x2')")
    gpt_options(p, layers=4, embed=128, heads=4, context=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="default bench/results/plan[-memory][-MODEL].json")
    p.add_argument("--repredict", nargs="+", metavar="FILE", help="run nothing: predict each results file's "
                   "measured steps again with the current model, from its own calibration and collectives")
    p.add_argument("--p2p-us", type=float, help="with --repredict: a send's or receive's processor time (us) for "
                   "files calibrated before it was measured")
    args = p.parse_args(argv)
    if args.repredict:
        return repredict(args.repredict, args.p2p_us)
    if args.memory_only:
        args.steps, args.warmup, args.rates = 2, 1, "none"
    name = "plan" + ("-memory" if args.memory_only else "") + ("" if args.model == "gpt" else f"-{args.model}")
    args.out = args.out or str(RESULTS / f"{name}.json")
    cal, where = calibration("fp32", workers=args.workers, again=True)  # the machine as it is now
    work = gpt_workload(args.layers, args.embed, args.heads, args.context, 256, activations="paralab") \
        if args.model == "gpt" else cnn_workload(args.model, args.width)
    setting = Setting(args.global_batch, "fp32", "sgd-momentum")  # paralab train's default optimizer
    result = {"machine": cpu_name(), "calibration": cal, "calibration_from": where, "settings": vars(args),
              "rates": {}}
    for rate in args.rates.split(","):
        rate = None if rate == "none" else rate
        gbps = parse(rate).gbps if rate else this_machine(cal, args.workers, where).intra_gbps
        situ = None
        if rate:
            situ = measure_collectives(rate, args.workers)
            link = "collectives measured in situ: " + "; ".join(
                f"{op} of {g}: " + ", ".join(f"{b // 1024} kB {t * 1e3:.1f} ms" for b, t in pts)
                for op, by in sorted(situ["points"].items()) for g, pts in sorted(by.items()))
        else:
            link = "loopback (memory only)"
        print(f"bench plan: {rate or 'no network'}: {link}", flush=True)
        points = situ["points"] if situ else None
        cluster = cluster_for(cal, args.workers, where, gbps, points)

        def at_speed_of(before: float, after: float, lay, gbps=gbps, points=points):
            """The machine's speed around a run against the calibration's (the geometric mean of the probes
            before and after it, over the calibration's block time), and the layout's step predicted at it."""
            factor = (before * after) ** 0.5 / cal["block_seconds"]["8"]
            return factor, predict(work, lay, cluster_for(at_speed(cal, factor), args.workers, where, gbps, points),
                                   setting).step
        plan = make_plan(work, cluster, setting, args.workers, fixed={"recompute": "none"}, top=10 ** 6,
                         shortlist=10 ** 6)
        chosen = spread(plan.ranked, args.layouts)
        try:
            chosen += added(plan.ranked, args.add, chosen)
        except ValueError as exc:
            p.error(str(exc))  # exits 2
        rows = []
        with tempfile.TemporaryDirectory(prefix="paralab-bench-plan-") as tmp:
            for i, pred in enumerate(chosen):
                print(f"bench plan: {rate or 'memory'} {pred.layout.label()} ({i + 1}/{len(chosen)}) ...", flush=True)
                rows.append(run_layout(pred, work, args, rate, Path(tmp) / f"run{i}",
                                       at_speed_of if rate else None))
        ok = [r for r in rows if "measured_s" in r]
        mem_err = errors_of(rows, "memory_error")
        summary = {"rows": rows, "link_gbps": gbps, "link_model": link, "collectives": situ, "measured": len(ok),
                   "failed": sum(1 for r in rows if "failed" in r), **step_summary(rows),
                   "at_speed": step_summary(rows, "predicted_at_speed_s", "error_at_speed") if rate else None,
                   "memory_median_abs_error": mem_err["median"], "memory_worst_abs_error": mem_err["worst"]}
        result["rates"][rate or "none"] = summary
        print(f"\n{rate or 'memory'}:")
        print(f"  {'layout':<40}{'predicted':>12}{'measured':>12}{'error':>9}{'pred MB':>10}{'meas MB':>10}{'error':>9}"
              f"{'speed':>7}{'at speed':>10}")
        for r in rows:
            if "failed" in r:
                print(f"  {r['layout']:<40} failed: " + r["failed"].strip().splitlines()[-1][:60])
                continue
            time_cols = (f"{r['predicted_s'] * 1e3:>10.1f}ms{r['measured_s'] * 1e3:>10.1f}ms{100 * r['error']:>8.1f}%"
                         if "measured_s" in r else f"{'':>12}{'':>12}{'':>9}")
            mem_cols = (f"{r['predicted_memory'] / 1e6:>10.2f}{r['measured_memory'] / 1e6:>10.2f}"
                        f"{100 * r['memory_error']:>8.1f}%" if "measured_memory" in r else "")
            speed_cols = (f"{r['speed_factor']:>7.2f}{100 * r['error_at_speed']:>9.1f}%" if "speed_factor" in r
                          else "")
            print(f"  {r['layout']:<40}{time_cols}{mem_cols}{speed_cols}")
        if ok:
            print(f"  step time: median |error| {100 * summary['median_abs_error']:.1f} %, worst "
                  f"{100 * summary['worst_abs_error']:.1f} %, Spearman {summary['spearman']:.2f}, predicted best "
                  f"among the two fastest: {summary['predicted_best_among_two_fastest']}")
            a = summary["at_speed"]
            print(f"  at the machine's speed around each run (speed: its block time over the calibration's): "
                  f"median |error| {100 * a['median_abs_error']:.1f} %, worst {100 * a['worst_abs_error']:.1f} %, "
                  f"Spearman {a['spearman']:.2f}, predicted best among the two fastest: "
                  f"{a['predicted_best_among_two_fastest']}")
        if mem_err["median"] is not None:
            print(f"  memory: median |error| {100 * mem_err['median']:.1f} %, worst {100 * mem_err['worst']:.1f} %")
    path = write_result(args.out, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
