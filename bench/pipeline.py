"""Pipeline benchmark: ``model`` vs ``pipeline`` (GPipe, 1F1B) for M in {1, 2, 4, 8}.

Runs ``paralab train`` for each configuration on the same workers, model,
batch and partition, then reads each run's summary.json. The balanced cut is
measured once here (forward+backward of each unit on a batch of
batch-size / 4, median of 5) and passed to every run as explicit counts, so
timing noise cannot give different runs different cuts:

- samples/s (global batch / slowest rank's step time, warm-up left out), and
  the speed-up over naive ``model`` parallelism;
- the measured bubble of each rank (idle / step time, from the spans) next to
  the theory (W - 1) / (M + W - 1) and to the bubble simulated from the same
  action lists with the run's own measured per-stage forward and backward
  times (which accounts for unequal stages, not for communication or noise);
- the peak number of microbatches alive per stage (1F1B <= W - rank, GPipe M).

  python bench/pipeline.py [--workers 2] [--width 0.5] [--batch-size 64] [--num-batches 8]

Writes bench/results/pipeline.json and prints a table. Timings on a shared
machine are noisy: the JSON records the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, SRC, paralab_train, write_result

sys.path.insert(0, str(SRC))

from paralab.models import build_model  # noqa: E402
from paralab.strategies.pipeline.partition import measure_unit_times, partition_model, sample_batch  # noqa: E402
from paralab.strategies.pipeline.schedules import build_schedule  # noqa: E402
from paralab.strategies.pipeline.simulate import simulate, simulated_bubble  # noqa: E402


def configurations(microbatches: list[int]) -> list[tuple[str, list[str]]]:
    runs = [("model", ["model"])]
    for schedule in ("gpipe", "1f1b"):
        for m in microbatches:
            runs.append((f"{schedule} M={m}", ["pipeline", "--schedule", schedule, "--microbatches", str(m)]))
    return runs


def stage_times(run_dir: Path, workers: int, warmup: int) -> tuple[list[float], list[float]]:
    """Mean seconds of one microbatch's forward and backward on each stage (steps after warm-up)."""
    fwd = [[] for _ in range(workers)]
    bwd = [[] for _ in range(workers)]
    steps = set()
    rows = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    for s in rows:
        if s["step"] >= 0:
            steps.add(s["step"])
    first = min(steps) + warmup if steps else 0
    for s in rows:
        if s["step"] >= first and s["category"] == "compute" and s["name"] in ("forward", "backward"):
            (fwd if s["name"] == "forward" else bwd)[s["rank"]].append(s["t1"] - s["t0"])
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return [mean(x) for x in fwd], [mean(x) for x in bwd]


def measured_bubble(by_step: dict[str, float], warmup: int) -> float:
    """Mean of a rank's per-step bubble (idle / step time) after the warm-up steps."""
    values = [v for _, v in sorted((int(k), v) for k, v in by_step.items())]
    kept = values[warmup:] or values
    return sum(kept) / len(kept)


def run_one(label: str, args: list[str], shared: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    p = paralab_train([*args, *shared], out, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        print(f"{label}: failed (exit {p.returncode})\n{p.stderr[-2000:]}", file=sys.stderr)
        return {"label": label, "error": p.stderr[-2000:], "returncode": p.returncode}
    s = json.loads((out / "summary.json").read_text())
    details = s.get("strategy_details", {})
    workers = s["workers"]
    d0 = details.get("0", {})
    m = d0.get("microbatches", 1)
    schedule = d0.get("schedule", "naive")
    fwd, bwd = stage_times(out, workers, s["warmup"])
    sim = simulated_bubble(simulate(build_schedule("gpipe" if schedule == "naive" else schedule, workers, m),
                                    forward_time=fwd, backward_time=bwd))
    return {
        "label": label, "strategy": s["strategy"], "schedule": schedule, "microbatches": m,
        "samples_per_s": s["samples_per_s"], "seconds_per_iter": s["seconds_per_iter"],
        "bubble": [measured_bubble(details[str(r)]["bubble_by_step"], s["warmup"]) for r in range(workers)],
        "bubble_theory": d0.get("bubble_theory"),
        "bubble_simulated": sim,
        "forward_s_per_mb": fwd, "backward_s_per_mb": bwd,
        "peak_microbatches_alive": [details[str(r)]["peak_microbatches_alive"] for r in range(workers)],
        "peak_activation_bytes": [details[str(r)]["peak_activation_bytes"] for r in range(workers)],
        "ranges": d0.get("ranges"), "time_share": [details[str(r)].get("time_share") for r in range(workers)],
        "split": s["split"], "wall_s": wall,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/pipeline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="vgg11")
    p.add_argument("--width", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated M values")
    p.add_argument("--out", "--output", dest="output", default=str(RESULTS / "pipeline.json"),
                   help="where to write the JSON result")
    args = p.parse_args(argv)
    ms = [int(m) for m in args.microbatches.split(",")]
    model = build_model(args.model, width=args.width)
    times = measure_unit_times(model, sample_batch(max(1, args.batch_size // 4)), repeats=5)
    ranges = partition_model(model, args.workers, "balanced", unit_times=times)
    counts = ",".join(str(b - a) for a, b in ranges)
    shared = ["--workers", str(args.workers), "--model", args.model, "--width", str(args.width),
              "--batch-size", str(args.batch_size), "--num-batches", str(args.num_batches),
              "--warmup", str(args.warmup), "--partition", counts, "--dataset", "synthetic",
              "--lr", "0.01", "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64",
              "--log-every", "1000"]
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="paralab-bench-pipeline-") as tmp:
        for i, (label, targs) in enumerate(configurations(ms)):
            print(f"  running {label} ...", flush=True)
            results.append(run_one(label, targs, shared, Path(tmp) / f"run{i}"))
    load_after = os.getloadavg()

    base = next((r["samples_per_s"] for r in results if r["label"] == "model" and "error" not in r), None)
    w = args.workers
    header = (f"{'run':<12}{'samples/s':>10}{'vs model':>9}  {'bubble measured':<{8 * w}}"
              f"{'theory':>7}  {'simulated':<{8 * w}}{'peak alive':>{4 * w + 2}}")
    print(f"\n{args.model} width {args.width}, batch {args.batch_size}, {w} workers, balanced partition {counts}, "
          f"{args.num_batches} steps ({args.warmup} warm-up); load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} cores")
    print(header)
    ok = True
    for r in results:
        if "error" in r:
            ok = False
            print(f"{r['label']:<12}  FAILED")
            continue
        speed = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
        meas = " ".join(f"{b:.2f}" for b in r["bubble"])
        sim = " ".join(f"{b:.2f}" for b in r["bubble_simulated"])
        peak = "/".join(str(x) for x in r["peak_microbatches_alive"])
        print(f"{r['label']:<12}{r['samples_per_s']:>10.1f}{speed:>9}  {meas:<{8 * w}}"
              f"{r['bubble_theory']:>7.2f}  {sim:<{8 * w}}{peak:>{4 * w + 2}}")
    out = write_result(args.output, {"benchmark": "pipeline", "settings": vars(args), "partition": counts,
                                     "unit_seconds": times, "cpu_count": os.cpu_count(),
                                     "load_average_before": load_before, "load_average_after": load_after,
                                     "results": results})
    print(f"\nwritten {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
