"""The mixture-of-experts gpt on 2 workers: experts on every rank (ep 1) against expert parallelism (ep 2), both dispatchers.

Variants (all ``allreduce``, 2 workers, the same model, batch and data):

- ``ep1``: data parallelism, every rank holds all E experts;
- ``ep2-a2a``: ``--ep 2``, tokens sent to their expert's rank by all-to-all;
- ``ep2-gather``: ``--ep 2 --dispatcher all-gather``, every token to every rank;
- ``ep2-skewS`` (``--skews``): ``--ep 2 --router-skew S``, expert 0's router logit raised by S, so rank 0's
  experts get more of the tokens: the rank load imbalance (the busiest rank's received rows over the mean,
  from the ``received`` records) beside the slowdown against ``ep2-a2a`` (the most imbalance could cost if
  the experts were all of the step).

Each variant runs ``--repeats`` times, interleaved (``common.best_of``); the
best run's samples/s is shown, with the ratio to ``ep1``. For the ep runs the
token all-to-all's recorded bytes per step (``moe_dispatch`` spans, forward)
are put beside the prediction from the run's own routed counts
(``analysis/moe.a2a_bytes``: kept choices x embed x 4 bytes), and the
all-reduce bytes per step beside ep1's (the experts' gradients are not
all-reduced under ep 2 with 2 workers: edp is 1).

  flock /tmp/paralab-cpu.lock .venv/bin/python bench/moe.py [--experts 4] [--top-k 2] [--repeats 3]

Writes bench/results/moe.json (the CPU named from ``lscpu``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import RESULTS, best_of, cpu_name, gpt_options, train_gpt, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from paralab.analysis.moe import a2a_bytes  # noqa: E402

VARIANTS = {"ep1": [], "ep2-a2a": ["--ep", "2"], "ep2-gather": ["--ep", "2", "--dispatcher", "all-gather"]}


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/moe.py", description=__doc__.splitlines()[0])
    gpt_options(p, layers=2, embed=128, heads=4, context=64)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skews", default="2,4", help="router skews of the imbalance variants (comma-separated; '' none)")
    p.add_argument("--out", default=str(RESULTS / "moe.json"))
    return p.parse_args(argv)


def run_one(name: str, args, workdir: Path, tag: str) -> dict:
    out = workdir / f"{name}-{tag}"
    argv = ["allreduce", "--workers", "2", "--cores-per-worker", "1", *VARIANTS[name], "--experts", str(args.experts),
            "--top-k", str(args.top_k)]
    s, rows, _ = train_gpt(name, argv, args, out)
    spans = [json.loads(line) for line in (out / "spans.jsonl").read_text().splitlines()]
    measured = {r["step"] for r in rows if r["step"] >= args.warmup}
    by_rank: dict[int, int] = {}
    for r in rows:
        if r["step"] in measured:
            by_rank[r["rank"]] = by_rank.get(r["rank"], 0) + sum(sum(layer.get("received", [0]))
                                                                  for layer in r["moe"])
    sent = sum(sp["bytes"] for sp in spans if sp["name"] == "moe_dispatch" and sp["step"] in measured)
    kept = sum(sum(layer["counts"]) for r in rows if r["step"] in measured for layer in r["moe"])
    predicted = a2a_bytes(kept, args.embed, 4, 2)["bytes"] if "--ep" in VARIANTS[name] else 0
    steps = max(len(measured), 1)
    return {"variant": name, "samples_per_s": s["samples_per_s"],
            "seconds_per_iter_median": s["seconds_per_iter_median"],
            "dispatch_bytes_per_step": sent / steps, "dispatch_bytes_predicted": predicted / steps,
            "all_reduce_bytes_per_step": s["comm_ops"].get("all_reduce", {}).get("bytes_per_step"),
            "comm_ops": {op: e["bytes_per_step"] for op, e in s["comm_ops"].items()},
            "parameters_total": s["moe"]["parameters_total"], "parameters_active": s["moe"]["parameters_active"],
            "imbalance": [layer["imbalance"] for layer in s["moe"]["load"]["layers"]],
            "rank_load_imbalance": max(by_rank.values()) / (sum(by_rank.values()) / len(by_rank))
            if sum(by_rank.values()) else None}


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    for skew in [x for x in args.skews.split(",") if x.strip()]:
        VARIANTS[f"ep2-skew{skew.strip()}"] = ["--ep", "2", "--router-skew", skew.strip()]
    got = best_of("moe", list(VARIANTS), args.repeats, lambda n, d, t: run_one(n, args, d, t))
    if got is None:
        return 1
    runs, best, machine = got
    base = best["ep1"]["samples_per_s"]
    print("a2a B/step: the token dispatch, forward, both ranks; predicted from the routed counts")
    print(f"{'variant':<12}{'samples/s':>11}{'x ep1':>8}{'a2a B/step':>13}{'predicted':>13}{'allreduce B/step':>18}"
          f"{'rank load max/mean':>20}{'time x ep2-a2a':>16}")
    for name, r in best.items():
        r["ratio_to_ep1"] = r["samples_per_s"] / base
        r["slowdown_vs_ep2_a2a"] = best["ep2-a2a"]["samples_per_s"] / r["samples_per_s"]
        load = f"{r['rank_load_imbalance']:.2f}" if r["rank_load_imbalance"] else "-"
        print(f"{name:<12}{r['samples_per_s']:>11.1f}{r['ratio_to_ep1']:>8.2f}{r['dispatch_bytes_per_step']:>13,.0f}"
              f"{r['dispatch_bytes_predicted']:>13,.0f}{r['all_reduce_bytes_per_step'] or 0:>18,.0f}{load:>20}"
              f"{r['slowdown_vs_ep2_a2a']:>16.2f}")
    path = write_result(args.out, {"cpu": cpu_name(), "machine": machine, "args": vars(args), "best": best,
                                   "runs": runs})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
