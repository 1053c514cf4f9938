"""CS744's table on an emulated cluster: single, gather-scatter, allreduce, ddp, torch-ddp over 1 Gbit links.

``sudo python bench/cs744.py [--workers 4] [--network 1gbit] [--width 0.5] [--batch-size 128] [--steps 4]``

CS744 (UW-Madison) Assignment 2 trains VGG-11 on CIFAR-10 on 4 CPU nodes; a
group's report measured s/iter single 1.855, gather-scatter 1.304,
all-reduce 0.932, DDP 0.664. Here the 4 workers are local processes, each
in its own network namespace on a full-duplex link of ``--network``
(``paralab train --network``), so the gradients cross a real, shaped link
as they did between CS744's nodes. ``single`` runs one process with no
link. Per strategy: s/iter (the slowest rank's step, mean after warm-up),
speed-up over single, and communication as summary.json splits it:
exposed (a rank blocked in a collective), in flight (asynchronous, possibly
hidden under backward), and bytes per step per rank.

What cannot be reproduced on one small machine: CS744's workers each had
a node's cores, so data parallelism divided the compute by 4; here the 4
workers share this machine's cores, so their compute adds up to about
single's and any speed-up over single is bounded by the cores there are.
The communication part of the table (gather-scatter > allreduce > ddp,
and how much of it ddp hides) is what the network emulation shows.
Writes ``bench/results/cs744.json`` and ``bench/results/cs744.png``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, train, write_result

STRATEGIES = ("single", "gather-scatter", "allreduce", "ddp", "torch-ddp")
CS744 = {"single": 1.855, "gather-scatter": 1.304, "allreduce": 0.932, "ddp": 0.664}


def parse(argv):
    import argparse
    p = argparse.ArgumentParser(prog="bench/cs744.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg11")
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--network", default="1gbit")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "cs744.json"))
    args = p.parse_args(argv)
    args.cores_per_worker = None  # 4 workers share the cores (there may be fewer than 4)
    return args


def run_one(strategy: str, args, workdir: Path, tag: str) -> dict:
    workers = 1 if strategy == "single" else args.workers
    out = workdir / f"{strategy}-{tag}"
    options = ["--bucket-mb", str(args.bucket_mb)] if strategy in ("ddp", "torch-ddp") else []
    if workers > 1:
        options += ["--network", args.network]
    s, _ = train(strategy, [strategy], args, out, workers=workers, options=options)
    ranks = list(s["split"].values())
    return {"strategy": strategy, "workers": workers, "seconds_per_iter": s["seconds_per_iter"],
            "samples_per_s": s["samples_per_s"],
            "compute_s": sum(r["compute"] for r in ranks) / len(ranks),
            "comm_exposed_s": sum(r["comm"] for r in ranks) / len(ranks),
            "comm_in_flight_s": sum(r.get("comm_async", 0.0) for r in ranks) / len(ranks),
            "comm_bytes_per_step": max(s["comm_bytes"].values()) if s.get("comm_bytes") else 0,
            "parameters": s["parameters"], "global_batch": s["global_batch"]}




def plot(best: dict, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(best)
    other = [max(0.0, best[n]["seconds_per_iter"] - best[n]["comm_exposed_s"]) for n in names]
    exposed = [best[n]["comm_exposed_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, other, label="compute and the rest")
    ax.bar(names, exposed, bottom=other, label="exposed communication")
    for i, n in enumerate(names):
        if n in CS744:
            ax.plot([i - 0.4, i + 0.4], [CS744[n]] * 2, "k--", lw=1)
    ax.plot([], [], "k--", lw=1, label="CS744 group report, 4 CPU nodes")
    ax.set_ylabel("s / iteration")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    args = parse(argv)
    from paralab.run import network
    from paralab.errors import UsageError
    try:  # root, or a user namespace where the kernel allows one (as `paralab train --network`)
        network.check_can_emulate(network.parse("1gbit"))
    except UsageError as exc:
        print(f"bench/cs744.py runs over --network: {exc}", file=sys.stderr)
        return 2
    measured = best_of("cs744", list(STRATEGIES), args.repeats,
                       lambda name, workdir, tag: run_one(name, args, workdir, tag))
    if measured is None:
        return 1
    runs, best_by_throughput, machine = measured
    best = {n: min(r, key=lambda x: x["seconds_per_iter"]) for n, r in runs.items()}
    single = best["single"]["seconds_per_iter"]
    for row in best.values():
        row["speedup_over_single"] = single / row["seconds_per_iter"]
    cpu = cpu_name()
    result = {"benchmark": "cs744", "cpu": cpu, "cpu_count": os.cpu_count(), "network": args.network,
              "workers": args.workers, "model": args.model, "width": args.width, "batch_size": args.batch_size,
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "machine": machine,
              "cs744_seconds_per_iter": CS744, "best": best, "runs": runs}
    out = write_result(args.out, result)
    png = out.with_suffix(".png")
    title = (f"{args.model} x{args.width}, batch {args.batch_size}, {args.workers} workers on {args.network} links; "
             f"{cpu}, {os.cpu_count()} cores")
    plot(best, png, title)
    print(title)
    print(f"{'strategy':>15} {'s/iter':>8} {'speed-up':>9} {'exposed comm s':>15} {'in flight s':>12} "
          f"{'MB/step':>8} {'CS744 s/iter':>13}")
    for n, r in best.items():
        print(f"{n:>15} {r['seconds_per_iter']:>8.3f} {r['speedup_over_single']:>9.2f} {r['comm_exposed_s']:>15.3f} "
              f"{r['comm_in_flight_s']:>12.3f} {r['comm_bytes_per_step'] / 1e6:>8.2f} "
              f"{CS744.get(n, float('nan')):>13.3f}")
    print(f"written to {out}" + (f" and {png}" if png.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
