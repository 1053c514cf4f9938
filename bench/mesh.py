"""Data x pipeline benchmark: ddp dp 2 x 1f1b pp 2 beside pure ddp and pure pipelines, side by side.

``python bench/mesh.py [--width 0.5] [--batch-size 64] [--microbatches 4] [--steps 5] [--repeats 1]``

Every layout trains VGG-11 on the same global batch through the ordinary
command line:

- ``ddp-dp2``: ``paralab train ddp --workers 2`` (pure data parallelism);
- ``pipeline-pp2``: ``paralab train pipeline --workers 2 --schedule 1f1b``;
- ``ddp-dp2xpp2``: ``paralab train ddp --workers 4 --pp 2 --schedule 1f1b`` (each stage's two replicas
  all-reduce its gradients);
- ``ddp-dp4`` and ``pipeline-pp4``: the two pure forms at 4 workers.

Throughput is samples/s over the steps after warm-up (summary.json). Ratios
reported: dp 2 x pp 2 over pp 2 (what adding data-parallel replicas to a
pipeline buys) and over dp 4 and pp 4 (the same 4 workers laid out three
ways). On a machine with fewer cores than 4 workers, the 4-worker layouts
share cores (``--cores-per-worker`` is then left unset): their ratio to the
2-worker layouts measures that sharing as much as the layout, while the
three 4-worker layouts stay comparable with one another. Writes
``bench/results/mesh.json``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from common import best_of, parse_runs, selected, train, training_options, write_result

LAYOUTS = {  # name: (workers, paralab train arguments)
    "ddp-dp2": (2, ["ddp"]),
    "pipeline-pp2": (2, ["pipeline", "--schedule", "1f1b"]),
    "ddp-dp2xpp2": (4, ["ddp", "--pp", "2", "--schedule", "1f1b"]),
    "ddp-dp4": (4, ["ddp"]),
    "pipeline-pp4": (4, ["pipeline", "--schedule", "1f1b"]),
}


def parse(argv):
    p = training_options("bench/mesh.py", __doc__, each="layout", warmup_help="steps left out of the average")
    p.set_defaults(width=0.5, batch_size=64, workers=None, cores_per_worker=None)
    p.add_argument("--microbatches", type=int, default=4, help="microbatches of the pipelined layouts")
    return parse_runs(p, argv, "mesh", repeats=1, repeats_help="run every layout R times, keep the best",
                      select="--layouts", choices=tuple(LAYOUTS))


def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    workers, strategy = LAYOUTS[name]
    pipelined = "--schedule" in strategy
    options = ["--microbatches", str(args.microbatches)] if pipelined else []
    out = workdir / f"{name}-{tag}"
    s, _ = train(name, strategy, args, out, workers=workers, options=options)
    ranks = list(s["split"].values())
    return {"layout": name, "workers": workers, "command": " ".join(["paralab", "train", *strategy, *options]),
            "samples_per_s": s["samples_per_s"], "seconds_per_iter": s["seconds_per_iter"],
            "compute_s": max(r["compute"] for r in ranks), "idle_s": max(r["idle"] for r in ranks),
            "comm_exposed_s": max(r["comm"] for r in ranks),
            "comm_bytes_per_step": max(s["comm_bytes"].values()) if s["comm_bytes"] else 0,
            "load_average": os.getloadavg()[0], "run": str(out)}


def main(argv: list[str]) -> int:
    args = parse(argv)
    names = selected(args.layouts, tuple(LAYOUTS), "layouts")
    if names is None:
        return 2
    measured = best_of("mesh", names, args.repeats, lambda name, workdir, tag: run_one(name, args, workdir, tag))
    if measured is None:
        return 1
    runs, best, machine = measured
    load_before = machine["load_average_before"]
    ratios = {}
    for other in ("pipeline-pp2", "ddp-dp4", "pipeline-pp4", "ddp-dp2"):
        if "ddp-dp2xpp2" in best and other in best:
            ratios[f"dp2xpp2_over_{other.split('-', 1)[1]}"] = (best["ddp-dp2xpp2"]["samples_per_s"]
                                                              / best[other]["samples_per_s"])
    result = {"benchmark": "mesh", "model": args.model, "width": args.width, "global_batch": args.batch_size,
              "microbatches": args.microbatches, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats, **machine,
              "best": best, "all_runs": runs, "ratios": ratios}
    out = write_result(args.out, result)

    print(f"\n{args.model} width {args.width}, global batch {args.batch_size}, {args.microbatches} microbatches "
          f"where pipelined; best of {args.repeats}; {os.cpu_count()} cores; load average before "
          f"{load_before[0]:.1f}")
    print(f"{'layout':<14}{'workers':>8}{'samples/s':>10}{'s/iter':>8}{'compute s':>10}{'idle s':>8}"
          f"{'comm exp s':>11}")
    for n in names:
        b = best[n]
        print(f"{n:<14}{b['workers']:>8}{b['samples_per_s']:>10.1f}{b['seconds_per_iter']:>8.3f}"
              f"{b['compute_s']:>10.3f}{b['idle_s']:>8.3f}{b['comm_exposed_s']:>11.3f}")
    for key, value in ratios.items():
        print(f"{key} = {value:.3f}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
