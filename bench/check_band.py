"""Bug or rounding: ``--check``'s noise band on correct layouts and on seeded bugs, in fp32, bf16 and fp16.

Two tables, each row a ``paralab train ... --check`` of this checkout:

- **correct**: every built-in layout of :data:`LAYOUTS` (data-parallel flavours, ZeRO 1/2/3, HSDP, tp and
  sp, the pipeline schedules, cp ring and Ulysses, experts, recomputation, the lossy compressions) on a small
  gpt, ``--precision fp32``, ``bf16`` and ``fp16`` (``--precisions``), ``--num-batches 20 --check-every 5``,
  ``--seeds`` seeds each: the
  verdict and the worst ratio of any compared quantity to its band. A correct layout must never say ``bug``.
- **bugs**: every seeded bug of ``tests/test_mutants.py`` (the package copied, one line changed), its own
  command at ``fp64`` and each of ``--precisions`` with ``--check-every 1``: the verdict, the worst ratio to the band
  (below fp64), the first step where the weights or the optimizer's state leave it (fp64: their
  tolerance), and the first divergence its replay names (below fp64: the first quantity outside its own
  band). A bug should say ``bug`` at every precision, within a few steps of fp64, and be named where fp64
  names it. A bug whose layout the check holds to exact (``check/band.py``: 2 shards of ddp, allreduce,
  gather-scatter or torch-ddp on a CPU) has no band, so no ratio: the median ratio is over the others.

  .venv/bin/python bench/check_band.py [--only correct|bugs] [--precisions fp32,bf16,fp16] [--seeds 3] [--jobs 2]

Writes bench/results/check-band.json (the CPU named from ``lscpu``) and prints both tables.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import RESULTS, ROOT, SRC, cpu_name, write_result

GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "4",
       "--context", "16", "--batch-size", "8"]
#: name -> the strategy, its workers and options (each on the gpt above)
LAYOUTS = {
    "ddp": ["ddp", "--workers", "2", "--bucket-mb", "0.01"],
    "allreduce": ["allreduce", "--workers", "2"],
    "torch-ddp": ["torch-ddp", "--workers", "2"],
    "zero1": ["fsdp", "--workers", "2", "--zero-stage", "1"],
    "zero2": ["fsdp", "--workers", "2", "--zero-stage", "2"],
    "zero3": ["fsdp", "--workers", "2", "--zero-stage", "3"],
    "hsdp": ["fsdp", "--workers", "4", "--zero-stage", "2", "--replicate", "2"],
    "torch-fsdp": ["torch-fsdp", "--workers", "2"],
    "tp": ["tp", "--workers", "2"],
    "tp+sp": ["tp", "--workers", "2", "--sequence-parallel"],
    "pp-gpipe": ["pipeline", "--workers", "2", "--schedule", "gpipe", "--microbatches", "4"],
    "pp-1f1b": ["pipeline", "--workers", "2", "--schedule", "1f1b", "--microbatches", "4"],
    "pp-zb-h1": ["pipeline", "--workers", "2", "--schedule", "zb-h1", "--microbatches", "4"],
    "pp-interleaved": ["pipeline", "--workers", "2", "--schedule", "interleaved-1f1b", "--microbatches", "4",
                       "--virtual-stages", "2", "--layers", "4"],
    "cp-ring": ["ddp", "--workers", "4", "--cp", "4"],
    "cp-ulysses": ["ddp", "--workers", "2", "--cp", "2", "--cp-method", "all-to-all"],
    "ep": ["ddp", "--workers", "2", "--experts", "4", "--ep", "2", "--capacity-factor", "1.0"],
    "recompute-full": ["ddp", "--workers", "2", "--recompute", "full", "--dropout", "0.1"],
    "compress-fp16": ["ddp", "--workers", "2", "--compress", "fp16"],
    "compress-bf16": ["ddp", "--workers", "2", "--compress", "bf16"],
    "compress-powersgd": ["ddp", "--workers", "2", "--compress", "powersgd", "--powersgd-start-iter", "2"],
    "dp-tp-pp": ["ddp", "--workers", "8", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
}
COMMON = ["--no-progress", "--eval-batches", "1", "--eval-batch-size", "16", "--timeout", "120", "--check",
          "--log-every", "1000"]


def precision_args(precision: str) -> list[str]:
    """``--precision P``; bf16 with ``--allow-slow-bf16``: this bench measures rounding, not speed, and a CPU
    without bf16 instructions refuses bf16 otherwise."""
    return ["--precision", precision, *(["--allow-slow-bf16"] if precision == "bf16" else [])]


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/check_band.py", description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("correct", "bugs"), help="one table only (default: both)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of each correct layout, each precision")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="precisions below fp64 (comma-separated)")
    p.add_argument("--steps", type=int, default=20, help="steps of each correct layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="correct layouts (comma-separated names)")
    p.add_argument("--bugs", default=None, help="seeded bugs (comma-separated names; default all)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--out", default=str(RESULTS / "check-band.json"))
    return p.parse_args(argv)


def train(argv: list[str], out: Path, pythonpath: Path) -> dict:
    """``python -m paralab train ARGV`` with ``pythonpath`` first: its check's summary (or why it had none)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paralab", "train", *argv, "--out", str(out)], env=env,
                          capture_output=True, text=True)
    seconds = round(time.perf_counter() - started, 1)
    summary = out / "summary.json"
    check = json.loads(summary.read_text()).get("check") if summary.is_file() else None
    if not check:  # exit 2: a combination paralab refuses (said), not an error of the check
        return {"verdict": "refused" if done.returncode == 2 else "error", "exit": done.returncode,
                "seconds": seconds, "error": (done.stderr or done.stdout)[-600:]}
    tolerance = check["tolerances"]["weights"]

    def outside(h: dict) -> bool:  # a step judged by its band (below fp64, beyond exact), else by fp64's tolerance
        ratios = [h[k] for k in ("weights_ratio", "optimizer_ratio") if k in h]
        return max(ratios) > 1 if ratios else h["max_weight_dev"] > tolerance
    first = next((h["step"] for h in check.get("history") or [] if outside(h)), None)
    return {"verdict": check.get("verdict"), "worst_ratio": check.get("worst_ratio"), "exit": done.returncode,
            "held_exact": "held_exact" in check,
            "failed": check.get("failed"), "first_step_outside": first, "seconds": seconds,
            "max_weight_dev": check.get("max_weight_dev"), "first_divergence": check.get("first_divergence")}


def place(line: str | None) -> str | None:
    """Where a first divergence line names (its step, direction, module and tensor; not the rank or the size)."""
    if not line or "first divergence: step" not in line:
        return None
    step, _, rest = line.split("first divergence: ")[1].partition(", rank ")
    return f"{step}, {rest.partition(', ')[2].partition(', max |d|')[0]}"


def correct_table(args, work: Path) -> list[dict]:
    names = [n for n in args.layouts.split(",") if n]
    jobs = [(name, precision, seed) for name in names for precision in args.precisions.split(",")
            for seed in range(1, args.seeds + 1)]

    def one(job):
        name, precision, seed = job
        out = work / f"correct-{name}-{precision}-{seed}"
        row = train([*LAYOUTS[name], *GPT, *COMMON, *precision_args(precision), "--seed", str(seed),
                     "--num-batches", str(args.steps), "--check-every", "5", "--no-first-divergence"], out, SRC)
        shutil.rmtree(out, ignore_errors=True)
        print(f"  correct {name:18s} {precision} seed {seed}: {row['verdict']:15s} "
              f"{_ratio(row.get('worst_ratio'))}", flush=True)
        return {"layout": name, "precision": precision, "seed": seed, **row}

    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(one, jobs))


def bugs_table(args, work: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_mutants import COMMON as MUTANT_COMMON, MUTANTS  # noqa: E402 - the seeded bugs, as the tests hold them
    wanted = set(args.bugs.split(",")) if args.bugs else None
    mutants = [m for m in MUTANTS if wanted is None or m.name in wanted]
    common = [a for a in MUTANT_COMMON if a != "--check"]

    def one(mutant):
        root = work / f"bug-{mutant.name}"
        shutil.copytree(SRC / "paralab", root / "paralab", ignore=shutil.ignore_patterns("__pycache__"))
        path = root / "paralab" / mutant.file
        text = path.read_text()
        if text.count(mutant.old) != 1:
            return {"bug": mutant.name,
                    "error": f"{mutant.file}: the line to change occurs {text.count(mutant.old)} times"}
        path.write_text(text.replace(mutant.old, mutant.new))
        row = {"bug": mutant.name, "why": mutant.why}
        for precision in ("fp64", *args.precisions.split(",")):
            out = root / precision
            # the bug's own options after the common ones, so they win (--num-batches), as tests/test_mutants.py
            row[precision] = train([mutant.command[0], *common, *mutant.command[1:], "--check",
                                    *precision_args(precision), "--check-every", "1"], out, root)
        shutil.rmtree(root, ignore_errors=True)
        print(f"  bug {mutant.name:40s} " + "  ".join(
            f"{p} {row[p]['verdict']:15s} {_ratio(row[p].get('worst_ratio'))}"
            for p in ("fp64", *args.precisions.split(","))),
            flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(one, mutants))


def _ratio(r) -> str:
    return "-" if r is None else f"{r:.3g}"


def summarise(correct: list[dict], bugs: list[dict], precisions: list[str]) -> dict:
    said = {}
    for p in precisions if correct else []:
        rows = [r for r in correct if r["precision"] == p]
        ratios = [r["worst_ratio"] for r in rows if r.get("worst_ratio") is not None and r["verdict"] != "exact"]
        said[f"correct_{p}"] = {"runs": len(rows), "bug_verdicts": sum(r["verdict"] == "bug" for r in rows),
                                "refused": sum(r["verdict"] == "refused" for r in rows),
                                "errors": sum(r["verdict"] == "error" for r in rows),
                                "exact": sum(r["verdict"] == "exact" for r in rows),
                                "worst_ratio": max(ratios) if ratios else None,
                                "median_ratio": statistics.median(ratios) if ratios else None}
    if bugs:
        for p in precisions:
            caught = [b for b in bugs if b.get("fp64", {}).get("verdict") == "bug" and b[p]["verdict"] != "refused"]
            ratios = [b[p]["worst_ratio"] for b in caught if b[p].get("worst_ratio") is not None]
            late = [b["bug"] for b in caught if b[p]["verdict"] == "bug" and b[p]["first_step_outside"] is not None
                    and b["fp64"]["first_step_outside"] is not None
                    and b[p]["first_step_outside"] - b["fp64"]["first_step_outside"] > 3]
            said[f"bugs_{p}"] = {"caught_in_fp64": len(caught),
                                 "bug_here": sum(b[p]["verdict"] == "bug" for b in caught),
                                 # held to exact (check/band.py): beyond exact is a bug, no band to be a ratio of
                                 "held_exact": sum(bool(b[p].get("held_exact")) for b in caught),
                                 "missed": [b["bug"] for b in caught if b[p]["verdict"] != "bug"],
                                 "more_than_3_steps_late": late,
                                 # the replay's first divergence at the place fp64's names, and where it is not
                                 "named_where_fp64_is": sum(place(b[p].get("first_divergence")) is not None and
                                                            place(b[p].get("first_divergence"))
                                                            == place(b["fp64"].get("first_divergence"))
                                                            for b in caught),
                                 "named_elsewhere": {b["bug"]: [place(b["fp64"].get("first_divergence")),
                                                                b[p].get("first_divergence")]
                                                     for b in caught if place(b[p].get("first_divergence"))
                                                     != place(b["fp64"].get("first_divergence"))},
                                 "median_ratio": statistics.median(ratios) if ratios else None}
    return said


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="check-band-") as tmp:
        work = Path(tmp)
        correct = correct_table(args, work) if args.only in (None, "correct") else []
        bugs = bugs_table(args, work) if args.only in (None, "bugs") else []
    result = {"bench": "check_band", "cpu": cpu_name(), "when": time.strftime("%Y-%m-%d"),
              "seconds": round(time.time() - started), "steps": args.steps, "seeds": args.seeds,
              "summary": summarise(correct, bugs, args.precisions.split(",")), "correct": correct, "bugs": bugs}
    path = write_result(args.out, result)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
