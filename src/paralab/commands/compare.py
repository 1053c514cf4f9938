"""Run every strategy at several worker counts and write one report.

Each run of the matrix is a run config handed to paralab's runner, which
trains it in a separate process (so a run that fails or hangs is stopped and
reported, and the rest still runs); its run directory lands under
REPORT/runs/, its full output under REPORT/logs/. Then:

  REPORT/report.html   self-contained page: results table, figures, commands,
                       config and environment (open it in any browser)
  REPORT/report.md     the same in Markdown (figures linked from plots/)
  REPORT/results.json  the table as data
  REPORT/plots/*.png   throughput, split time, scaling, timelines, memory
  REPORT/trace.json    every run in one Chrome/Perfetto trace: one process
                       per run, one track per rank (ui.perfetto.dev)

Defaults are sized for a 2-core laptop, under a minute in all (each run
is its own processes, forked from one warm parent that has imported torch
and paralab once, so a run's time is mostly its training):
  - the single-process baseline at 1 worker, every other registered strategy
    at 2, except where a strategy refuses a worker count (torch-dp without a
    GPU). Without --workers, the 1-worker runs of the others are left out: a
    data-parallel strategy's one replica is the baseline plus its flavour's
    overhead (kept when --strategies names the strategies: each then runs at
    1 and 2), and a strategy that splits the model has nothing to split;
    --workers 1,2 includes them (and every speedup is still over `single`);
  - VGG-11 at width 0.25, 10 steps of a 64-sample global batch, the first
    left out as warm-up; test evaluation bounded to 1 batch (500 samples);
  - lr 0.05 (enough for a test accuracy above chance in 10 steps; 0.1 moves
    BatchNorm's running statistics too far);
  - strategies that split the model run 4 microbatches where they take
    them (pipeline; model runs each batch whole); 0.5 MiB gradient buckets,
    so ddp's communication overlaps backward on this small model as 25 MiB
    buckets do on the full one;
  - every worker pinned to (cores // largest worker count) cores, 1 on a
    2-core machine, so a 2-worker run has twice the cores of a 1-worker run,
    as in CS744 where each worker is a machine (--cores-per-worker none: a
    lone worker uses every core instead);
  - fp32, and --check on: every run is compared with the single-process
    reference (the table's check column: weights, optimizer state, every
    step's loss, outputs); runs whose reference is the same (the same
    starting weights, batches and split: every data-parallel flavour at 2
    workers) share one, trained by the first of them; --no-check skips the
    check and runs faster. fp32 is the course setting's check; --precision
    fp64 makes it exact (and the runs slower).

The table follows CS744's Table 1: seconds per iteration (mean over steps
after the --warmup steps, slowest rank), global samples/s, speedup over
the single-process baseline (`single`), test loss and accuracy, check verdict.

examples:
  paralab compare
  paralab compare --strategies allreduce,ddp --workers 1,2,4 --num-batches 40
  paralab compare --strategies pipeline --workers 2 --train-args="--schedule 1f1b --partition params"
  paralab compare --strategies ddp --workers 2 --compress none,fp16,powersgd-r1,powersgd-r4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from .. import options
from ..run import folder
from ..options import finite_float
from ..run.config import ALL_OPTION_CLASSES, RunConfig, train_command
from ..errors import UsageError
# --compress LIST (its variants, the train options they set per run, which --train-args may not, and the
# steps before PowerSGD starts) is spelled where compression is: strategies/compression/methods.py
from ..strategies.compression import POWERSGD_START
from ..strategies.user import label as strategy_label
from ..strategies.compression import VARIANT_FIELDS as COMPRESS_OWNED
from ..strategies.compression import VARIANT_SPELLINGS as COMPRESS_SPELLINGS
from ..strategies.compression import parse_variants as parse_compress

#: the folder (in the report's, removed before it is final) where runs keep the references they share
CHECK_CACHE = "check-cache"
HELP = "run a matrix of strategies x workers; write a report (table, plots, HTML, trace)"

#: `paralab train` options compare takes too (flags and help from their declarations), in this order
TRAIN_OPTIONS = ("--num-batches", "--batch-size", "--width", "--model", "--dataset", "--lr", "--eval-batches",
                 "--microbatches", "--bucket-mb", "--data-dir", "--check", "--precision", "--network")
#: compare's defaults where they differ from `paralab train`'s (sized for a 2-core laptop: see above). It
#: measures time, so its runs are fp32, as CS744's: their check is fp32's course check (--precision fp64 for
#: an exact one; docs/correctness.md#the-default-precision)
DEFAULTS = dict(num_batches=10, batch_size=64, width=0.25, lr=0.05, eval_batches=1, microbatches=4, bucket_mb=0.5,
                check=True, precision="fp32")
WORKERS = "1,2"  # default worker counts
#: train options compare sets itself for every run (--train-args may not)
OWNED = ("out", "workers", "resume", "world_size", "rank", "check_cache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", help="comma-separated strategies (default: every registered one); a strategy "
                   "of your own is a file, PATH.py[:CLASS] (docs/own-strategy.md)")
    p.add_argument("--strategy-file", action="append", default=[], metavar="PATH.py[:CLASS]",
                   help="a strategy from your own file, compared beside --strategies (repeatable)")
    p.add_argument("--workers", default=None, help=f"comma-separated worker counts (default {WORKERS}: the strategies "
                   "that split the model at 2 only, and without --strategies the others too, the baseline at 1; "
                   "given, every strategy runs at each count it accepts)")
    options.add_flags(p, *ALL_OPTION_CLASSES, only=TRAIN_OPTIONS, defaults=DEFAULTS)
    p.add_argument("--cores-per-worker", default="auto",
                   help="cores pinned to each worker: auto (cores // the largest worker count, so every run "
                        "of the matrix gives a worker the same cores, like one machine per worker in CS744), "
                        "a number, or none (no pinning: one worker then uses every core)")
    p.add_argument("--compress", default="none", metavar="LIST",
                   help=f"gradient compression variants, comma-separated from {COMPRESS_SPELLINGS}; applies "
                        "to ddp and torch-ddp (as `paralab train --compress`), each of which runs once per "
                        "variant, the other strategies once, uncompressed; the table then shows each run's "
                        "variant and the MB each rank sent per step. PowerSGD starts after "
                        f"{POWERSGD_START} uncompressed steps, which are warm-up (default %(default)s)")
    p.add_argument("--share-references", action=argparse.BooleanOptionalAction, default=True,
                   help="with --check: runs whose single-process reference is the same (the same starting "
                        "weights, batches and split, by digest) share one, trained by the first of them "
                        "(`paralab train --check-cache`); --no-share-references trains one in every run")
    p.add_argument("--train-args", default="",
                   help='more `paralab train` options for every run, e.g. --train-args="--norm none"')
    p.add_argument("--out", help="report directory (default reports/compare-<time>)")
    p.add_argument("--run-timeout", type=finite_float, default=600.0,
                   help="seconds before a run is stopped and reported as failed (default %(default)s)")
    p.add_argument("--verbose", action="store_true", help="stream every run's full output")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")


# ======================================================================== train options as a config
def config_overrides(text: str, what: str = "--train-args", owned=(), owner: str = "compare") -> dict:
    """The RunConfig fields set by ``text``, written as `paralab train` options (user input such as
    ``--train-args="--norm none"``): {field: value} for the options given, and only those."""
    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from None
    given = RunConfig.given(tokens, what)
    clash = [options.flag(k) for k in given if k in owned]
    if clash:
        raise UsageError(f"{what} may not set {', '.join(clash)}: {owner} sets them for every run")
    return given


def sharing_references(cfg: RunConfig, report: Path, share: bool = True) -> RunConfig:
    """``cfg`` as the runner gets it: with ``--check``, keeping its reference in the report's folder of
    shared references (``check/kept.py``), which the command removes when it finishes. The command line
    shown for the run leaves it out: the same run, training its own reference, gives the same check."""
    return dataclasses.replace(cfg, check_cache=str(report / CHECK_CACHE)) if cfg.check and share else cfg


def changed_fields(cfg: RunConfig) -> dict:
    """The fields of ``cfg`` that differ from a bare RunConfig (what a run's record entry keeps)."""
    default = RunConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(default, f.name)}


# ======================================================================== the matrix
def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers such as 1,2,4 (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} must be positive integers such as 1,2,4 (got {text!r})")
    return sorted(dict.fromkeys(values))


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


def base_config(a) -> RunConfig:
    """What every run of the comparison shares (before --train-args)."""
    return RunConfig(model=a.model, width=a.width, dataset=a.dataset, data_dir=a.data_dir,
                     num_batches=a.num_batches, batch_size=a.batch_size, lr=a.lr,
                     eval_batches=a.eval_batches or None, check=a.check, precision=a.precision,
                     cores_per_worker=getattr(a, "pinned", None), network=getattr(a, "network", None))


def takes_option(cls, name: str) -> bool:
    """Whether strategy ``cls`` reads the option ``name``: one of the option classes it lists
    (``options``, see ``paralab.options``) declares it."""
    return any(name in {f.name for f in dataclasses.fields(c)} for c in getattr(cls, "options", ()))


class LeftOut(str):
    """One combination the comparison leaves out: it reads as its line (``LAYOUT: REASON (INCLUDE)``) and
    keeps its parts for the report's table (``layout``, ``reason`` in a line, the option that would
    ``include`` it, or "")."""

    def __new__(cls, layout: str, reason: str, include: str = ""):
        self = super().__new__(cls, f"{layout}: {reason}" + (f" ({include})" if include else ""))
        self.layout, self.reason, self.include = layout, reason, include
        return self


def composed_sharding_note(wanted: list[str], workers: list[int], overrides: dict) -> list[str]:
    """Sharded data parallelism composed with tp, pp or replica groups (a strategy whose class says
    ``hsdp``) needs a data-parallel dimension of 2 beside a second one of 2: 4 workers. Say so where the
    matrix holds fewer and --train-args composes nothing."""
    from ..mesh import MeshShape
    from ..strategies import get_strategy
    dims = {f.name for f in dataclasses.fields(MeshShape)}  # the mesh's dimensions, as options
    if max(workers) >= 4 or any(v > 1 for k, v in overrides.items() if k in dims):
        return []
    return [LeftOut(f"{s} composed with --tp 2, --pp 2 or --replicate 2",
                    f"each needs 2 data-parallel shards beside the other dimension, 4 workers ({max(workers)} hold "
                    "dp 1 there, nothing to shard; docs/hsdp.md)", f"--strategies {s} --workers 4 --train-args='--tp 2'")
            for s in wanted if getattr(get_strategy(s), "hsdp", False)]


def plan(a) -> tuple[list[dict], list[str]]:
    """The runs to make (each {strategy, workers, name, config: RunConfig}, validated as `paralab
    train` would validate it) and the combinations left out, with why."""
    from ..strategies import check_limit, get_strategy, strategy_names

    names = strategy_names()
    files = list(getattr(a, "strategy_file", None) or [])
    if a.strategies is not None or files:
        wanted = [s.strip() for s in (a.strategies or "").split(",") if s.strip()] + files
        if not wanted:
            raise UsageError(f"--strategies {a.strategies!r} names no strategy; name some (e.g. single,ddp), or "
                             "leave it out for every one")
        a.strategies = ",".join(wanted)  # one list from here on (the report's command and settings too)
        vars(a).pop("strategy_file", None)
        for s in wanted:
            get_strategy(s)  # unknown name: UsageError listing the registered ones
    else:
        wanted = names
    explicit_workers = a.workers is not None
    workers = parse_int_list(a.workers or WORKERS, "--workers")
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
    overrides = config_overrides(a.train_args, owned=OWNED)
    variants = parse_compress(getattr(a, "compress", "none"))
    variants_for = compression_plan(a, variants, overrides, [get_strategy(s) for s in wanted])
    base = base_config(a)

    runs, left_out = [], []
    for s in wanted:
        cls = get_strategy(s)
        for variant, fields in variants_for(cls):
            label = s if variant == "none" else f"{s} ({variant})"
            for w in workers:
                at = f"{label} at {w} worker{'s' if w > 1 else ''}"
                splits = not getattr(cls, "data_parallel", True)
                if not explicit_workers and w == 1 and "baseline" not in (getattr(cls, "roles", None) or ()) \
                        and (splits or not a.strategies):  # the whole default matrix: kept under 2 minutes
                    why = "splits the model, nothing to split" if splits else \
                        "one replica is the baseline plus this flavour's overhead"
                    note = LeftOut(f"{s} at 1 worker", why, "--workers 1,2")
                    if note not in left_out:  # once for all the strategy's variants
                        left_out.append(note)
                    continue
                cfg = dataclasses.replace(base, strategy=s, workers=w)
                for option, value in (("microbatches", a.microbatches), ("bucket_mb", a.bucket_mb)):
                    if takes_option(cls, option):  # set only where the strategy reads it
                        cfg = dataclasses.replace(cfg, **{option: value})
                cfg = dataclasses.replace(cfg, **{**overrides, **fields})
                if hasattr(cls, "for_devices"):  # one process driving w GPUs (torch-dp): w is --gpus
                    cfg = cls.for_devices(cfg, w)
                if getattr(cfg, "experts", 0) and not cls.moe:  # Strategy.moe: its loss has no load balancing
                    left_out.append(LeftOut(at, "does not train a mixture of experts (--experts) yet"))
                    continue
                try:
                    cls.validate(cfg, cfg.workers)
                except UsageError as exc:
                    left_out.append(LeftOut(at, str(exc)))
                    continue
                limit = check_limit(cfg, cfg.world) if a.check else None
                if limit:  # a checked comparison would show a FAIL that is not a bug
                    left_out.append(LeftOut(at, f"not checkable here in fp32: {limit}", "--precision fp64"))
                    continue
                try:
                    cfg.validate()
                except UsageError as exc:
                    raise UsageError(f"{at}: {exc}") from None
                short = strategy_label(s)  # a strategy of the user's own file: its stem, not its path
                name = f"{short}-w{w}" if variant == "none" else f"{short}-{variant}-w{w}"
                runs.append({"strategy": s, "workers": w, "name": name, "compress": variant, "config": cfg})
    left_out += composed_sharding_note(wanted, workers, overrides)
    names = [r["name"] for r in runs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:  # a strategy named like another's variant (x-fp16): run directories must differ
        raise UsageError(f"runs {', '.join(clash)} would share a directory: compare them in two commands")
    if not runs:
        raise UsageError("nothing to run: " + "; ".join(left_out) if left_out else "nothing to run")
    return runs, left_out


def compression_plan(a, variants: list[tuple[str, dict]], overrides: dict, classes):
    """Check --compress against the rest of the command; return ``variants_for(cls)``: the
    [(variant, RunConfig fields)] a strategy class runs (every variant where it takes
    --compress, else once uncompressed)."""
    given = [k for k in COMPRESS_OWNED if k in overrides]
    if given:
        flags = " and ".join("--" + k.replace("_", "-") for k in given)
        raise UsageError(f"--train-args may not set {flags}: compare's --compress LIST sets the compression "
                         "of each run (e.g. --compress none,fp16,powersgd-r2)")
    compressed = [v for v, _ in variants if v != "none"]
    if compressed and not any(takes_option(cls, "compress") for cls in classes):
        from ..strategies import get_strategy, strategy_names
        able = [n for n in strategy_names() if takes_option(get_strategy(n), "compress")]
        raise UsageError(f"--compress {','.join(compressed)}: none of the strategies compared compresses its "
                         f"gradients; those that do: {', '.join(able)}")
    start = overrides.get("powersgd_start_iter", POWERSGD_START)
    if any(f.get("compress") == "powersgd" for _, f in variants) and a.num_batches <= start:
        raise UsageError(f"--compress powersgd starts after {start} uncompressed steps: --num-batches must be "
                         f"more than {start} (got {a.num_batches})")

    def fields_for(fields: dict) -> dict:
        if fields.get("compress") != "powersgd":
            return fields
        warmup = overrides.get("warmup", max(RunConfig().warmup, start))
        return {**fields, "powersgd_start_iter": start, "warmup": warmup}

    every = [(v, fields_for(f)) for v, f in variants]

    def variants_for(cls) -> list[tuple[str, dict]]:
        return every if takes_option(cls, "compress") else [("none", {})]
    return variants_for


def canonical_command(a) -> str:
    parts = ["paralab", "compare"]
    if a.strategies:
        parts += ["--strategies", a.strategies]
    parts += ["--workers", a.workers or WORKERS, "--cores-per-worker", str(a.cores_per_worker)]
    given = {name: getattr(a, name, None) for name in map(options.name_of, TRAIN_OPTIONS)}
    parts += options.to_argv(given, ALL_OPTION_CLASSES, first=[k for k, v in given.items() if v is not None])
    variants = [v for v, _ in parse_compress(getattr(a, "compress", "none"))]
    if variants != ["none"]:
        parts += ["--compress", ",".join(variants)]
    if a.train_args:
        parts.append(f"--train-args={a.train_args}")
    return shlex.join(parts)


# ======================================================================== running the matrix
def run(a) -> int:
    from ..run import runner
    from ..progress import StatusLine

    runs, left_out = plan(a)
    out = Path(a.out or Path("reports") / time.strftime("compare-%Y%m%d-%H%M%S"))
    folder.refuse_taken(out)  # before the plan is printed: a dry run says so too
    for note in left_out:
        print(f"compare: leaving out {note}", file=sys.stderr)
    if a.dry_run:
        for r in runs:
            print(train_command(r["config"], out / "runs" / r["name"]))
        return 0

    display = StatusLine(verbose=a.verbose)
    # the report's folder, held while it is written (a second compare into it is refused) and written as the
    # runs finish: a compare stopped half-way leaves its finished runs there, never in a hidden folder
    held = folder.claim_new(out)
    signal.signal(signal.SIGTERM, terminated)  # `kill`: stopped as Ctrl-C stops it (its run too)
    started = time.time()
    print(f"compare: {len(runs)} runs -> {out}", file=sys.stderr)
    entries = []
    try:
        for i, r in enumerate(runs):
            cfg = r.pop("config")
            r["config"] = changed_fields(cfg)
            r["command"] = train_command(cfg, out / "runs" / r["name"])
            elapsed = time.time() - started
            eta = f", ~{elapsed / i * (len(runs) - i):.0f}s left" if i else ""
            variant = f" {r['compress']}" if r.get("compress", "none") != "none" else ""
            prefix = f"[{i + 1}/{len(runs)}{eta}] {r['strategy']} w{r['workers']}{variant}"
            res = runner.run(sharing_references(cfg, out, a.share_references), out / "runs" / r["name"], display.follow(prefix),
                             log=out / "logs" / f"{r['name']}.log", timeout=a.run_timeout,
                             on_output=display.passthrough)
            r.update(seconds=res.seconds, returncode=res.returncode, log=f"logs/{r['name']}.log",
                     run_dir=f"runs/{r['name']}" if res.ok else None)
            if not res.ok:
                error = res.error + (" (--run-timeout)" if res.status == "timeout" else "")
                r.update(status="failed", error=error)
                verdict = f"FAILED ({error})"
            else:
                r.update(status="ok", error=res.summary.get("error"))
                spi = res.summary.get("seconds_per_iter")
                verdict = (f"ok, {spi:.3f} s/iter" if spi else "ok") + (f", check {res.check}" if res.check else "")
                if res.returncode not in (0, None) and not res.check == "FAIL":
                    verdict += f" (exit {res.returncode})"
            display.final(prefix, verdict, res.seconds)
            entries.append(r)
        wall = time.time() - started
        print("compare: drawing figures and writing the report", file=sys.stderr)
        from ..report.page import build_compare_report
        # the runs are over: the figures are drawn on up to 4 cores, in children of the runs' forkserver
        build_compare_report(out, entries, left_out, canonical_command(a), vars(a), wall,
                             figure_processes=min(4, os.cpu_count() or 1))
        shutil.rmtree(out / CHECK_CACHE, ignore_errors=True)
    except BaseException:
        shutil.rmtree(out / CHECK_CACHE, ignore_errors=True)
        done = sum(1 for r in entries if r.get("run_dir"))
        print(f"compare: stopped; {done} finished run(s) kept in {out}/runs (no report)", file=sys.stderr)
        raise
    finally:
        held.release()
    failed = [r for r in entries if r["status"] == "failed"]
    bad_checks = [r for r in entries if r["status"] == "ok" and r.get("returncode") not in (0, None)]
    print(f"compare: {len(entries) - len(failed)}/{len(entries)} runs finished in {time.time() - started:.0f}s; "
          f"report: {out / 'report.html'}", file=sys.stderr)
    _print_table(out)
    return 1 if failed or bad_checks else 0


def terminated(signum, _frame):
    """SIGTERM: unwound as Ctrl-C is (the run going is stopped, what finished is kept), exit 128 + 15."""
    raise SystemExit(128 + signum)


def _print_table(out: Path) -> None:
    from ..report.page import text_table
    data = json.loads((out / "results.json").read_text())
    print(text_table(data["headers"], data["rows"]))
