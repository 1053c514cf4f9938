"""The planner against published training runs: each run's own layout predicted beside what it reached.

    python bench/published.py                  # every run (4 minutes on 2 cores): table + JSON
    python bench/published.py --runs "GPT 1.7B,BLOOM 176B" --out /tmp/p.json

For each run of ``paralab.analysis.published.RUNS`` (Narayanan et al.
2021's Table 1 and BLOOM-176B, each with its source): the planner's
prediction for the published layout, predicted / published throughput, and
the layout's rank among every layout the planner lists that fits and among
those the published system could run. Prints the Markdown table of
docs/plan.md ("Published runs") and writes bench/results/published-runs.json.
Nothing here is measured: the planner is deterministic on a preset cluster,
so the figures are the same on every machine (only the time it takes is not).
"""
from __future__ import annotations

import argparse
import sys
import time

from common import RESULTS, SRC, cpu_name, write_result

sys.path.insert(0, str(SRC))

from paralab.analysis.published import RUNS, against  # noqa: E402
from paralab.progress import Progress  # noqa: E402


def row(d: dict) -> str:
    return (f"| {d['run']} | `{d['layout']}` | {d['published_step']:.4g} | {d['predicted_step']:.4g} | "
            f"{d['ratio']:.2f} | {d['rank']:,} of {d['fitting']:,} ({d['top_percent']:.2g} %) | "
            f"{d['rank_theirs']} of {d['fitting_theirs']} | {d['first_mfu'] * 100:.0f} % |")


HEADER = ("| run | published layout | published s/step | predicted | ratio | rank (all that fit) | rank (its "
          "techniques) | first row's MFU |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", help="comma-separated run names (default: all): " + ", ".join(r.name for r in RUNS))
    p.add_argument("--out", default=str(RESULTS / "published-runs.json"))
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",")] if args.runs else [r.name for r in RUNS]
    unknown = [n for n in names if n not in {r.name for r in RUNS}]
    if unknown:
        p.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(r.name for r in RUNS)}")
    runs = [r for r in RUNS if r.name in names]
    bar, rows, started = Progress(len(runs), "published runs", enabled=sys.stderr.isatty()), [], time.time()
    for i, run in enumerate(runs):
        rows.append(against(run))
        bar.update(i + 1)
    bar.clear()
    print(HEADER)
    for d in rows:
        print(row(d))
    out = write_result(args.out, {"bench": "published", "cpu": cpu_name(), "seconds": time.time() - started,
                                  "runs": rows})
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
