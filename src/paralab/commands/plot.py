"""Draw a figure from run directories (or print its numbers as a table).

Reads only the run directories' files (summary.json, steps.jsonl,
spans.jsonl, config.json), so runs made on a cluster can be plotted anywhere.
Without -o the figure's numbers are printed as a table instead.

kinds:
  throughput   global samples/s by strategy and worker count
  split-time   time per iteration of every rank, stacked: data, compute, comm,
               optimizer, idle, other (async communication drawn beside it)
  timeline     one step (--step, default the last), one row per rank: forward
               and backward with microbatch numbers, communication, waits;
               pipelines get the ideal timeline of their schedule beside it
               (--no-ideal to leave it out)
  scaling      seconds per iteration vs workers per strategy, with ideal T1/N
  memory       model-state bytes per rank (reported by the strategy, else estimated)
  deviation    max weight deviation from the single-process reference vs step; below fp64,
               its worst ratio to the noise band (above 1: a bug)
               (runs made with --check --check-every K; put fp32 beside fp64)
  moe-load     a mixture of experts' routing: tokens per expert by rank, and the
               imbalance (max / mean) and dropped choices per step
  grad-norm    the whole model's gradient norm per step, before clipping, with
               the --clip-grad line (runs made with --clip-grad NORM)

examples:
  paralab plot throughput runs/ddp-w1-* runs/ddp-w2-* -o throughput.png
  paralab plot split-time reports/compare-*/runs/* -o split.png
  paralab plot timeline runs/pipeline-w2-* -o timeline.png
  paralab plot scaling runs/*           (prints the table)
  paralab plot deviation runs/ddp-fp32 runs/ddp-fp64 -o deviation.png
  paralab plot grad-norm runs/ddp-clipped  (prints the table)
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError, write_refused
from ..options import integer

HELP = ("plot throughput | split-time | timeline | scaling | memory | deviation | moe-load | grad-norm from run "
        "directories")

from ..report.plots import KINDS  # noqa: E402


def add_arguments(p) -> None:
    p.add_argument("kind", choices=KINDS, metavar="KIND", help=" | ".join(KINDS))
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories written by `paralab train`")
    p.add_argument("-o", "--output", help="PNG file to write (without it: print the table)")
    p.add_argument("--step", type=integer, help="timeline: which step (default: the last one)")
    p.add_argument("--no-ideal", dest="ideal", action="store_false",
                   help="timeline: leave out the ideal schedule panel")


def run(args) -> int:
    from ..report import plots
    from ..analysis.runs import load_runs
    from ..report.page import text_table

    import sys
    runs = load_runs(args.runs, skip_unfinished=True, warn=lambda m: print(f"paralab plot: {m}", file=sys.stderr))
    if args.step is not None and args.kind != "timeline":
        raise UsageError("--step is for `plot timeline`")
    if args.kind == "timeline":
        for r in runs:
            steps = sorted({s["step"] for s in r.spans if s["step"] >= 0})
            if not steps:
                raise UsageError(f"{r.path}: no training spans recorded (spans.jsonl is empty)")
            if args.step is not None and args.step not in steps:
                raise UsageError(f"{r.path} has no step {args.step}; its steps are {steps[0]}..{steps[-1]}")
    if args.output is None:
        kw = {"step": args.step} if args.kind == "timeline" else {}
        headers, rows = plots.TABLES[args.kind](runs, **kw)
        print(text_table(headers, rows))
        return 0
    out = Path(args.output)
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UsageError(f"-o {out}: write a .png (or .pdf / .svg) file")
    if out.parent and not out.parent.exists():
        raise UsageError(f"-o {out}: folder {out.parent} does not exist")
    kw = {"step": args.step, "ideal": args.ideal} if args.kind == "timeline" else {}
    if args.kind == "throughput" and not any(r.samples_per_s for r in runs):
        raise UsageError("none of these runs has a measured throughput (did they finish any step?)")
    tmp = out.with_name(f".{out.stem}.partial{out.suffix}")
    try:
        plots.PLOTS[args.kind](runs, tmp, **kw)
        tmp.replace(out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a folder this user cannot write (exit 4), a full disk (4)
        raise write_refused(f"-o {out}", exc) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {out}")
    return 0
