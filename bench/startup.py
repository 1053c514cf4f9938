"""Start-up benchmark: what a run costs before and around its training, beside one ``import torch``.

``python bench/startup.py [--repeats 5] [--no-compare]``

Measured side by side, interleaved round by round (so a disturbance on the machine hits them alike),
each as the median wall time of ``--repeats`` rounds:

- ``import torch``: ``python -c "import torch"``, the unit everything is compared with;
- a one-step 2-worker ``ddp`` run of a tiny model (VGG-11 at width 0.125, batch 32, one test batch)
  started three ways: ``python -m paralab train`` as a user types it (ranks forked from the launcher
  once it has imported what a rank needs: ``--start auto``), the same with ``--start spawn`` (a fresh
  interpreter per rank: how ranks started before), the same command line handed to a warm server
  (``paralab serve``, started once before the rounds, in a folder of this benchmark's own), and from a
  warm parent
  (``paralab.run.runner.run``, what ``compare``, ``sweep`` and the tests use: the run and its
  ranks forked from a forkserver that has imported everything once);
- unless ``--no-compare``: ``paralab compare`` with its defaults (10 runs, checks, report) from its
  warm parent, against the same command with ``--train-args="--start spawn" --no-share-references``,
  whose runs start and check as they did before warm starts (a fresh interpreter for each run and each
  of its ranks, each run training its own single-process reference; its figures are drawn in parallel
  as the warm one's). One round each (about a minute and a half for the cold one on 2 cores); the two
  tables must agree.

paralab's own modules are compiled to bytecode first (``compileall``, as ``make setup`` and a wheel install
do), so the figures hold on a machine whose shell sets ``PYTHONDONTWRITEBYTECODE`` (this project's VMs do):
without a cached ``.pyc`` every process compiles paralab's source again. One more row shows that cost: the
command line on an uncompiled copy of the source (``train (uncompiled)``).

Ratios reported: each one-step run over ``import torch`` (target: within 2x from the command line) and the
cold compare over the warm one (target: 2x or more). Writes ``bench/results/startup.json``.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, SRC, cpu_name, write_result

TINY = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.125", "--batch-size", "32",
        "--num-batches", "1", "--eval-batches", "1", "--eval-batch-size", "64", "--no-progress"]


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/startup.py", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="rounds of the short measurements (median kept)")
    p.add_argument("--no-compare", dest="compare", action="store_false", help="leave out the two compare runs")
    p.add_argument("--out", default=str(RESULTS / "startup.json"))
    return p.parse_args(argv)


def env(served: Path | None = None, src: Path = SRC) -> dict:
    """The commands' environment: paralab from ``src``; a warm server only where ``served`` names its
    folder (XDG_RUNTIME_DIR), else none (PARALAB_SERVE=off: one the user left running is not used)."""
    base = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if served is None:
        return {**base, "PARALAB_SERVE": "off"}
    base.pop("PARALAB_SERVE", None)
    return {**base, "XDG_RUNTIME_DIR": str(served)}


def timed(cmd: list[str], cwd: str, served: Path | None = None, environ: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=environ or env(served), cwd=cwd)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return seconds


def warm_run(tmp: Path, tag: str) -> float:
    """One run through the runner, from this process's warm forkserver (started by the first call)."""
    sys.path.insert(0, str(SRC))
    from paralab.cli import build_parser, config_from_args
    from paralab.run import runner
    cfg = config_from_args(build_parser().parse_args(["train", "ddp", "--workers", "2", *TINY])).validate()
    t0 = time.perf_counter()
    result = runner.run(cfg, tmp / f"warm-{tag}")
    seconds = time.perf_counter() - t0
    if not result.ok:
        raise RuntimeError(f"the warm run failed: {result.error}")
    return seconds


def compare_table(report: Path) -> list[list]:
    """Each run's strategy, workers, test loss, test accuracy and check verdict: what must not change."""
    results = json.loads((report / "results.json").read_text())
    keep = [results["headers"].index(h) for h in ("strategy", "workers", "test loss", "test acc %", "check")]
    return sorted([row[i] for i in keep] for row in results["rows"])


def main(argv: list[str]) -> int:
    args = parse(argv)
    py = sys.executable
    cli = [py, "-m", "paralab", "train", "ddp", "--workers", "2", *TINY]
    times: dict[str, list[float]] = {"import torch": [], "train (auto)": [], "train (spawn)": [], "warm run": [],
                                     "train (served)": [], "train (uncompiled)": []}
    started = time.time()
    compileall.compile_dir(str(SRC / "paralab"), quiet=1)  # what `make setup` does: .pyc files beside the source
    with tempfile.TemporaryDirectory(prefix="paralab-bench-startup-") as tmp:
        tmp = Path(tmp)
        bare = tmp / "src"  # the same source, never compiled, and nothing may write its bytecode
        shutil.copytree(SRC / "paralab", bare / "paralab", ignore=shutil.ignore_patterns("__pycache__"))
        uncompiled = {**env(src=bare), "PYTHONDONTWRITEBYTECODE": "1"}
        served = tmp / "xdg"
        served.mkdir(mode=0o700)
        try:
            warm_run(tmp, "first")  # starts this process's forkserver: paid once per caller, not per run
            timed([py, "-m", "paralab", "serve", "--idle", "10"], str(tmp), served)  # `paralab serve`, once
            for rep in range(args.repeats):
                print(f"bench startup: round {rep + 1}/{args.repeats} ...", flush=True)
                times["import torch"].append(timed([py, "-c", "import torch"], str(tmp)))
                times["train (auto)"].append(timed([*cli, "--out", str(tmp / f"auto-{rep}")], str(tmp)))
                times["train (spawn)"].append(timed([*cli, "--start", "spawn", "--out", str(tmp / f"spawn-{rep}")],
                                                    str(tmp)))
                times["warm run"].append(warm_run(tmp, str(rep)))
                times["train (served)"].append(timed([*cli, "--out", str(tmp / f"served-{rep}")], str(tmp), served))
                times["train (uncompiled)"].append(timed([*cli, "--out", str(tmp / f"bare-{rep}")], str(tmp),
                                                         environ=uncompiled))
            log = next(served.glob("paralab-serve-*/serve.log")).read_text().splitlines()
            refused = [line for line in log if line.startswith("refused")]
            if refused:  # the server ran none of them: the figure would be a cold one
                raise RuntimeError("the warm server refused the command line: " + refused[0])
            compare = None
            if args.compare:
                compare = {}
                for label, extra in (("warm", []), ("before (--start spawn)", ["--train-args=--start spawn", "--no-share-references"])):
                    print(f"bench startup: paralab compare, {label} ...", flush=True)
                    out = tmp / f"compare-{len(compare)}"
                    seconds = timed([py, "-m", "paralab", "compare", "--out", str(out), *extra], str(tmp))
                    compare[label] = {"seconds": seconds, "table": compare_table(out)}
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        finally:
            subprocess.run([py, "-m", "paralab", "serve", "--stop"], capture_output=True, env=env(served), cwd=tmp)
    median = {k: statistics.median(v) for k, v in times.items()}
    unit = median["import torch"]
    print(f"\nmedian wall seconds over {args.repeats} rounds (CPU: {cpu_name()}, {os.cpu_count()} cores)")
    for k, v in median.items():
        print(f"  {k:<18} {v:6.2f} s   {v / unit:5.2f} x import torch")
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "repeats": args.repeats, "seconds": times,
              "median_seconds": median, "over_import_torch": {k: v / unit for k, v in median.items()},
              "wall_s": time.time() - started,
              "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    if compare:
        warm, cold = compare["warm"], compare["before (--start spawn)"]
        result["compare"] = {"warm_s": warm["seconds"], "before_s": cold["seconds"],
                             "speedup": cold["seconds"] / warm["seconds"],
                             "same_table": warm["table"] == cold["table"], "table": warm["table"]}
        print(f"  paralab compare: {warm['seconds']:.1f} s warm, {cold['seconds']:.1f} s as before: "
              f"{cold['seconds'] / warm['seconds']:.2f}x; same table: {warm['table'] == cold['table']}")
    print(f"wrote {write_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
