"""Context-parallel benchmark: single vs cp 2 (ring balanced, ring contiguous, all-to-all) on the gpt, side by side.

``flock /tmp/paralab-cpu.lock python bench/context.py [--layers 2 --embed 128 --heads 4 --context 512]
[--batch-size 8] [--steps 5] [--repeats 3]``

Every variant trains the same gpt on the same global batch through
``paralab train``: ``single`` on 1 worker, the cp variants on 2 (``paralab
train cp``), each worker pinned to its own core. A long context (512 tokens)
makes attention a large share of the step, which is where the layout
matters. Besides throughput it reads each rank's attention compute time
(the ``attention`` and ``attention_backward`` compute spans, mean per step
after warm-up): balanced, both ranks do the same causal work; contiguous,
rank 1 does about C = 2 times rank 0's and rank 0 waits for it.
torch-cp cannot run on CPU (strategies/torch_cp.py says why), so it is not
among the variants. Writes ``bench/results/context.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_options, selected, step_seconds, train_gpt, write_result

VARIANTS = {  # name -> (strategy, workers, extra options)
    "single": ("single", 1, []),
    "cp2-ring": ("cp", 2, []),
    "cp2-ring-contiguous": ("cp", 2, ["--no-cp-balance"]),
    "cp2-a2a": ("cp", 2, ["--cp-method", "all-to-all"]),
}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/context.py", description=__doc__.splitlines()[0])
    gpt_options(p, layers=2, embed=128, heads=4, context=512)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, the same for every variant")
    p.add_argument("--steps", type=int, default=5, help="training steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the average")
    p.add_argument("--cores-per-worker", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="run every variant R times, interleaved; keep the best")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(RESULTS / "context.json"))
    return p.parse_args(argv)


def attention_seconds(out: Path, warmup: int) -> dict[int, float]:
    """Per rank: attention compute seconds (forward + backward) per step after warm-up."""
    spans = [json.loads(line) for line in (out / "spans.jsonl").read_text().splitlines()]
    steps = sorted({sp["step"] for sp in spans if sp["step"] >= warmup})
    per_rank: dict[int, float] = {}
    for sp in spans:
        if sp["category"] == "compute" and sp["name"] in ("attention", "attention_backward") and sp["step"] in steps:
            per_rank[sp["rank"]] = per_rank.get(sp["rank"], 0.0) + (sp["t1"] - sp["t0"]) / len(steps)
    return per_rank


def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    strategy, workers, extra = VARIANTS[name]
    out = workdir / f"{name}-{tag}"
    cores = ["--cores-per-worker", str(args.cores_per_worker)] if args.cores_per_worker else []
    s, rows, _ = train_gpt(name, [strategy, "--workers", str(workers), *cores, *extra], args, out)
    ranks = list(s["split"].values())
    attention = attention_seconds(out, args.warmup)
    return {
        "variant": name, "strategy": strategy, "workers": workers, "options": extra,
        "samples_per_s": s["samples_per_s"],
        "samples_per_s_best_step": s["global_batch"] / min(step_seconds(rows, args.warmup)),
        "tokens_per_s": s["samples_per_s"] * args.context,
        "seconds_per_iter": s["seconds_per_iter"],
        "compute_s": max(r["compute"] for r in ranks),
        "comm_exposed_s": max(r["comm"] for r in ranks),
        "comm_bytes_per_step": max(s["comm_bytes"].values()) if s["comm_bytes"] else 0,
        "attention_s_per_rank": {str(k): v for k, v in sorted(attention.items())},
        "attention_max_over_min": (max(attention.values()) / min(attention.values())) if attention else None,
        "load_average": os.getloadavg()[0], "run": str(out),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    names = selected(args.variants, tuple(VARIANTS), "variants")
    if names is None:
        return 2
    measured = best_of("context", names, args.repeats, lambda name, workdir, tag: run_one(name, args, workdir, tag))
    if measured is None:
        return 1
    runs, best, machine = measured
    pairs = {"cp2_ring_over_single": ("cp2-ring", "single"), "cp2_a2a_over_single": ("cp2-a2a", "single"),
             "cp2_ring_balanced_over_contiguous": ("cp2-ring", "cp2-ring-contiguous"),
             "cp2_a2a_over_ring": ("cp2-a2a", "cp2-ring")}
    ratios = {k: best[a]["samples_per_s"] / best[b]["samples_per_s"] for k, (a, b) in pairs.items()
              if a in best and b in best}
    shape = {"layers": args.layers, "embed": args.embed, "heads": args.heads, "context": args.context}
    result = {"benchmark": "context", "model": "gpt", "shape": shape, "global_batch": args.batch_size,
              "steps": args.steps, "warmup": args.warmup, "cores_per_worker": args.cores_per_worker,
              "repeats": args.repeats, "cpu": cpu_name(), **machine, "best": best, "all_runs": runs, "ratios": ratios}
    out = write_result(args.out, result)
    print(f"\ngpt {shape}, global batch {args.batch_size}, {args.cores_per_worker} core per worker; best of "
          f"{args.repeats}; {result.get('cpu')}")
    print(f"{'variant':<21}{'workers':>8}{'samples/s':>10}{'s/iter':>8}{'comm exp s':>11}{'MB/step':>9}"
          f"  attention s per rank (max/min)")
    for n in names:
        b = best[n]
        att = ", ".join(f"{v:.3f}" for v in b["attention_s_per_rank"].values())
        ratio = f" ({b['attention_max_over_min']:.2f})" if b["attention_max_over_min"] else ""
        print(f"{n:<21}{b['workers']:>8}{b['samples_per_s']:>10.2f}{b['seconds_per_iter']:>8.3f}"
              f"{b['comm_exposed_s']:>11.3f}{b['comm_bytes_per_step'] / 2**20:>9.2f}  {att}{ratio}")
    for key, value in ratios.items():
        print(f"{key} = {value:.3f}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
