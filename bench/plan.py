"""paralab plan against real runs: predict, then run a spread of gpt layouts over the emulated network.

``python bench/plan.py [--workers 4] [--rates 100mbit,1gbit] [--layouts 6] [--steps 6]``

For each link rate: the cluster is ``this-machine`` (its calibration: the
matmul rate, a real unit's rate with the workers running at once, a unit's
fixed cost; cached), its link the emulated one: bandwidth and per-step
latency fitted to ``bench/network.py``'s all-reduce times on the same links
(``--link-from``; without it, the rate and the loopback latency). Small
collectives between 4 processes on 2 cores cost milliseconds there, where
loopback in one namespace takes a tenth of that.
``paralab plan``'s model ranks every layout of the gpt on the workers
(recomputation left out: paralab cannot run it); ``--layouts`` of them, spread
evenly over that ranking and each a different dp x tp x pp / ZeRO / schedule,
are then trained with ``paralab train ... --network RATE`` on synthetic text,
and each one's measured step (the median of the slowest rank's steps after
``--warmup``) is set beside its prediction. Per rate: every row's relative
error, the median and worst absolute error, the Spearman rank correlation of
predicted and measured order, and whether the predicted best is among the two
fastest measured. Memory is not compared: on a CPU paralab records no
allocator peak (docs/architecture.md, "Timing").

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

from common import RESULTS, SRC, cpu_name, paralab_train, step_seconds, write_result

sys.path.insert(0, str(SRC))

from paralab.analysis.plan import Setting, gpt_workload, make_plan  # noqa: E402
from paralab.analysis.plan.calibrate import calibration, this_machine  # noqa: E402
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


def emulated_link(path: Path, rate: str, workers: int) -> tuple[float, float] | None:
    """(Gb/s, latency s per ring step) of the emulated link at ``rate``, fitted by least squares to
    ``T = 2(N-1)/N x S / B + 2(N-1) a`` over bench/network.py's all-reduce times on the same links and
    workers (None where that file has none)."""
    import json
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("workers") != workers:
        return None
    pts = [(r["bytes"], r["best_s"]) for r in data["rows"] if r["op"] == "all_reduce" and r["rate"] == rate]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    intercept = max(my - slope * mx, 0.0)
    return 2 * (workers - 1) / workers * 8 / slope / 1e9, intercept / (2 * (workers - 1))


def run_layout(pred, args, rate: str, out: Path) -> dict:
    words = shlex.split(pred.layout.command(args.workers))[2:]  # drop "paralab train"
    argv = [*words, "--model", "gpt", "--layers", str(args.layers), "--embed", str(args.embed), "--heads",
            str(args.heads), "--context", str(args.context), "--batch-size", str(args.global_batch),
            "--num-batches", str(args.steps), "--warmup", str(args.warmup), "--dataset", "synthetic-text",
            "--network", rate, "--eval-batches", "1", "--no-progress", "--log-every", str(args.steps)]
    p = paralab_train(argv, out)
    row = {"layout": pred.layout.label(), "command": "paralab train " + " ".join(argv),
           "predicted_s": pred.step, "predicted": pred.to_dict()}
    if p.returncode != 0:
        return row | {"failed": p.stderr[-1500:]}
    import json
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    measured = statistics.median(step_seconds(rows, args.warmup))
    return row | {"measured_s": measured, "error": (pred.step - measured) / measured}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--layouts", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "plan.json"))
    p.add_argument("--link-from", default=str(RESULTS / "network.json"),
                   help="bench/network.py's result on the same links: the link's bandwidth and per-step latency "
                        "fitted to its all-reduce times ('' to use the rate and the loopback latency)")
    args = p.parse_args(argv)
    cal, where = calibration("fp32", workers=args.workers)
    work = gpt_workload(args.layers, args.embed, args.heads, args.context, 256)
    setting = Setting(args.global_batch, "fp32", "sgd-momentum")  # paralab train's default optimizer
    result = {"machine": cpu_name(), "calibration": cal, "calibration_from": where, "settings": vars(args),
              "rates": {}}
    for rate in args.rates.split(","):
        gbps = parse(rate).gbps
        base = this_machine(cal, args.workers, where)
        import dataclasses
        fitted = emulated_link(Path(args.link_from), rate, args.workers) if args.link_from else None
        if fitted:
            link_gbps, latency = fitted
            link = f"fitted to {args.link_from}: {link_gbps:.3g} Gb/s, {latency * 1e6:.0f} us a ring step"
        else:
            link_gbps, latency = gbps, base.intra_latency_us * 1e-6
            link = f"the rate, and this-machine's loopback latency {latency * 1e6:.0f} us"
        print(f"bench plan: {rate}: link {link}", flush=True)
        cluster = dataclasses.replace(base, intra_gbps=link_gbps, inter_gbps=link_gbps,
                                      intra_latency_us=latency * 1e6, inter_latency_us=latency * 1e6)
        plan = make_plan(work, cluster, setting, args.workers, fixed={"recompute": "none"}, top=10 ** 6,
                         shortlist=10 ** 6)
        chosen = spread(plan.ranked, args.layouts)
        rows = []
        with tempfile.TemporaryDirectory(prefix="paralab-bench-plan-") as tmp:
            for i, pred in enumerate(chosen):
                print(f"bench plan: {rate} {pred.layout.label()} ({i + 1}/{len(chosen)}) ...", flush=True)
                rows.append(run_layout(pred, args, rate, Path(tmp) / f"run{i}"))
        ok = [r for r in rows if "measured_s" in r]
        errors = [abs(r["error"]) for r in ok]
        fastest = sorted(ok, key=lambda r: r["measured_s"])[:2]
        best = min(ok, key=lambda r: r["predicted_s"]) if ok else None
        summary = {"rows": rows, "link_gbps": gbps, "link_model": link, "measured": len(ok), "failed": len(rows) - len(ok),
                   "median_abs_error": statistics.median(errors) if errors else None,
                   "worst_abs_error": max(errors) if errors else None,
                   "spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]),
                   "predicted_best_among_two_fastest": best in fastest if best else None}
        result["rates"][rate] = summary
        print(f"\n{rate} ({gbps:g} Gb/s):")
        print(f"  {'layout':<40}{'predicted':>12}{'measured':>12}{'error':>9}")
        for r in rows:
            if "measured_s" in r:
                print(f"  {r['layout']:<40}{r['predicted_s'] * 1e3:>10.1f}ms{r['measured_s'] * 1e3:>10.1f}ms"
                      f"{100 * r['error']:>8.1f}%")
            else:
                print(f"  {r['layout']:<40}{r['predicted_s'] * 1e3:>10.1f}ms      failed: "
                      + r["failed"].strip().splitlines()[-1][:60])
        if errors:
            print(f"  median |error| {100 * summary['median_abs_error']:.1f} %, worst {100 * summary['worst_abs_error']:.1f} %,"
                  f" Spearman {summary['spearman']:.2f}, predicted best among the two fastest: "
                  f"{summary['predicted_best_among_two_fastest']}")
    path = write_result(args.out, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
