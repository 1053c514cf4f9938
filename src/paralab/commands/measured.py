"""The planner against measured runs: each row of a table of measured iteration times planned with its layout
pinned, the errors, and (--fit) the cost model's free parameters fitted to the table.

Without --fit it prints how well a cluster predicts the table: the error of each row (predicted / measured -
1), their median, mean and worst, the same per model size, and within each group of rows that differ only in
their layout (same model, GPUs and global batch) the rank correlation between predicted and measured times
and the regret of running the layout predicted fastest. With --fit it finds the parameters
analysis/measured.py lists (the matmul efficiency and the size at which a matmul reaches half of it, the
host's launch time per unit, a collective step's latency, the link's bandwidth, a pipeline send's processor
time, the memory bandwidth reached), each within what the cluster's datasheet allows, and writes them as a
cluster file every `paralab plan --cluster FILE` reads; --hold-out leaves model sizes out of the fit and
reports them apart. The a100-sxm preset is this fit on the shipped table (docs/plan.md, "Calibrated on
measured runs").

examples:
  paralab measured                                   # the shipped vTrain table against the a100-sxm preset
  paralab measured --cluster a100-sxm-datasheet      # ... against the datasheet figures alone
  paralab measured --fit --cluster a100-sxm-datasheet --out my-a100.json
  paralab measured --fit --cluster a100-sxm-datasheet --hold-out 1024x16,2048x24 --out held.json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError
from ..options import add_flags, check, option
from ..progress import Progress

HELP = "the planner against a table of measured iteration times: errors, ranks, and a fit of its parameters"


@dataclass
class MeasuredOptions:
    """measured: the table, the cluster, the fit"""
    cluster: str = option("a100-sxm", "the cluster the runs ran on: a preset or a JSON/TOML cluster file (with "
                                      "--fit: the figures the fit starts from and is bounded by)", metavar="CLUSTER")
    fit: bool = option(False, "fit the cost model's free parameters to the table (a minute or two)")
    out: str = option(None, "with --fit: write the fitted cluster file here (JSON; a file there must be a cluster "
                            "file, which is replaced)", type=str, metavar="FILE")
    hold_out: str = option(None, "with --fit: model sizes (HIDDENxLAYERS, comma-separated) left out of the fit "
                                 "and reported apart", type=str, metavar="SIZES")
    iterations: int = option(300, "with --fit: moves of the simplex", positive=True)
    jobs: int = option(0, "with --fit: processes that predict the rows (0: one per core); the fit found is the "
                          "same with any number", minimum=0)
    worst: int = option(5, "rows with the largest errors to show", minimum=0)
    json: bool = option(False, "print the report as JSON (for scripts)")


def add_arguments(p) -> None:
    p.add_argument("table", nargs="?", default=None, metavar="TABLE.csv",
                   help="measured runs, one a row, in vTrain's columns (default: the shipped vTrain table of "
                        "1,440 single-node A100 runs)")
    add_flags(p, MeasuredOptions)


def run(args) -> int:
    from ..analysis import measured as M
    from ..analysis.plan.cluster import PRESETS, load_cluster
    check(args, MeasuredOptions)
    if not args.fit and (args.out or args.hold_out):
        raise UsageError(f"{'--out' if args.out else '--hold-out'} belongs to a fit: add --fit")
    out = _writable(args.out) if args.out else None
    table = Path(args.table) if args.table else M.SHIPPED
    rows = M.read_table(table)
    base = PRESETS[args.cluster] if args.cluster in PRESETS else load_cluster(args.cluster)
    held = _sizes(args.hold_out, rows) if args.hold_out else set()
    result = {"table": str(table), "cluster": base.name}
    if args.fit:
        train = [r for r in rows if r.size not in held]
        bar = Progress(args.iterations, "fit", enabled=sys.stderr.isatty() and not args.json)
        try:
            cluster, values = M.fit(train, base, iterations=args.iterations, workers=args.jobs or None,
                                    progress=lambda done, total, low: bar.update(done, f"mean squared log error {low:.4g}"))
        finally:
            bar.clear()
        fitted = M.report(train, M.predicted(train, cluster))
        cluster = replace(cluster, name=out.stem if out else f"{base.name}-fitted", source=_source(
            base, values, fitted, table))
        result |= {"fitted": values, "fit": fitted}
        if held:
            kept = [r for r in rows if r.size in held]
            result["held_out"] = M.report(kept, M.predicted(kept, cluster)) | {"sizes": sorted(held)}
        if out:
            _write(out, cluster.to_dict())
            result["wrote"] = str(out)
    else:
        result["report"] = M.report(rows, M.predicted(rows, base))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    show(result, rows, held, args.worst)
    return 0


def show(result: dict, rows, held: set, worst: int) -> None:
    from ..analysis import measured as M
    print(f"{len(rows)} measured runs of {Path(result['table']).name}, each planned with its layout pinned "
          f"({M.Facts().schedule}, {M.Facts().recompute} recomputation), on {result['cluster']}:")
    if "fitted" in result:
        print("\nfitted" + (f" on the {sum(r.size not in held for r in rows)} runs outside " + ", ".join(sorted(held))
                            if held else "") + ":")
        for name, _, _, _, meaning in M.FREE:
            print(f"  {name:<17} {result['fitted'][name]:>10.4g}  {meaning}")
        summary("fit", result["fit"], [r for r in rows if r.size not in held], worst)
        if "held_out" in result:
            summary("held out", result["held_out"], [r for r in rows if r.size in held], worst)
        if "wrote" in result:
            print(f"\nwrote {result['wrote']} (paralab plan --cluster {result['wrote']} ...)")
    else:
        summary("error", result["report"], rows, worst)


def summary(title: str, rep: dict, rows, worst: int) -> None:
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    print(f"\n{title}: predicted / measured - 1 over {rep['rows']} runs: median {pct(rep['median'])}, mean "
          f"{pct(rep['mean'])}, worst {pct(rep['worst'])}; predicted / measured at the median "
          f"{rep['median_ratio']:.3f}")
    if rep["groups"]:
        print(f"within the {rep['groups']} groups of runs that differ only in their layout (model, GPUs, global "
              f"batch): rank correlation median {rep['rank_median']:.2f}, worst {rep['rank_worst']:.2f}, "
              f"{rep['groups_below_0.9']} below 0.9; running the layout predicted fastest costs a median "
              f"{pct(rep['regret_median'])}, at worst {pct(rep['regret_worst'])}, over the group's fastest")
    print(f"\n  {'model (hidden x layers)':<24} {'runs':>5} {'median':>8} {'worst':>8}")
    for size, s in rep["by_size"].items():
        print(f"  {size:<24} {s['rows']:>5} {pct(s['median']):>8} {pct(s['worst']):>8}")
    if worst:
        errors = rep["errors"]
        order = sorted(range(len(rows)), key=lambda i: -abs(errors[i]))[:worst]
        print(f"\n  the {len(order)} largest errors: GPUs, global batch, micro batch, hidden x layers, tp dp pp: "
              "measured, predicted")
        for i in order:
            r = rows[i]
            print(f"  {r.gpus} GPUs, batch {r.global_batch}, micro {r.microbatch}, {r.size}, tp{r.tp} dp{r.dp} "
                  f"pp{r.pp}: {r.ms:.1f} ms, {r.ms * (1 + errors[i]):.1f} ms ({100 * errors[i]:+.1f} %)")


def _sizes(text: str, rows) -> set:
    sizes = {s.strip() for s in text.split(",") if s.strip()}
    known = sorted({r.size for r in rows})
    unknown = sorted(sizes - set(known))
    if unknown or not sizes:
        raise UsageError(f"--hold-out {text!r}: {', '.join(unknown) or 'no size'} is not a model size of the table "
                         f"(HIDDENxLAYERS, one of {', '.join(known)})")
    if sizes == set(known):
        raise UsageError(f"--hold-out {text!r} leaves nothing to fit: keep at least one of {', '.join(known)}")
    return sizes


def _source(base, values: dict, rep: dict, table: Path) -> str:
    got = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    return (f"fitted by `paralab measured --fit` to the {rep['rows']} measured runs of {table.name} (median |error| "
            f"{100 * rep['median']:.1f} %, worst {100 * rep['worst']:.1f} %): {got} (the matmul ramp: efficiency x "
            f"f / (f + half_gflop)); the other figures are {base.name}'s, whose source follows (its assumed "
            f"efficiency and fixed costs are the fit's above): {base.source}")


def _writable(path: str) -> Path:
    """``--out``: a new file, or a cluster file (which is replaced), in a folder that exists."""
    from ..analysis.plan.cluster import load_cluster
    out = Path(path)
    if out.suffix != ".json":
        raise UsageError(f"--out {path}: name a .json file (a cluster file `paralab plan --cluster` reads)")
    if not out.parent.is_dir():
        raise UsageError(f"--out {path}: no folder {out.parent}")
    if out.exists():
        try:
            load_cluster(str(out))
        except UsageError:
            raise UsageError(f"--out {path} exists and is not a cluster file: name a new file") from None
    return out


def _write(out: Path, data: dict) -> None:
    """Written beside ``out`` and renamed over it: a failure leaves the old file or none."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
