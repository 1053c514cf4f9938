"""HPML Lab 4 studies: epoch time vs batch size, weak vs strong scaling, compute vs communication.

  batch-size  per-device batch 32, 128, 512, ... (x --factor) until a run runs
              out of memory or passes --max. Each run trains two "epochs" of
              --epoch-samples samples; the first is warm-up and left out; the
              table gives the second epoch's time without data loading (the
              `data` spans: batch assembly, augmentation and the copy to the
              device) and with it. (HPML Q1)
  scaling     the strategy at each worker count for each batch size, both ways:
              weak scaling (--per-worker-batch b: the global batch grows with
              the workers, HPML Q2) and strong scaling (--batch-size B: the
              global batch is fixed and split). Per setup: epoch time and
              speedup over 1 worker; compute vs communication per epoch,
              measured from the spans beside HPML's estimate (compute = T1/N,
              communication = TN - T1/N, Q3.1); bandwidth utilisation of the
              all-reduce (Q3.2).

An "epoch" here is --epoch-samples samples (default 2048, small enough for a
CPU); --epoch-samples 0 uses the whole training split (the real epoch).
Every run is a run config handed to paralab's runner (a process of its own);
the directory (default reports/sweep-<kind>-<time>) gets runs/, logs/,
sweep.json, report.md, report.html and a figure.

Large batches: --lr-scaling linear --warmup-epochs 1 apply Goyal et al.'s linear
scaling rule and gradual warm-up to every run (`paralab train` options; the
lr each step used follows paralab.training.lr_schedule.lr_at).

examples:
  paralab sweep batch-size --max 512
  paralab sweep scaling --strategy ddp --workers 1,2 --batch-sizes 32,128
  paralab sweep scaling --mode weak --batch-sizes 32,128,512 --workers 1,2,4
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from .. import options
from ..run import folder
from ..options import finite_float, integer
from ..run.config import ALL_OPTION_CLASSES, RunConfig
from ..errors import UsageError
from .compare import (CHECK_CACHE, terminated, changed_fields, config_overrides, cores_per_worker, parse_int_list,
                      sharing_references, train_command)

HELP = "HPML Lab 4 studies: batch-size sweep, weak vs strong scaling, compute vs communication"

#: the sweep's defaults where they differ from `paralab train`'s
DEFAULTS = dict(width=0.25, lr=0.02)
#: train options the sweep sets itself for every run (--train-args may not)
OWNED = ("out", "workers", "num_batches", "batch_size", "per_worker_batch", "warmup", "epochs", "cores_per_worker",
         "lr", "lr_scaling", "warmup_epochs", "check_cache")
OOM_RE = re.compile(r"out of memory|can't allocate memory|MemoryError|Cannot allocate memory|OutOfMemory",
                    re.IGNORECASE)


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="kind", required=True, metavar="KIND", parser_class=type(p))
    q = sub.add_parser("batch-size", help="epoch time vs per-device batch (HPML Q1)",
                       description="Per-device batch sizes growing by --factor from --start until a run runs "
                                   "out of memory or passes --max; second-epoch time without data loading.")
    q.add_argument("--strategy", help="strategy (default: the single-process baseline, single)")
    q.add_argument("--workers", type=integer, default=1, help="workers (default %(default)s)")
    q.add_argument("--sizes", help="explicit per-device batch sizes, e.g. 32,128,512 (instead of --start/--factor)")
    q.add_argument("--start", type=integer, default=32, help="first per-device batch (default %(default)s)")
    q.add_argument("--factor", type=integer, default=4, help="growth factor (default %(default)s)")
    q.add_argument("--max", type=integer, default=2048, help="largest per-device batch to try (default %(default)s)")
    _common(q)

    q = sub.add_parser("scaling", help="weak vs strong scaling, compute vs communication (HPML Q2-Q3)",
                       description="Each batch size at each worker count, as weak scaling (per-worker batch) "
                                   "and/or strong scaling (global batch): epoch time, speedup, compute vs "
                                   "communication, bandwidth utilisation.")
    q.add_argument("--strategy", default=None,
                   help="strategy (default: the data-parallel strategy registered for scaling studies, ddp)")
    q.add_argument("--workers", default="1,2", help="worker counts (default %(default)s)")
    q.add_argument("--batch-sizes", default="32,128",
                   help="per-worker batches (weak) / global batches (strong) (default %(default)s)")
    q.add_argument("--mode", default="both", choices=("weak", "strong", "both"),
                   help="weak, strong or both (default %(default)s)")
    _common(q)


def _common(q) -> None:
    q.add_argument("--epoch-samples", type=integer, default=2048,
                   help="samples per epoch (default %(default)s; 0 = the whole training split)")
    options.add_flags(q, *ALL_OPTION_CLASSES, only=("--model", "--width", "--dataset", "--data-dir", "--lr",
                                                    "--lr-scaling", "--warmup-epochs"), defaults=DEFAULTS)
    q.add_argument("--cores-per-worker", default="auto",
                   help="cores pinned to each worker: auto (cores // the largest worker count: a 1-worker run "
                        "gets the same cores as each worker of a larger one), a number, or none")
    options.add_flags(q, *ALL_OPTION_CLASSES, only=("--network",))
    q.add_argument("--train-args", default="", help='more `paralab train` options, e.g. --train-args="--norm none"')
    q.add_argument("--out", help="sweep directory (default reports/sweep-<kind>-<time>)")
    q.add_argument("--run-timeout", type=finite_float, default=900.0, help="seconds per run (default %(default)s)")
    q.add_argument("--verbose", action="store_true", help="stream every run's output")


# ======================================================================== epoch arithmetic
def train_size(cfg: RunConfig) -> int:
    """Training samples of the dataset ``cfg`` trains on (for --epoch-samples 0)."""
    from ..data import train_size as dataset_train_size
    return dataset_train_size(cfg.dataset, Path(cfg.data_dir) if cfg.data_dir else None, cfg.synthetic_size,
                              model=cfg.model, context=cfg.context, packing=cfg.packing,
                              doc_length=cfg.doc_length)


def steps_per_epoch(samples: int, global_batch: int) -> int:
    return max(1, math.ceil(samples / global_batch))


def epoch_times(run, steps: int) -> dict:
    """Second-epoch figures of a run that trained 2 x ``steps`` steps (slowest rank per step)."""
    second = [s for s in sorted({r["step"] for r in run.steps}) if s >= steps]
    if not second:
        return {}
    total = no_data = 0.0
    split_sum: dict[str, float] = {}
    ranks = sorted({r["rank"] for r in run.steps})
    for s in second:
        rows = run.step_rows(s)
        total += max(r["seconds"] for r in rows)
        no_data += max(r["seconds"] - r["split"].get("data", 0.0) for r in rows)
        for r in rows:
            for k, v in r["split"].items():
                split_sum[k] = split_sum.get(k, 0.0) + v / len(ranks)
    return {"epoch_s": total, "epoch_no_data_s": no_data, "steps": len(second), "split": split_sum}


# ======================================================================== the sweep
class Sweep:
    def __init__(self, a, kind: str):
        self.a = a
        self.kind = kind
        self.out = Path(a.out or Path("reports") / time.strftime(f"sweep-{kind}-%Y%m%d-%H%M%S"))
        folder.refuse_taken(self.out)
        if a.epoch_samples < 0:
            raise UsageError("--epoch-samples must be positive (or 0 for the whole training split)")
        if a.width <= 0 or a.lr <= 0 or a.run_timeout <= 0:
            raise UsageError("--width, --lr and --run-timeout must be positive")
        self.extra = config_overrides(a.train_args, owned=OWNED, owner="the sweep")
        from ..progress import StatusLine
        self.display = StatusLine(verbose=a.verbose)
        self.pinned = None
        self.entries: list[dict] = []
        self.held = None  # the report's folder, held while the sweep writes it (run/folder.py)

    def base(self) -> RunConfig:
        """What every run of the sweep shares: the data and model options, then --train-args."""
        a = self.a
        cfg = RunConfig(model=a.model, width=a.width, dataset=a.dataset, data_dir=a.data_dir, lr=a.lr,
                        lr_scaling=a.lr_scaling, warmup_epochs=a.warmup_epochs, eval_batches=1,
                        eval_batch_size=100, cores_per_worker=self.pinned, network=getattr(a, "network", None))
        return dataclasses.replace(cfg, **self.extra)

    def config(self, strategy: str, workers: int, batch: int, steps: int, per_worker: bool) -> RunConfig:
        """Two epochs of ``steps`` steps, the first left out as warm-up; ``batch`` per worker
        (weak scaling) or global (strong scaling)."""
        batch_field = {"per_worker_batch": batch} if per_worker else {"batch_size": batch}
        cfg = dataclasses.replace(self.base(), strategy=strategy, workers=workers, num_batches=2 * steps,
                                  warmup=steps, log_every=max(steps, 1), **batch_field)
        from ..strategies import get_strategy
        cls = get_strategy(strategy)
        if hasattr(cls, "for_devices"):  # one process driving `workers` GPUs (torch-dp): they are its --gpus
            cfg = cls.for_devices(cfg, workers, per_device_batch=batch if per_worker else None)
        cfg.validate()
        return cfg

    def start(self) -> None:
        """Hold the report's folder and write into it as runs finish: a sweep stopped half-way leaves its
        finished runs there (never in a hidden folder); a second command into it is refused. SIGTERM stops
        it as Ctrl-C does."""
        self.held = folder.claim_new(self.out)
        signal.signal(signal.SIGTERM, terminated)

    def run(self, name: str, cfg: RunConfig, index: str) -> dict:
        from ..run import runner
        from ..analysis.runs import load_run
        run_dir = self.out / "runs" / name
        prefix = f"[{index}] {name}"
        res = runner.run(sharing_references(cfg, self.out), run_dir, self.display.follow(prefix), log=self.out / "logs" / f"{name}.log",
                         timeout=self.a.run_timeout, on_output=self.display.passthrough)
        entry = {"name": name, "config": changed_fields(cfg), "seconds": res.seconds, "returncode": res.returncode,
                 "command": train_command(cfg, self.out / "runs" / name), "log": f"logs/{name}.log"}
        if res.ok and res.returncode == 0:
            entry.update(status="ok", run_dir=f"runs/{name}", run=load_run(run_dir))
            verdict = f"ok, {entry['run'].seconds_per_iter:.3f} s/iter"
        else:
            error = res.error or f"exit code {res.returncode}"
            oom = res.status != "timeout" and bool(OOM_RE.search(error) or res.signal == 9
                                                   or res.returncode in (-9, 137))
            entry.update(status="oom" if oom else "failed", error=error)
            verdict = ("OUT OF MEMORY" if oom else "FAILED") + f" ({error})"
        self.display.final(prefix, verdict, res.seconds)
        self.entries.append(entry)
        return entry

    def finish(self, report, data: dict) -> Path:
        page, md = report.write(self.out)
        data["entries"] = [{k: v for k, v in e.items() if k != "run"} for e in self.entries]
        (self.out / "sweep.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        shutil.rmtree(self.out / CHECK_CACHE, ignore_errors=True)
        self.held.release()
        return self.out

    def abort(self) -> None:
        if self.held is not None:
            shutil.rmtree(self.out / CHECK_CACHE, ignore_errors=True)
            done = sum(1 for e in self.entries if e["status"] == "ok")
            print(f"sweep: stopped; {done} finished run(s) kept in {self.out}/runs (no report)", file=sys.stderr)
            self.held.release()


def run(a) -> int:
    if a.kind == "batch-size":
        return sweep_batch_size(a)
    return sweep_scaling(a)


def _epoch_samples(sw: Sweep) -> tuple[int, str]:
    a = sw.a
    if a.epoch_samples:
        return a.epoch_samples, f"{a.epoch_samples} samples (--epoch-samples)"
    n = train_size(sw.base())
    return n, f"the whole training split, {n} samples"


def baseline() -> str | None:
    """The single-process strategy (sweeps' 1-worker point and batch-size default)."""
    from ..strategies import strategy_for
    return strategy_for("baseline")


# ======================================================================== batch size (Q1)
def sweep_batch_size(a) -> int:
    from ..report.page import Report, text_table
    from ..strategies import get_strategy
    a.strategy = a.strategy or baseline()
    if not a.strategy:
        raise UsageError("pass --strategy (no single-process strategy is registered)")
    cls = get_strategy(a.strategy)
    if a.workers < 1:
        raise UsageError("--workers must be positive")
    if a.sizes:
        sizes = parse_int_list(a.sizes, "--sizes")
    else:
        if a.start < 1 or a.factor < 2 or a.max < a.start:
            raise UsageError("need --start >= 1, --factor >= 2 and --max >= --start")
        sizes, b = [], a.start
        while b <= a.max:
            sizes.append(b)
            b *= a.factor
    sw = Sweep(a, "batch-size")
    sw.pinned = cores_per_worker(a, [a.workers])
    samples, what = _epoch_samples(sw)
    plans = []
    for b in sizes:
        gb = b * a.workers if getattr(cls, "data_parallel", True) else b
        steps = steps_per_epoch(samples, gb)
        plans.append((b, steps, sw.config(a.strategy, a.workers, b, steps, per_worker=True)))
    print(f"sweep batch-size: {a.strategy} on {a.workers} worker(s), per-device batch {', '.join(map(str, sizes))}; "
          f"epoch = {what}; 2 epochs per run, the first is warm-up", file=sys.stderr)
    sw.start()
    rows, stopped = [], None
    try:
        for i, (b, steps, cfg) in enumerate(plans):
            e = sw.run(f"b{b}", cfg, f"{i + 1}/{len(plans)}")
            if e["status"] != "ok":
                rows.append([b, steps, "-", "-", "-", "-", e["status"] + ": " + (e.get("error") or "")])
                stopped = b
                break
            t = epoch_times(e["run"], steps)
            e["epoch"] = t
            rows.append([b, steps, f"{t['epoch_no_data_s']:.3f}", f"{t['epoch_s']:.3f}",
                         f"{t['epoch_no_data_s'] / t['steps'] * 1000:.1f}",
                         f"{samples / t['epoch_s']:.0f}" if t["epoch_s"] else "-", ""])
        headers = ["batch/device", "steps/epoch", "epoch s (no data)", "epoch s (all)", "ms/step (no data)",
                   "samples/s", "note"]
        rep = Report(f"paralab sweep batch-size: {a.strategy}, {a.workers} worker(s)")
        sec = rep.section("Epoch time vs batch size (HPML Lab 4 Q1)")
        sec.para(f"Each run trains two epochs of {what}; the table is the second epoch (the first warms caches up). "
                 "'no data' leaves out the data spans (batch assembly, augmentation, copy to the device).")
        sec.table(headers, rows)
        if stopped is not None:
            sec.para(f"Stopped at per-device batch {stopped}: " + (
                "it did not fit in memory." if sw.entries[-1]["status"] == "oom" else "the run failed (see logs/)."))
        ok = [e for e in sw.entries if e["status"] == "ok"]
        if ok:
            from ..report.plots import plot_epoch_time
            fig = plot_epoch_time([(int(e["name"][1:]), e["epoch"]) for e in ok], sw.out / "epoch_time.png")
            sec.figure(fig, "epoch_time.png", "Second-epoch time vs per-device batch size.")
        rep.section("Commands").code("\n".join(e["command"] for e in sw.entries))
        out = sw.finish(rep, {"kind": "batch-size", "headers": headers, "rows": rows, "epoch_samples": samples})
    except BaseException:
        sw.abort()
        raise
    print(text_table(headers, rows))
    print(f"sweep: written to {out}", file=sys.stderr)
    return 0 if all(e["status"] in ("ok", "oom") for e in sw.entries) else 1


# ======================================================================== scaling (Q2, Q3)
def sweep_scaling(a) -> int:
    from ..analysis.cost import bandwidth_utilisation
    from ..report.page import Report, text_table
    from ..strategies import strategy_for
    from ..strategies import get_strategy
    strategy = a.strategy or strategy_for("scaling")
    if not strategy:
        raise UsageError("pass --strategy (no strategy is registered for scaling studies)")
    cls = get_strategy(strategy)
    if not getattr(cls, "data_parallel", True):
        raise UsageError(f"sweep scaling studies data parallelism; {strategy} splits the model "
                         "(use paralab compare for it)")
    workers = parse_int_list(a.workers, "--workers")
    sizes = parse_int_list(a.batch_sizes, "--batch-sizes")
    modes = ["weak", "strong"] if a.mode == "both" else [a.mode]
    sw = Sweep(a, "scaling")
    sw.pinned = cores_per_worker(a, workers)
    samples, what = _epoch_samples(sw)
    one = baseline()
    plans = []
    for mode in modes:
        for b in sizes:
            for w in workers:
                strat = one if w == 1 and one else strategy
                gb = b * w if mode == "weak" else b
                if mode == "strong" and b % w:
                    raise UsageError(f"strong scaling splits --batch-sizes {b} over {w} workers: pick sizes "
                                     "divisible by every worker count")
                steps = steps_per_epoch(samples, gb)
                plans.append((mode, b, w, steps, sw.config(strat, w, b, steps, per_worker=mode == "weak")))
    print(f"sweep scaling: {strategy} ({', '.join(modes)}), workers {a.workers}, batch sizes {a.batch_sizes}; "
          f"epoch = {what}" + (f"; 1 worker runs `{one}`" if one and one != strategy else ""), file=sys.stderr)
    sw.start()
    results: dict[tuple, dict] = {}
    try:
        for i, (mode, b, w, steps, cfg) in enumerate(plans):
            key = (mode, b, w)
            e = sw.run(f"{mode}-b{b}-w{w}", cfg, f"{i + 1}/{len(plans)}")
            if e["status"] == "ok":
                e["epoch"] = epoch_times(e["run"], steps)
                results[key] = e
        rep = Report(f"paralab sweep scaling: {strategy}")
        tables = {}
        for mode in modes:
            # HPML Table 1: time and speedup per batch size and worker count
            headers = ["workers"] + [h for b in sizes for h in (f"b={b} epoch s", f"b={b} speedup")]
            rows = []
            for w in workers:
                row = [w]
                for b in sizes:
                    e, base = results.get((mode, b, w)), results.get((mode, b, workers[0]))
                    if e and base:
                        t = e["epoch"]["epoch_s"]
                        row += [f"{t:.3f}", f"{base['epoch']['epoch_s'] / t:.2f}"]
                    else:
                        row += ["-", "-"]
                rows.append(row)
            cap = (f"{mode} scaling: " + ("batch b per worker, global batch b x N; " if mode == "weak" else
                                          "global batch b split over N workers; ")
                   + f"epoch time (all components) and speedup = T({workers[0]} worker{'s' if workers[0] > 1 else ''}) / T(N)")
            sec = rep.section(f"{mode.capitalize()} scaling (HPML Lab 4 Q2)")
            sec.table(headers, rows, cap)
            tables[f"{mode}_speedup"] = {"headers": headers, "rows": rows}
            print(cap)
            print(text_table(headers, rows))
            print()
            # HPML Table 2: compute vs communication, measured and estimated
            headers2 = ["workers", "batch", "compute s (measured)", "comm s (measured)", "compute s (T1/N)",
                        "comm s (TN - T1/N)", "util GB/s"]
            rows2 = []
            for b in sizes:
                base = results.get((mode, b, 1))
                for w in workers:
                    e = results.get((mode, b, w))
                    if not e or w == 1:
                        continue
                    sp = e["epoch"]["split"]
                    compute = sp.get("compute", 0) + sp.get("optimizer", 0) + sp.get("data", 0)
                    comm = sp.get("comm", 0) + sp.get("idle", 0)
                    est_c = est_m = "-"
                    if base:
                        t1 = base["epoch"]["epoch_s"]
                        # weak: the N workers share the epoch's steps; strong: each step is 1/N the work
                        c = t1 / w
                        est_c, est_m = f"{c:.3f}", f"{e['epoch']['epoch_s'] - c:.3f}"
                    util = "-"
                    op = (e["run"].get("comm_ops") or {}).get("all_reduce")
                    if op and op.get("seconds"):
                        n_steps = max(e["run"].get("measured_steps") or 1, 1)
                        u = bandwidth_utilisation(op["bytes_per_step"], w, op["seconds"] / n_steps / w)
                        util = f"{u.value:.3f}"
                    rows2.append([w, b, f"{compute:.3f}", f"{comm:.3f}", est_c, est_m, util])
            if rows2:
                cap2 = (f"{mode} scaling, per epoch: compute (data + compute + optimizer spans) and communication "
                        "(blocking comm + waits) measured from the spans, beside HPML's estimate from the 1-worker "
                        "time; util = 2(N-1)/N x S / T_allreduce (Q3.2)")
                sec.table(headers2, rows2, cap2)
                tables[f"{mode}_compute_comm"] = {"headers": headers2, "rows": rows2}
                print(cap2)
                print(text_table(headers2, rows2))
                print()
        fig = _plot_speedup(sw.out / "speedup.png", results, modes, sizes, workers, strategy)
        if fig:
            rep.section("Speedup").figure(fig, "speedup.png", "Speedup over 1 worker; dashed: ideal (N).")
        failed = [e for e in sw.entries if e["status"] != "ok"]
        if failed:
            sec = rep.section("Failed runs")
            for e in failed:
                sec.para(f"{e['name']}: {e['status']}: {e.get('error')} (see {e['log']})")
        rep.section("Commands").code("\n".join(e["command"] for e in sw.entries))
        out = sw.finish(rep, {"kind": "scaling", "strategy": strategy, "tables": tables, "epoch_samples": samples})
    except BaseException:
        sw.abort()
        raise
    print(f"sweep: written to {out}", file=sys.stderr)
    return 0 if all(e["status"] == "ok" for e in sw.entries) else 1


def _plot_speedup(path, results, modes, sizes, workers, strategy):
    """Speedup over the first worker count, one curve per mode and batch size."""
    from ..report.plots import plot_speedup
    if len(workers) < 2:
        return None
    curves = []
    for mode in modes:
        for b in sizes:
            base = results.get((mode, b, workers[0]))
            pts = [(w, base["epoch"]["epoch_s"] / results[(mode, b, w)]["epoch"]["epoch_s"])
                   for w in workers if base and (mode, b, w) in results]
            if pts:
                curves.append((f"{mode}, b={b}", "o-" if mode == "weak" else "s--", pts))
    return plot_speedup(curves, workers, f"{strategy}: weak vs strong scaling",
                        f"speedup over {workers[0]} worker(s) (epoch time ratio)", path)
