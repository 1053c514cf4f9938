"""What the benchmark scripts share: options, ``paralab train`` runs, step times, the result file.

- :func:`training_options` / :func:`parse_runs`: the options of a benchmark that
  trains one model under several strategies (dp.py, fsdp.py), in their order;
- :func:`paralab_train`: one ``paralab train ...`` from ``src``, in a child of
  a warm forkserver; :func:`train` adds those options' values
  (synthetic data sized to the run, a bounded evaluation, no progress bar)
  and returns the run's summary.json and steps.jsonl rows;
- :func:`selected`, :func:`interleaved`, :func:`best_of`: the names asked
  for, each run R times, interleaved, so that a disturbance on the machine
  hits them alike, and each one's best run;
- :func:`step_seconds`: the slowest rank's time of each step after warm-up;
- :func:`cpu_name`: the machine a result came from;
- :func:`write_result`: the JSON result file.

Not a benchmark itself (``bench/run.py`` runs only the names it lists).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
RESULTS = HERE / "results"


def training_options(prog: str, doc: str, *, each: str, warmup_help: str) -> argparse.ArgumentParser:
    """A parser with --model ... --cores-per-worker; the script adds its own options, then calls :func:`parse_runs`.

    ``each``: what one run is ("strategy", "variant"); ``doc``: the script's docstring (its first line
    describes the command).
    """
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--model", default="vgg11")
    p.add_argument("--width", type=float, default=1.0, help="channel multiplier (0.25 for a quick run)")
    p.add_argument("--batch-size", type=int, default=256, help=f"global batch, the same for every {each}")
    p.add_argument("--steps", type=int, default=5, help="training steps per run")
    p.add_argument("--warmup", type=int, default=1, help=warmup_help)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores-per-worker", type=int, default=1)
    return p


def parse_runs(p: argparse.ArgumentParser, argv: list[str], bench: str, *, repeats: int, repeats_help: str,
               select: str, choices: tuple[str, ...]) -> argparse.Namespace:
    """Adds --repeats, the ``select`` option (comma-separated, default: all ``choices``) and --out
    (default ``bench/results/<bench>.json``), then parses ``argv``."""
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument(select, default=",".join(choices))
    p.add_argument("--out", default=str(RESULTS / f"{bench}.json"))
    return p.parse_args(argv)


def selected(text: str, choices: tuple[str, ...], what: str) -> list[str] | None:
    """The comma-separated names in ``text``; None (the reason printed) if one is not in ``choices``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown:
        print(f"unknown {what} {unknown}; choose from {', '.join(choices)}", file=sys.stderr)
        return None
    return names


def interleaved(bench: str, names: list[str], repeats: int,
                run: Callable[[str, Path, str], dict]) -> dict[str, list[dict]] | None:
    """``run(name, workdir, tag)`` for every name, ``repeats`` rounds (tag: the round), in one temporary folder.

    Returns each name's results in round order; None (the error printed) when a run raises RuntimeError.
    """
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix=f"paralab-bench-{bench}-") as tmp:
        for rep in range(repeats):
            for name in names:
                print(f"bench {bench}: {name} (run {rep + 1}/{repeats}) ...", flush=True)
                try:
                    runs[name].append(run(name, Path(tmp), str(rep)))
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    return None
    return runs


def best_of(bench: str, names: list[str], repeats: int,
            run: Callable[[str, Path, str], dict]) -> tuple[dict, dict, dict] | None:
    """:func:`interleaved`, then each name's fastest run (``samples_per_s``): the one least disturbed by
    anything else on the machine. Returns (every run, the best, the machine around them: load averages
    before and after, wall seconds, cores), or None when a run failed (the error printed)."""
    machine = {"cpu_count": os.cpu_count(), "load_average_before": os.getloadavg()}
    started = time.time()
    runs = interleaved(bench, names, repeats, run)
    if runs is None:
        return None
    machine |= {"load_average_after": os.getloadavg(), "wall_s": time.time() - started}
    return runs, {n: max(r, key=lambda x: x["samples_per_s"]) for n, r in runs.items()}, machine


def paralab_train(argv: list[str], out: Path, *, env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``paralab train ARGV --out OUT`` from ``src``, ``env`` added, output captured: a child of this process's
    warm forkserver (``paralab.run.warm.start``, as ``compare`` starts its runs), so a benchmark of many runs
    imports torch once, not once per run. What a run measures starts after its warm-up steps, so where it
    started does not change it; ``bench/startup.py`` times the starts themselves, cold and warm."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from paralab.cli import main
    from paralab.run import runner
    cmd = ["paralab", "train", *argv, "--out", str(out)]
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = runner.call(main, (cmd[1:],), env=env, cwd=cwd or os.getcwd())
    return subprocess.CompletedProcess(cmd, done.exitcode, done.stdout, done.stderr)


def train(label: str, strategy: list[str], args: argparse.Namespace, out: Path, *, workers: int | None = None,
          options: tuple[str, ...] | list[str] = (), env: dict[str, str] | None = None) -> tuple[dict, list[dict]]:
    """One run of ``strategy`` (its name and its own options) with the values of :func:`training_options`.

    ``workers`` overrides ``args.workers``; ``options`` are further ``paralab train`` options; with
    ``args.cores_per_worker`` None the workers are not pinned (they share the cores). Synthetic data
    of max(1024, batch x steps) samples, evaluation on one batch of 100, no progress bar, one log line.
    Returns (summary.json, the rows of steps.jsonl); raises RuntimeError with the end of stderr if it fails.
    """
    cores = ["--cores-per-worker", str(args.cores_per_worker)] if args.cores_per_worker else []
    argv = [*strategy, "--workers", str(args.workers if workers is None else workers),
            *cores, "--model", args.model, "--width", str(args.width),
            "--batch-size", str(args.batch_size), "--num-batches", str(args.steps), "--warmup", str(args.warmup),
            *options, "--dataset", "synthetic",
            "--synthetic-size", str(max(1024, args.batch_size * args.steps)), "--eval-batches", "1",
            "--eval-batch-size", "100", "--no-progress", "--log-every", str(args.steps)]
    p = paralab_train(argv, out, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    summary = read_summary(out)
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return summary, rows



def read_summary(out: Path) -> dict:
    """A run's summary.json as paralab's readers see it: with the predictions beside what it measured (a run
    writes none itself: paralab.analysis.beside)."""
    from paralab.analysis.runs import load_run
    return load_run(out).summary

def gpt_options(p: argparse.ArgumentParser, *, layers: int, embed: int, heads: int, context: int) -> None:
    """The gpt's shape options (--layers --embed --heads --context) with a benchmark's defaults."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--embed", type=int, default=embed)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--context", type=int, default=context)


def gpt_args(args: argparse.Namespace) -> list[str]:
    """The ``paralab train`` options of the gpt of :func:`gpt_options`'s values."""
    return ["--model", "gpt", "--layers", str(args.layers), "--embed", str(args.embed), "--heads", str(args.heads),
            "--context", str(args.context)]


def train_gpt(label: str, argv: list[str], args: argparse.Namespace, out: Path,
              data: tuple[str, ...] = ("--dataset", "synthetic-text")) -> tuple[dict, list[dict], list[str]]:
    """:func:`train`'s twin for the gpt: ``argv`` (the strategy, its workers and options) on the gpt of
    :func:`gpt_options`' values, ``args.batch_size``, ``args.steps`` (``args.warmup`` left out), synthetic text of
    max(1024, batch x steps) windows (``data``: other data options), evaluation on one batch, no progress bar,
    one log line.
    Returns (summary.json, the rows of steps.jsonl, the whole argv); raises RuntimeError if it fails."""
    argv = [*argv, *gpt_args(args), "--batch-size", str(args.batch_size), "--num-batches", str(args.steps),
            "--warmup", str(args.warmup), *data,
            "--synthetic-size", str(max(1024, args.batch_size * args.steps)), "--eval-batches", "1",
            "--eval-batch-size", str(args.batch_size), "--no-progress", "--log-every", str(args.steps)]
    p = paralab_train(argv, out)
    if p.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    summary = read_summary(out)
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return summary, rows, argv


def step_seconds(rows: list[dict], warmup: int) -> list[float]:
    """The slowest rank's seconds of each step (steps.jsonl rows), in step order, leaving out the first
    ``warmup`` steps (all of them kept if that would leave none, as summary.json does)."""
    steps = sorted({r["step"] for r in rows})
    measured = [st for st in steps if st >= steps[0] + warmup] or steps
    return [max(r["seconds"] for r in rows if r["step"] == st) for st in measured]


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` gives it ("unknown" where it cannot be read)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def write_result(path: str | Path, result: dict) -> Path:
    """Writes ``result`` as indented JSON to ``path`` (folders made as needed); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out
