"""Sharded data parallelism composed on 4 workers: fsdp against HSDP, and fsdp x tp against torch-fsdp x tp.

Variants (the gpt, 4 workers, the same model, batch and data):

- ``fsdp3`` / ``hsdp3``: ``fsdp --zero-stage 3``, alone (sharded over 4) and ``--replicate 2`` (2 replica
  groups sharding over 2); ``fsdp2`` / ``hsdp2`` the same at ZeRO-2; ``ddp`` for reference;
- ``fsdp3-tp2``: ``fsdp --zero-stage 3 --tp 2`` (dp 2 x tp 2: our fsdp on our tp slices);
  ``torch-fsdp-tp2``: PyTorch's FSDP2 on its DTensor tp, the same layout; ``ddp-tp2`` for reference.

Each variant runs ``--repeats`` times, interleaved (``common.best_of``); the best run's samples/s is shown
with the ratio to ``fsdp3``. Beside it: the bytes each collective was handed per step (``comm_ops``; a ring
moves (k - 1)/k of them over a group of k), and rank 0's ledger peak beside the memory model's prediction
(exact byte counts, not timings). The figures are in docs/hsdp.md with the machine.

  flock /tmp/paralab-cpu.lock .venv/bin/python bench/hsdp.py [--repeats 2] [--variants fsdp3,hsdp3]

Writes bench/results/hsdp.json (the CPU named from ``lscpu``) and prints a table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_options, train_gpt, write_result

VARIANTS = {
    "fsdp3": ["fsdp", "--zero-stage", "3"],
    "hsdp3": ["fsdp", "--zero-stage", "3", "--replicate", "2"],
    "fsdp2": ["fsdp", "--zero-stage", "2"],
    "hsdp2": ["fsdp", "--zero-stage", "2", "--replicate", "2"],
    "ddp": ["ddp"],
    "fsdp3-tp2": ["fsdp", "--zero-stage", "3", "--tp", "2"],
    "torch-fsdp-tp2": ["torch-fsdp", "--tp", "2"],
    "ddp-tp2": ["ddp", "--tp", "2"],
}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/hsdp.py", description=__doc__.splitlines()[0])
    gpt_options(p, layers=4, embed=128, heads=4, context=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--out", default=str(RESULTS / "hsdp.json"))
    args = p.parse_args(argv)
    args.names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.names if v not in VARIANTS]
    if unknown or not args.names:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    return args


def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    out = workdir / f"{name}-{tag}"
    s, _, argv = train_gpt(name, [*VARIANTS[name], "--workers", "4"], args, out)
    memory = s["strategy_details"]["0"].get("memory", {})
    measured = s["strategy_details"]["0"].get("held", {}).get("ledger", {})  # the one place a run measures memory
    return {"variant": name, "command": "paralab train " + " ".join(argv),
            "samples_per_s": s["samples_per_s"], "seconds_per_iter_median": s["seconds_per_iter_median"],
            "comm_ops": {op: {"bytes_per_step": e["bytes_per_step"], "calls": e["calls"]}
                         for op, e in s["comm_ops"].items()},
            "resident_peak_bytes": measured.get("resident_peak_bytes"),
            "predicted_peak_bytes": memory.get("predicted", {}).get("bytes", {}).get("peak"),
            "sharded_over": memory.get("model", {}).get("workers")}


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    got = best_of("hsdp", args.names, args.repeats, lambda n, d, t: run_one(n, args, d, t))
    if got is None:
        return 1
    runs, best, machine = got
    base = best[args.names[0]]["samples_per_s"]
    print(f"payload per step (bytes handed to each collective); ratio to {args.names[0]}")
    print(f"{'variant':<16}{'samples/s':>10}{'ratio':>7}{'all_gather':>12}{'reduce_scat':>12}{'all_reduce':>12}"
          f"{'peak B':>11}{'predicted':>11}")
    for name, r in best.items():
        r["ratio"] = r["samples_per_s"] / base
        ops = {op: e["bytes_per_step"] for op, e in r["comm_ops"].items()}
        print(f"{name:<16}{r['samples_per_s']:>10.1f}{r['ratio']:>7.2f}{ops.get('all_gather', 0):>12,.0f}"
              f"{ops.get('reduce_scatter', 0):>12,.0f}{ops.get('all_reduce', 0):>12,.0f}"
              f"{r['resident_peak_bytes'] or 0:>11,.0f}{r['predicted_peak_bytes'] or 0:>11,.0f}")
    path = write_result(args.out, {"cpu": cpu_name(), "machine": machine, "args": vars(args), "best": best,
                                   "runs": runs})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
