"""Gradient compression study: loss, bytes per step and s/iter of ddp with none / fp16 / PowerSGD r=1,2,4.

``sudo python bench/compress.py [--workers 2] [--rates 100mbit,1gbit] [--width 0.5] [--steps 20]``

Each variant is ``paralab train ddp --compress ...`` with the same seed,
data and hyper-parameters, on an emulated network of each rate
(``--network``). Per run: the training loss at the last step (the mean of
the last 3 steps, so one noisy batch does not decide), the bytes each rank
sent per step (summary.json ``comm_bytes``: what crossed through
``comm.py``, PowerSGD's P and Q included) and s/iter. PowerSGD starts after
``--powersgd-start-iter`` uncompressed steps (error feedback and warm start
on). The loss does not depend on the link (the arithmetic is the same at
every rate); the time does. Writes ``bench/results/compress.json`` and
``bench/results/compress.png``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, cpu_name, train, write_result

VARIANTS = {"none": [], "fp16": ["--compress", "fp16"], "bf16": ["--compress", "bf16"],
            "powersgd-r1": ["--compress", "powersgd", "--powersgd-rank", "1"],
            "powersgd-r2": ["--compress", "powersgd", "--powersgd-rank", "2"],
            "powersgd-r4": ["--compress", "powersgd", "--powersgd-rank", "4"]}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/compress.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg11")
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of s/iter (the uncompressed phase)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--variants", default="none,fp16,powersgd-r1,powersgd-r2,powersgd-r4")
    p.add_argument("--start-iter", type=int, default=2, help="--powersgd-start-iter")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--out", default=str(RESULTS / "compress.json"))
    args = p.parse_args(argv)
    args.cores_per_worker = None
    return args




def plot(rows: list[dict], rates: list[str], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    first = [next(r for r in rows if r["variant"] == n and r["rate"] == rates[0]) for n in names]
    axes[0].bar(names, [r["final_loss"] for r in first])
    axes[0].set_ylabel(f"training loss, mean of the last 3 of {first[0]['steps']} steps")
    axes[1].bar(names, [r["bytes_per_step"] / 1e6 for r in first])
    axes[1].set_ylabel("MB sent per step per rank")
    axes[1].set_yscale("log")
    width = 0.8 / len(rates)
    for k, rate in enumerate(rates):
        xs = [i + k * width for i in range(len(names))]
        axes[2].bar(xs, [next(r for r in rows if r["variant"] == n and r["rate"] == rate)["seconds_per_iter"]
                         for n in names], width, label=rate)
    axes[2].set_xticks([i + width * (len(rates) - 1) / 2 for i in range(len(names))], names)
    axes[2].set_ylabel("s / iteration")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    args = parse(argv)
    from paralab.run import network
    from paralab.errors import UsageError
    try:  # root, or a user namespace where the kernel allows one (as `paralab train --network`)
        network.check_can_emulate(network.parse("1gbit"))
    except UsageError as exc:
        print(f"bench/compress.py runs over --network: {exc}", file=sys.stderr)
        return 2
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(n not in VARIANTS for n in names):
        print(f"variants: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    rows, started, load = [], time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="paralab-bench-compress-") as tmp:
        for rate in rates:
            for name in names:
                print(f"bench compress: {name} at {rate} ...", flush=True)
                options = ["--network", rate, "--lr", str(args.lr), *VARIANTS[name]]
                if name.startswith("powersgd"):
                    options += ["--powersgd-start-iter", str(args.start_iter)]
                try:
                    s, steps = train(name, ["ddp"], args, Path(tmp) / f"{name}-{rate}", options=options)
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    return 1
                losses = {}
                for row in steps:
                    losses.setdefault(row["step"], []).append(row["loss"])
                last = [sum(v) / len(v) for _, v in sorted(losses.items())][-3:]
                rows.append({"variant": name, "rate": rate, "steps": args.steps,
                             "final_loss": sum(last) / len(last), "seconds_per_iter": s["seconds_per_iter"],
                             "bytes_per_step": max(s["comm_bytes"].values()),
                             "comm_exposed_s": max(r["comm"] for r in s["split"].values())})
    base = {r["rate"]: r["bytes_per_step"] for r in rows if r["variant"] == "none"}
    for r in rows:
        r["bytes_vs_none"] = r["bytes_per_step"] / base[r["rate"]] if r["rate"] in base else None
    cpu = cpu_name()
    result = {"benchmark": "compress", "cpu": cpu, "cpu_count": os.cpu_count(), "workers": args.workers,
              "model": args.model, "width": args.width, "batch_size": args.batch_size, "steps": args.steps,
              "warmup": args.warmup, "lr": args.lr, "powersgd_start_iter": args.start_iter,
              "dataset": "synthetic", "load_average_before": load, "load_average_after": os.getloadavg(),
              "wall_s": time.time() - started, "rows": rows}
    out = write_result(args.out, result)
    png = out.with_suffix(".png")
    title = (f"ddp, {args.model} x{args.width}, batch {args.batch_size}, {args.workers} workers, {args.steps} steps, "
             f"PowerSGD after {args.start_iter} steps; {cpu}, {os.cpu_count()} cores")
    plot(rows, rates, png, title)
    print(title)
    print(f"{'variant':>12} {'rate':>8} {'loss':>8} {'MB/step':>9} {'x none':>7} {'s/iter':>8} {'exposed s':>10}")
    for r in rows:
        print(f"{r['variant']:>12} {r['rate']:>8} {r['final_loss']:>8.4f} {r['bytes_per_step'] / 1e6:>9.3f} "
              f"{r['bytes_vs_none'] or 0:>7.3f} {r['seconds_per_iter']:>8.3f} {r['comm_exposed_s']:>10.3f}")
    print(f"written to {out}" + (f" and {png}" if png.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
