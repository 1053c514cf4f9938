"""Activation recomputation: the step time it costs against the saved-activation memory it frees, gpt and VGG-11.

For each model, ``paralab train single --recompute none|selective|full`` on one worker (one core), the same
batch and data, ``--repeats`` times interleaved (``common.best_of``); each run's median step after warm-up,
the best run kept. A shared machine disturbs whole runs, so the same forward and backward is also timed in
this process, one thread, the three modes interleaved ``--inner-repeats`` times, the fastest of each kept.
Beside them, the bytes autograd keeps for backward in one forward of the same batch
(``paralab.training.recompute.measure_saved``: distinct storages saved by ``saved_tensors_hooks``,
parameters and buffers left out), and for the gpt the formula ``calc tp`` prints (``gpt_saved_bytes``).
Ratios are to ``none``: time x (slower is > 1) and memory x (less is < 1).

  flock /tmp/paralab-cpu.lock .venv/bin/python bench/recompute.py [--repeats 3]

Writes bench/results/recompute.json (the CPU named from ``lscpu``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_args, gpt_options, paralab_train, step_seconds, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import torch  # noqa: E402

from paralab.analysis.tensor import gpt_saved_bytes  # noqa: E402
from paralab.models import build_model  # noqa: E402
from paralab.training import recompute  # noqa: E402
from paralab.training.losses import cross_entropy  # noqa: E402

MODES = recompute.MODES


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/recompute.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,vgg11")
    gpt_options(p, layers=4, embed=128, heads=4, context=128)
    p.add_argument("--width", type=float, default=0.25, help="VGG-11's channel multiplier")
    p.add_argument("--gpt-batch", type=int, default=16)
    p.add_argument("--vgg-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inner-repeats", type=int, default=7, help="in-process forward+backward timings per mode")
    p.add_argument("--out", default=str(RESULTS / "recompute.json"))
    return p.parse_args(argv)


def model_args(name: str, args) -> list[str]:
    if name == "gpt":
        return [*gpt_args(args), "--dataset", "synthetic-text", "--batch-size", str(args.gpt_batch)]
    return ["--model", name, "--width", str(args.width), "--dataset", "synthetic", "--batch-size", str(args.vgg_batch)]


def run_one(label: str, args, workdir: Path, tag: str) -> dict:
    name, mode = label.rsplit("-", 1)
    out = workdir / f"{label}-{tag}"
    batch = args.gpt_batch if name == "gpt" else args.vgg_batch
    argv = ["single", "--cores-per-worker", "1", "--recompute", mode, *model_args(name, args),
            "--num-batches", str(args.steps), "--warmup", str(args.warmup),
            "--synthetic-size", str(max(1024, batch * args.steps)), "--eval-batches", "1",
            "--eval-batch-size", str(batch), "--no-progress", "--log-every", str(args.steps)]
    p = paralab_train(argv, out)
    if p.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    step = statistics.median(step_seconds(rows, args.warmup))
    return {"step_s": step, "samples_per_s": batch / step}


def build(name: str, mode: str, args):
    """The model (recomputing as ``mode`` says) and one batch, as the runs train them (fp32)."""
    torch.manual_seed(0)
    if name == "gpt":
        m = build_model("gpt", layers=args.layers, embed=args.embed, heads=args.heads, context=args.context)
        x = torch.randint(0, 256, (args.gpt_batch, args.context))
        y = torch.randint(0, 256, (args.gpt_batch, args.context))
    else:
        m = build_model(name, width=args.width)
        x, y = torch.randn(args.vgg_batch, 3, 32, 32), torch.randint(0, 10, (args.vgg_batch,))
    return recompute.apply(m, mode), x, y


def saved_bytes(name: str, mode: str, args) -> int:
    """What one forward of the benchmark's batch keeps for backward."""
    m, x, y = build(name, mode, args)
    with recompute.measure_saved(m) as meter:
        cross_entropy(m(x), y)
    return meter.bytes


def inner_seconds(name: str, args) -> dict[str, float]:
    """The fastest in-process forward + backward of each mode, the modes interleaved, one thread."""
    torch.set_num_threads(1)
    built = {mode: build(name, mode, args) for mode in MODES}
    best = {mode: float("inf") for mode in MODES}
    for _ in range(args.inner_repeats):
        for mode, (m, x, y) in built.items():
            t = time.perf_counter()
            cross_entropy(m(x), y).backward()
            best[mode] = min(best[mode], time.perf_counter() - t)
    return best


def main(argv: list[str]) -> int:
    args = parse(argv)
    models = [m for m in args.models.split(",") if m]
    labels = [f"{m}-{mode}" for m in models for mode in MODES]
    measured = best_of("recompute", labels, args.repeats, lambda n, w, t: run_one(n, args, w, t))
    if measured is None:
        return 1
    runs, best, machine = measured
    rows, table = {}, []
    for m in models:
        base_t, base_b = best[f"{m}-none"]["step_s"], saved_bytes(m, "none", args)
        inner = inner_seconds(m, args)
        for mode in MODES:
            b = base_b if mode == "none" else saved_bytes(m, mode, args)
            row = {"step_s": best[f"{m}-{mode}"]["step_s"], "saved_bytes": b,
                   "time_x": best[f"{m}-{mode}"]["step_s"] / base_t, "memory_x": b / base_b,
                   "fwd_bwd_s": inner[mode], "fwd_bwd_x": inner[mode] / inner["none"]}
            if m == "gpt":
                row["formula_bytes"] = gpt_saved_bytes(args.gpt_batch, args.context, args.embed, args.heads,
                                                       args.layers, mode, 4).value
            rows[f"{m}-{mode}"] = row
            table.append(f"{m:<7} {mode:<10} {row['step_s'] * 1e3:9.1f} ms  x{row['time_x']:.2f}   "
                         f"{row['fwd_bwd_s'] * 1e3:9.1f} ms  x{row['fwd_bwd_x']:.2f}   "
                         f"{b / 2**20:8.2f} MiB  x{row['memory_x']:.3f}"
                         + (f"   formula {row['formula_bytes'] / 2**20:.2f} MiB" if m == "gpt" else ""))
    result = {"bench": "recompute", "cpu": cpu_name(), **machine, "repeats": args.repeats,
              "inner_repeats": args.inner_repeats, "steps": args.steps,
              "warmup": args.warmup, "shape": {"gpt": {"layers": args.layers, "embed": args.embed, "heads": args.heads,
                                                       "context": args.context, "batch": args.gpt_batch},
                                               "vgg11": {"width": args.width, "batch": args.vgg_batch}},
              "rows": rows, "runs": runs}
    print(f"model   recompute   train step (best of {args.repeats})   fwd+bwd in-process (best of {args.inner_repeats})"
          "   saved activations  memory x")
    print("\n".join(table))
    print(f"{result['cpu']}; 1 worker, 1 core; load average before {machine['load_average_before'][0]:.1f}")
    path = write_result(args.out, result)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
