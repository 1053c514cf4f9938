"""Run every strategy at several worker counts and write one report.

Each run of the matrix is a separate `paralab train` process (so a run that
fails or hangs is stopped and reported, and the rest still runs); its run
directory lands under REPORT/runs/, its full output under REPORT/logs/. Then:

  REPORT/report.html   self-contained page: results table, figures, commands,
                       config and environment (open it in any browser)
  REPORT/report.md     the same in Markdown (figures linked from plots/)
  REPORT/results.json  the table as data
  REPORT/plots/*.png   throughput, split time, scaling, timelines, memory
  REPORT/trace.json    every run in one Chrome/Perfetto trace: one process
                       per run, one track per rank (ui.perfetto.dev)

Defaults are sized for a 2-core laptop, a few minutes in all:
  - every registered strategy at 1 and 2 workers; `single` only at 1, and the
    strategies that split the model (model, pipeline) only at 2 or more
    unless --workers is given;
  - VGG-11 at width 0.25, 20 steps of a 64-sample global batch, the first
    left out as warm-up; test evaluation bounded to 2 batches;
  - lr 0.02 (0.1 moves BatchNorm's running statistics too far in 20 steps
    for a meaningful test accuracy);
  - pipeline runs with 4 microbatches; 0.5 MiB gradient buckets, so ddp's
    communication overlaps backward on this small model as 25 MiB buckets
    do on the full one;
  - every worker pinned to (cores // largest worker count) cores, 1 on a
    2-core machine, so a 2-worker run has twice the cores of a 1-worker run,
    as in CS744 where each worker is a machine (--cores-per-worker none: a
    lone worker uses every core instead);
  - --check on: every run is compared with the single-process reference
    (the table's check column); --no-check skips that and runs faster.

The table follows CS744's Table 1: seconds per iteration (mean over steps
after the --warmup steps, slowest rank), global samples/s, speedup over
`single`, test loss and accuracy, check verdict.

examples:
  paralab compare
  paralab compare --strategies allreduce,ddp --workers 1,2,4 --num-batches 40
  paralab compare --strategies pipeline --workers 2 --train-args="--schedule 1f1b --partition params"
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

HELP = "run a matrix of strategies x workers; write a report (table, plots, HTML, trace)"

DEFAULTS = dict(workers="1,2", num_batches=20, batch_size=64, width=0.25, model="vgg11", dataset="auto",
                lr=0.02, eval_batches=2, microbatches=4, bucket_mb=0.5)
#: options a strategy needs in the comparison that others would refuse
PER_STRATEGY = {"pipeline": lambda a: ["--microbatches", str(a.microbatches)]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--strategies", help="comma-separated strategies (default: every registered one)")
    p.add_argument("--workers", default=None, help=f"comma-separated worker counts (default {d['workers']})")
    p.add_argument("--num-batches", type=int, default=d["num_batches"], help="training steps per run (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="global batch (default %(default)s)")
    p.add_argument("--width", type=float, default=d["width"], help="model channel multiplier (default %(default)s)")
    p.add_argument("--model", default=d["model"], help="model (default %(default)s)")
    p.add_argument("--dataset", default=d["dataset"], help="auto | cifar10 | fashion-mnist | synthetic (default %(default)s)")
    p.add_argument("--data-dir", help="folder with the dataset files")
    p.add_argument("--lr", type=float, default=d["lr"], help="learning rate (default %(default)s)")
    p.add_argument("--eval-batches", type=int, default=d["eval_batches"],
                   help="test batches evaluated per run (default %(default)s; 0 = the whole test split)")
    p.add_argument("--microbatches", type=int, default=d["microbatches"],
                   help="microbatches of pipeline runs (default %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=d["bucket_mb"],
                   help="gradient bucket of ddp-style runs, MiB (default %(default)s: the width-0.25 model's "
                        "2.2 MiB of gradients then fill several buckets, so communication can overlap backward)")
    p.add_argument("--cores-per-worker", default="auto",
                   help="cores pinned to each worker: auto (cores // the largest worker count, so every run "
                        "of the matrix gives a worker the same cores, like one machine per worker in CS744), "
                        "a number, or none (no pinning: one worker then uses every core)")
    p.add_argument("--check", dest="check", action="store_true", default=True,
                   help="compare every run with the single-process reference (default)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the reference check")
    p.add_argument("--train-args", default="",
                   help='more `paralab train` options for every run, e.g. --train-args="--norm none"')
    p.add_argument("--out", help="report directory (default reports/compare-<time>)")
    p.add_argument("--run-timeout", type=float, default=600.0,
                   help="seconds before a run is stopped and reported as failed (default %(default)s)")
    p.add_argument("--verbose", action="store_true", help="stream every run's full output")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")


# ======================================================================== running children
@dataclass
class ChildResult:
    returncode: int | None
    seconds: float
    error: str | None
    log: Path


PROGRESS_RE = re.compile(r"^(train|eval) \[[# ]*\] (\d+)/(\d+)")
STEP_RE = re.compile(r"^step\s+(\d+)/(\d+)")
EXC_RE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|paralab\.\w+\.\w+):\s*(.*)$")


class Display:
    """One status line per run: redrawn in place on a terminal, a line per phase otherwise."""

    def __init__(self, stream=None, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.verbose = verbose
        self.last = ""

    def status(self, text: str, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text[:118].ljust(118) + ("\n" if final else ""))
        elif final or self._phase(text) != self._phase(self.last):
            self.stream.write(text + "\n")
        self.last = text
        self.stream.flush()

    @staticmethod
    def _phase(text: str) -> tuple:
        """(run prefix, phase word): without a terminal a line is printed when either changes."""
        parts = text.split("  ")
        phase = parts[1] if len(parts) > 1 else ""
        m = re.match(r"(\w+) (\d+)/(\d+)$", phase)
        if m and m.group(2) == m.group(3):
            return (parts[0], phase)  # the last step of a phase gets its own line
        return (parts[0], phase.split(" ")[0])

    def passthrough(self, line: str) -> None:
        if self.verbose:
            if self.tty:
                self.stream.write("\r" + " " * 118 + "\r")
            self.stream.write("    | " + line + "\n")
            self.stream.flush()


def error_from_log(lines: list[str], returncode: int | None) -> str:
    """The most telling line of a failed run's output."""
    if returncode is None:
        return "timed out"
    for line in reversed(lines):
        m = EXC_RE.match(line.strip())
        if m and "Traceback" not in line:
            return line.strip()[:300]
    for line in reversed(lines):
        if line.startswith("paralab:") and ("error" in line or "failed" in line or "stopped" in line):
            return line.strip()[:300]
    tail = [line.strip() for line in lines if line.strip()]
    return (tail[-1][:300] if tail else f"exit code {returncode}")


def run_child(cmd: list[str], prefix: str, log: Path, timeout: float, display: Display) -> ChildResult:
    """Run ``cmd``, streaming its output to ``log`` and a status line; stop it after ``timeout`` s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    lines: list[str] = []
    q: queue.Queue = queue.Queue()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)

    def reader():
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=reader, daemon=True).start()
    phase = "starting"
    timed_out = False
    try:
        with open(log, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            while True:
                try:
                    line = q.get(timeout=0.5)
                except queue.Empty:
                    line = ""
                    if time.monotonic() - t0 > timeout:
                        timed_out = True
                        _stop(proc)
                        break
                    display.status(f"{prefix}  {phase}  {time.monotonic() - t0:5.1f}s")
                    continue
                if line is None:
                    break
                for part in line.split("\r"):
                    part = part.rstrip()
                    if not part:
                        continue
                    lines.append(part)
                    f.write(part + "\n")
                    display.passthrough(part)
                    m = PROGRESS_RE.match(part) or STEP_RE.match(part)
                    if m:
                        kind = m.group(1) if m.re is PROGRESS_RE else "train"
                        done, total = m.groups()[-2:]
                        phase = f"{kind} {done}/{total}"
                    elif part.startswith("check: training"):
                        phase = "check: reference"
                    elif part.startswith("records written"):
                        phase = "writing records"
                    display.status(f"{prefix}  {phase}  {time.monotonic() - t0:5.1f}s")
        proc.wait(timeout=30)
    except BaseException:
        _stop(proc)
        raise
    seconds = time.monotonic() - t0
    code = None if timed_out else proc.returncode
    if timed_out:
        with open(log, "a") as f:
            f.write(f"paralab compare: stopped after {timeout:.0f} s (--run-timeout)\n")
    error = None if code == 0 else error_from_log(lines, code)
    if timed_out:
        error = f"timed out after {timeout:.0f} s (--run-timeout)"
    return ChildResult(code, seconds, error, log)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a child we started and every process it started (its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ======================================================================== the matrix
def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers such as 1,2,4 (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} must be positive integers such as 1,2,4 (got {text!r})")
    return sorted(dict.fromkeys(values))


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"--train-args: {message}")


def train_namespace(argv: list[str]):
    """Parse a `paralab train` command line with the train command's own parser."""
    from ..cli import add_train_options
    p = _RaisingParser(prog="paralab train", add_help=False)
    p.add_argument("strategy")
    add_train_options(p)
    return p.parse_args(argv)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cores_per_worker(a, workers: list[int]) -> int | None:
    value = str(a.cores_per_worker).strip().lower()
    if value == "none":
        return None
    if value == "auto":
        per = available_cores() // max(workers)
        return per if per >= 1 else None
    try:
        per = int(value)
    except ValueError:
        raise UsageError(f"--cores-per-worker must be auto, none or a number (got {a.cores_per_worker!r})") from None
    if per < 1 or per * max(workers) > available_cores():
        raise UsageError(f"--cores-per-worker {per} x {max(workers)} workers needs {per * max(workers)} cores; "
                         f"this machine has {available_cores()} (use auto or none)")
    return per


def base_train_args(a) -> list[str]:
    args = ["--model", a.model, "--width", str(a.width), "--dataset", a.dataset, "--num-batches",
            str(a.num_batches), "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--bucket-mb", str(a.bucket_mb)]
    if a.data_dir:
        args += ["--data-dir", a.data_dir]
    if a.eval_batches:
        args += ["--eval-batches", str(a.eval_batches)]
    if a.check:
        args += ["--check"]
    if getattr(a, "pinned", None):
        args += ["--cores-per-worker", str(a.pinned)]
    return args


def plan(a) -> tuple[list[dict], list[str]]:
    """The runs to make (validated like `paralab train` would) and the combinations left out, with why."""
    from ..cli import config_from_args
    from ..strategies import get_strategy, strategy_names

    names = strategy_names()
    if a.strategies:
        wanted = [s.strip() for s in a.strategies.split(",") if s.strip()]
        for s in wanted:
            get_strategy(s)  # unknown name: UsageError listing the registered ones
    else:
        wanted = names
    explicit_workers = a.workers is not None
    workers = parse_int_list(a.workers or DEFAULTS["workers"], "--workers")
    a.pinned = cores_per_worker(a, workers)
    for name, value in (("--num-batches", a.num_batches), ("--batch-size", a.batch_size),
                        ("--microbatches", a.microbatches), ("--run-timeout", a.run_timeout),
                        ("--bucket-mb", a.bucket_mb)):
        if value is None or value <= 0:
            raise UsageError(f"{name} must be positive (got {value})")
    if a.width <= 0:
        raise UsageError(f"--width must be positive (got {a.width})")
    if a.eval_batches is not None and a.eval_batches < 0:
        raise UsageError("--eval-batches must be zero (whole test split) or positive")
    try:
        extra = shlex.split(a.train_args or "")
    except ValueError as exc:
        raise UsageError(f"--train-args: {exc}") from None
    owned = {"--out", "--workers", "--resume", "--world-size", "--rank"}
    clash = [x.split("=")[0] for x in extra if x.split("=")[0] in owned]
    if clash:
        raise UsageError(f"--train-args may not set {', '.join(clash)}: compare sets them for every run")

    runs, left_out = [], []
    for s in wanted:
        cls = get_strategy(s)
        for w in workers:
            if not explicit_workers and w == 1 and not getattr(cls, "data_parallel", True):
                left_out.append(f"{s} at 1 worker: splits the model, nothing to split (pass --workers to include)")
                continue
            argv = [s, "--workers", str(w)] + base_train_args(a) + PER_STRATEGY.get(s, lambda _: [])(a) + extra
            ns = train_namespace(argv)
            cfg = config_from_args(ns)
            try:
                cls.validate(cfg, w)
            except UsageError as exc:
                left_out.append(f"{s} at {w} worker{'s' if w > 1 else ''}: {exc}")
                continue
            try:
                cfg.validate()
            except UsageError as exc:
                raise UsageError(f"{s} at {w} worker(s): {exc}") from None
            runs.append({"strategy": s, "workers": w, "argv": argv, "name": f"{s}-w{w}"})
    if not runs:
        raise UsageError("nothing to run: " + "; ".join(left_out) if left_out else "nothing to run")
    return runs, left_out


def canonical_command(a) -> str:
    parts = ["paralab", "compare"]
    if a.strategies:
        parts += ["--strategies", a.strategies]
    parts += ["--workers", a.workers or DEFAULTS["workers"], "--num-batches", str(a.num_batches), "--batch-size",
              str(a.batch_size), "--width", str(a.width), "--model", a.model, "--dataset", a.dataset, "--lr",
              str(a.lr), "--eval-batches", str(a.eval_batches), "--microbatches", str(a.microbatches),
              "--bucket-mb", str(a.bucket_mb)]
    if a.data_dir:
        parts += ["--data-dir", a.data_dir]
    parts += ["--cores-per-worker", str(a.cores_per_worker)]
    parts.append("--check" if a.check else "--no-check")
    if a.train_args:
        parts.append(f"--train-args={a.train_args}")
    return shlex.join(parts)


def run(a) -> int:
    runs, left_out = plan(a)
    out = Path(a.out or Path("reports") / time.strftime("compare-%Y%m%d-%H%M%S"))
    if out.exists():
        raise UsageError(f"{out} already exists; pass another --out (or remove it)")
    display = Display(verbose=a.verbose)
    for note in left_out:
        print(f"compare: leaving out {note}", file=sys.stderr)
    if a.dry_run:
        for r in runs:
            print(shlex.join(["paralab", "train"] + r["argv"] + ["--out", str(out / "runs" / r["name"])]))
        return 0

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    started = time.time()
    print(f"compare: {len(runs)} runs -> {out}", file=sys.stderr)
    try:
        for i, r in enumerate(runs):
            run_dir = tmp / "runs" / r["name"]
            cmd = [sys.executable, "-m", "paralab", "train"] + r["argv"] + ["--out", str(run_dir)]
            r["command"] = shlex.join(["paralab", "train"] + r["argv"] + ["--out", str(out / "runs" / r["name"])])
            elapsed = time.time() - started
            eta = f", ~{elapsed / i * (len(runs) - i):.0f}s left" if i else ""
            prefix = f"[{i + 1}/{len(runs)}{eta}] {r['strategy']} w{r['workers']}"
            res = run_child(cmd, prefix, tmp / "logs" / f"{r['name']}.log", a.run_timeout, display)
            summary = _read_summary(run_dir)
            r.update(seconds=res.seconds, returncode=res.returncode, log=f"logs/{r['name']}.log",
                     run_dir=f"runs/{r['name']}" if summary else None)
            if summary is None:
                r.update(status="failed", error=res.error)
                verdict = f"FAILED ({res.error})"
            else:
                r.update(status="ok", error=summary.get("error"))
                check = (summary.get("check") or {}).get("result")
                spi = summary.get("seconds_per_iter")
                verdict = (f"ok, {spi:.3f} s/iter" if spi else "ok") + (f", check {check}" if check else "")
                if res.returncode not in (0, None) and not check == "FAIL":
                    verdict += f" (exit {res.returncode})"
            display.status(f"{prefix}  {verdict}  {res.seconds:.1f}s", final=True)
        wall = time.time() - started
        print("compare: drawing figures and writing the report", file=sys.stderr)
        from ..report import build_compare_report
        build_compare_report(tmp, runs, left_out, canonical_command(a), vars(a), wall, final_dir=out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"compare: stopped; nothing written to {out}", file=sys.stderr)
        raise
    os.replace(tmp, out)
    failed = [r for r in runs if r["status"] == "failed"]
    bad_checks = [r for r in runs if r["status"] == "ok" and r.get("returncode") not in (0, None)]
    print(f"compare: {len(runs) - len(failed)}/{len(runs)} runs finished in {time.time() - started:.0f}s; "
          f"report: {out / 'report.html'}", file=sys.stderr)
    _print_table(out)
    return 1 if failed or bad_checks else 0


def _read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _print_table(out: Path) -> None:
    from ..report import text_table
    data = json.loads((out / "results.json").read_text())
    print(text_table(data["headers"], data["rows"]))
