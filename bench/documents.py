"""Documents benchmark: packing against padding (valid tokens/s), and the cp chunks dealt by the documents.

``flock /tmp/paralab-cpu.lock python bench/documents.py [--dataset jargon-entries] [--context 512]
[--batch-size 8] [--steps 6] [--repeats 3]``

Two comparisons, each side by side in one run, every variant through
``paralab train`` on the same gpt, the same documents and the same global
batch of rows:

- **packing vs padding** (1 worker): padded, every row holds one document and
  the rest is padding; packed, the documents follow one another and attention
  is masked at their boundaries. What counts is the *valid* targets trained
  per second (steps.jsonl's ``targets``: padding and the byte after each
  document's end left out), not rows.
- **the cp balancer** (``cp`` on ``--cp`` workers, ring attention, packed): the
  chunks dealt every step by the attention blocks the documents need
  (``strategies/context/balance.py``) against the fixed head + tail pairing
  (``--no-cp-balance-documents``) and contiguous chunks (``--no-cp-balance``);
  each rank's attention compute time (its ``attention`` and
  ``attention_backward`` spans per step after warm-up), and the slowest over
  the fastest rank.

The default data is the Jargon File cut at its entries (``jargon-entries``, a
real length distribution: median 433 bytes, a long tail) when it is installed,
else ``synthetic-docs`` (log-normal lengths, median ``--doc-length``). Writes
``bench/results/documents.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_options, selected, step_seconds, train_gpt, write_result
from context import attention_seconds

VARIANTS = {  # name -> (strategy, workers (0: --cp), extra options)
    "padded": ("single", 1, []),
    "packed": ("single", 1, ["--packing"]),
    "cp-dealt": ("cp", 0, ["--packing"]),
    "cp-head-tail": ("cp", 0, ["--packing", "--no-cp-balance-documents"]),
    "cp-contiguous": ("cp", 0, ["--packing", "--no-cp-balance"]),
}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/documents.py", description=__doc__.splitlines()[0])
    gpt_options(p, layers=2, embed=128, heads=4, context=512)
    p.add_argument("--dataset", default=None, help="jargon-entries (default when installed) or synthetic-docs")
    p.add_argument("--doc-length", type=int, default=200, help="synthetic-docs: the median document length")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (rows), the same for every variant")
    p.add_argument("--steps", type=int, default=6, help="training steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the average")
    p.add_argument("--cp", type=int, default=2, help="workers of the cp variants")
    p.add_argument("--cores-per-worker", type=int, default=1, help="0: the workers are not pinned")
    p.add_argument("--repeats", type=int, default=3, help="run every variant R times, interleaved; keep the best")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(RESULTS / "documents.json"))
    args = p.parse_args(argv)
    if args.dataset is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        from paralab.data.text import text_path
        args.dataset = "jargon-entries" if text_path("jargon", None) else "synthetic-docs"
    return args


def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    strategy, workers, extra = VARIANTS[name]
    workers = workers or args.cp
    out = workdir / f"{name}-{tag}"
    cores = ["--cores-per-worker", str(args.cores_per_worker)] if args.cores_per_worker else []
    s, rows, _ = train_gpt(name, [strategy, "--workers", str(workers), *cores, *extra], args, out,
                           data=("--dataset", args.dataset, "--doc-length", str(args.doc_length)))
    seconds = step_seconds(rows, args.warmup)
    measured = sorted({r["step"] for r in rows})[-len(seconds):]
    targets = sum(next(r["targets"] for r in rows if r["step"] == st) for st in measured)
    attention = attention_seconds(out, args.warmup) if workers > 1 else {}
    balance = s["strategy_details"]["0"].get("context_parallel", {}).get("document_balance") \
        if workers > 1 else None
    return {
        "variant": name, "strategy": strategy, "workers": workers, "options": extra,
        "samples_per_s": s["samples_per_s"],
        "valid_tokens_per_s": targets / sum(seconds),
        "valid_fraction": targets / (len(measured) * args.batch_size * args.context),
        "seconds_per_iter": s["seconds_per_iter"],
        "attention_s_per_rank": {str(k): v for k, v in sorted(attention.items())},
        "attention_max_over_min": (max(attention.values()) / min(attention.values())) if attention else None,
        "blocks_spread": balance, "run": str(out),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    names = selected(args.variants, tuple(VARIANTS), "variants")
    if names is None:
        return 2
    measured = best_of("documents", names, args.repeats, lambda name, workdir, tag: run_one(name, args, workdir, tag))
    if measured is None:
        return 1
    runs, best, machine = measured
    ratios = {}
    if "packed" in best and "padded" in best:
        ratios["packed_over_padded_valid_tokens"] = (best["packed"]["valid_tokens_per_s"]
                                                     / best["padded"]["valid_tokens_per_s"])
    for other in ("cp-head-tail", "cp-contiguous"):
        if "cp-dealt" in best and other in best and best[other]["attention_max_over_min"]:
            ratios[f"attention_spread_dealt_over_{other[3:].replace('-', '_')}"] = (
                best["cp-dealt"]["attention_max_over_min"] / best[other]["attention_max_over_min"])
    shape = {"layers": args.layers, "embed": args.embed, "heads": args.heads, "context": args.context}
    result = {"benchmark": "documents", "model": "gpt", "shape": shape, "dataset": args.dataset,
              "doc_length": args.doc_length if args.dataset == "synthetic-docs" else None,
              "global_batch": args.batch_size, "cp": args.cp, "steps": args.steps, "warmup": args.warmup,
              "cores_per_worker": args.cores_per_worker, "repeats": args.repeats, "cpu": cpu_name(), **machine,
              "best": best, "all_runs": runs, "ratios": ratios}
    out = write_result(args.out, result)
    print(f"\ngpt {shape} on {args.dataset}, global batch {args.batch_size}, cp {args.cp}, "
          f"{args.cores_per_worker or 'unpinned'} core(s) per worker; best of {args.repeats}; {result.get('cpu')}")
    print(f"{'variant':<16}{'workers':>8}{'valid tok/s':>12}{'valid':>7}{'s/iter':>8}  attention s per rank (max/min)")
    for n in names:
        b = best[n]
        att = ", ".join(f"{v:.3f}" for v in b["attention_s_per_rank"].values())
        spread = f" ({b['attention_max_over_min']:.2f})" if b["attention_max_over_min"] else ""
        print(f"{n:<16}{b['workers']:>8}{b['valid_tokens_per_s']:>12.0f}{b['valid_fraction']:>7.0%}"
              f"{b['seconds_per_iter']:>8.3f}  {att}{spread}")
    for key, value in ratios.items():
        print(f"{key} = {value:.3f}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
