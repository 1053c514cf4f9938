"""Tensor-parallel benchmark: single vs tp 2, torch-tp 2 and tp 2 --sequence-parallel on the gpt, side by side.

``flock /tmp/paralab-cpu.lock python bench/tp.py [--layers 4 --embed 256 --heads 8 --context 128]
[--batch-size 16] [--steps 5] [--repeats 3]``

Every variant trains the same gpt (``--model gpt``, byte tokens of
``synthetic-text``) on the same global batch through the ordinary command
line (``paralab train``): ``single`` on 1 worker, the others on 2 workers,
each worker pinned to its own core (``--cores-per-worker 1``). The default
shape (4 blocks, width 256, 8 heads, 128 tokens, batch 16: about 2,000
tokens and 40 GFLOP per step) is where compute, not Python overhead,
dominates a step on a 2-core CPU. Throughput is samples/s over the steps
after warm-up (summary.json: global samples / the slowest rank's step
time); the variants run R times, interleaved, and each one's best run counts
(``common.best_of``). Ratios reported:

- tp2 / torch-tp2 throughput (target >= 1.0): our Megatron layout from
  primitives against PyTorch's DTensor ``parallelize_module`` of the same layout;
- tp2 / single: the speed-up of tensor parallelism at T = 2 (2 cores against 1);
- tp2-sp / tp2: what sequence parallelism costs or saves here.

torch-tp's collectives are DTensor's own, not ``comm`` spans (its exposed
communication shows as 0 and is inside its compute time). Hold the CPU lock
for the whole run: the ratios are only meaningful when nothing else runs.
Writes ``bench/results/tp.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_options, selected, step_seconds, train_gpt, write_result

VARIANTS = {  # name -> (strategy, workers, extra options)
    "single": ("single", 1, []),
    "tp2": ("tp", 2, []),
    "torch-tp2": ("torch-tp", 2, []),
    "tp2-sp": ("tp", 2, ["--sequence-parallel"]),
}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/tp.py", description=__doc__.splitlines()[0])
    gpt_options(p, layers=4, embed=256, heads=8, context=128)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, the same for every variant")
    p.add_argument("--steps", type=int, default=5, help="training steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the average")
    p.add_argument("--cores-per-worker", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="run every variant R times, interleaved; keep the best")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(RESULTS / "tp.json"))
    return p.parse_args(argv)




def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    strategy, workers, extra = VARIANTS[name]
    out = workdir / f"{name}-{tag}"
    cores = ["--cores-per-worker", str(args.cores_per_worker)] if args.cores_per_worker else []
    s, rows, _ = train_gpt(name, [strategy, "--workers", str(workers), *cores, *extra], args, out)
    ranks = list(s["split"].values())
    return {
        "variant": name, "strategy": strategy, "workers": workers, "options": extra,
        "samples_per_s": s["samples_per_s"],
        "samples_per_s_best_step": s["global_batch"] / min(step_seconds(rows, args.warmup)),
        "tokens_per_s": s["samples_per_s"] * args.context,
        "seconds_per_iter": s["seconds_per_iter"],
        "compute_s": max(r["compute"] for r in ranks),
        "comm_exposed_s": max(r["comm"] for r in ranks),
        "comm_bytes_per_step": max(s["comm_bytes"].values()) if s["comm_bytes"] else 0,
        "load_average": os.getloadavg()[0],
        "parameters": s["parameters"], "global_batch": s["global_batch"], "run": str(out),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    names = selected(args.variants, tuple(VARIANTS), "variants")
    if names is None:
        return 2
    measured = best_of("tp", names, args.repeats, lambda name, workdir, tag: run_one(name, args, workdir, tag))
    if measured is None:
        return 1
    runs, best, machine = measured

    def ratios_of(key):
        pairs = {"tp2_over_torch_tp2": ("tp2", "torch-tp2"), "tp2_over_single": ("tp2", "single"),
                 "torch_tp2_over_single": ("torch-tp2", "single"), "tp2_sp_over_tp2": ("tp2-sp", "tp2")}
        return {k: best[a][key] / best[b][key] for k, (a, b) in pairs.items() if a in best and b in best}

    ratios, ratios_best_step = ratios_of("samples_per_s"), ratios_of("samples_per_s_best_step")
    shape = {"layers": args.layers, "embed": args.embed, "heads": args.heads, "context": args.context}
    result = {"benchmark": "tp", "model": "gpt", "shape": shape, "global_batch": args.batch_size,
              "steps": args.steps, "warmup": args.warmup, "cores_per_worker": args.cores_per_worker,
              "repeats": args.repeats, "cpu": cpu_name(), **machine,
              "best": best, "all_runs": runs, "ratios": ratios, "ratios_best_step": ratios_best_step,
              "targets": {"tp2_over_torch_tp2": 1.0}}
    out = write_result(args.out, result)

    print(f"\ngpt {shape}, global batch {args.batch_size}, {args.cores_per_worker} core per worker; best of "
          f"{args.repeats}; {result['cpu']}; load average before {machine['load_average_before'][0]:.1f}")
    print(f"{'variant':<11}{'workers':>8}{'samples/s':>10}{'tokens/s':>10}{'s/iter':>8}{'compute s':>10}"
          f"{'comm exp s':>11}{'MB/step':>9}{'best-step':>10}")
    for n in names:
        b = best[n]
        print(f"{n:<11}{b['workers']:>8}{b['samples_per_s']:>10.2f}{b['tokens_per_s']:>10.0f}"
              f"{b['seconds_per_iter']:>8.3f}{b['compute_s']:>10.3f}{b['comm_exposed_s']:>11.3f}"
              f"{b['comm_bytes_per_step'] / 2**20:>9.1f}{b['samples_per_s_best_step']:>10.2f}")
    for key, value in ratios.items():
        target = result["targets"].get(key)
        verdict = f"  (target >= {target}: {'met' if value >= target else 'NOT met'})" if target else ""
        print(f"{key} = {value:.3f}, on the best steps {ratios_best_step[key]:.3f}{verdict}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
