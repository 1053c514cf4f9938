"""Reading run directories: the only input of plots, reports and run analyses.

A run directory (see DESIGN.md) holds ``config.json``, ``summary.json``,
``steps.jsonl`` and ``spans.jsonl``. :func:`load_run` reads one lazily (the
span file can be large) and refuses, with a message saying what to pass
instead, anything that is not a finished run.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..kinds import UNCOUNTED_COMM
from ..strategies.compression import run_label as compression_of  # a config dict's compression: fp16, powersgd r2
from .beside import add_predictions
from .timeline import measured_steps

CATEGORIES = ("data", "compute", "comm", "optimizer", "idle", "other")


@dataclass
class Run:
    path: Path
    config: dict
    summary: dict
    _steps: list | None = field(default=None, repr=False)
    _spans: list | None = field(default=None, repr=False)

    # ------------------------------------------------------------ identity
    @property
    def strategy(self) -> str:
        return self.summary.get("strategy") or self.config.get("strategy", "?")

    @property
    def workers(self) -> int:
        return int(self.summary.get("workers") or self.config.get("workers") or 1)

    @property
    def label(self) -> str:
        """``strategy wN``, plus the schedule and microbatches of a pipeline that pipelines
        (its stages report a schedule over more than one microbatch) and the gradient compression
        of a compressed run (``ddp w2 powersgd r2``)."""
        extra = ""
        pipe = self.pipeline
        if pipe and pipe["microbatches"] > 1:
            extra = f" {pipe['schedule']} m{pipe['microbatches']}"
        compression = self.compression
        return f"{shown(self.strategy)} w{self.workers}{extra}" + (f" {compression}" if compression else "")

    @property
    def compression(self) -> str | None:
        """What ``--compress`` made the gradient buckets send (``fp16``, ``powersgd r2``), or None."""
        return compression_of(self.config)

    @property
    def series(self) -> str:
        """The strategy, with its gradient compression where it has one (``ddp (powersgd r2)``):
        runs that differ only in worker count are one series of a scaling plot or a table."""
        return series_of(self.strategy, self.config)

    @property
    def name(self) -> str:
        return self.path.name

    # ------------------------------------------------------------ figures
    def get(self, key, default=None):
        return self.summary.get(key, default)

    @property
    def seconds_per_iter(self) -> float | None:
        return self.summary.get("seconds_per_iter")

    @property
    def samples_per_s(self) -> float | None:
        return self.summary.get("samples_per_s")

    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in (self.summary.get("split") or {}))

    def split(self, rank: int) -> dict:
        return (self.summary.get("split") or {}).get(str(rank), {})

    @property
    def environment(self) -> dict:
        return self.config.get("environment", {})

    @property
    def details(self) -> dict:
        """``strategy_details`` of summary.json: per rank (string keys), strategy-specific figures."""
        return self.summary.get("strategy_details") or {}

    def rank_details(self, rank: int) -> dict:
        d = self.details.get(str(rank))
        return d if isinstance(d, dict) else {}

    # ------------------------------------------------------------ what the records hold
    # Plots, reports and calculations choose what to show from these, never from the
    # strategy's name: a new strategy that records the same things is drawn the same way.
    @property
    def stages(self) -> dict[int, int]:
        """rank -> pipeline stage, for runs whose ranks report a ``stage`` (the model is split)."""
        out = {}
        for key, d in self.details.items():
            if isinstance(d, dict) and isinstance(d.get("stage"), int) and not isinstance(d["stage"], bool):
                out[int(key)] = d["stage"]
        return dict(sorted(out.items()))

    @property
    def num_stages(self) -> int:
        return len(set(self.stages.values()))

    @property
    def pipeline(self) -> dict | None:
        """``{"schedule", "microbatches", "stages"}`` where the stages report their schedule, else None.

        ``schedule`` is what the stages recorded (e.g. ``gpipe``, ``1f1b``; a stage that runs each
        batch whole may say ``naive``); ``microbatches`` at least 1.
        """
        stages = self.stages
        if not stages:
            return None
        d = self.rank_details(next(iter(stages)))
        schedule = d.get("schedule")
        if not isinstance(schedule, str):
            return None
        try:
            m = max(1, int(d.get("microbatches") or 1))
        except (TypeError, ValueError):
            m = 1
        return {"schedule": schedule, "microbatches": m, "stages": self.num_stages}

    @property
    def bubbles(self) -> dict[int, float]:
        """rank -> measured bubble (idle / step time), where the ranks report one."""
        out = {}
        for key, d in self.details.items():
            b = d.get("bubble") if isinstance(d, dict) else None
            if isinstance(b, (int, float)) and not isinstance(b, bool):
                out[int(key)] = float(b)
        return dict(sorted(out.items()))

    @property
    def bytes_sent_per_step(self) -> float | None:
        """Bytes the busiest rank sent per measured step (summary.json ``comm_bytes``: what crossed
        ``comm.py``), or None where that is not known: not recorded, or some rank communicated
        outside ``comm.py`` (``kinds.UNCOUNTED_COMM`` in its details). A one-rank run sends nothing:
        its collectives (recorded with their buffers' sizes) run on a group of one."""
        if self.workers == 1:
            return 0.0
        sent = self.summary.get("comm_bytes")
        if not sent or any(_says_uncounted(d) for d in self.details.values()):
            return None
        return max(sent.values())

    @property
    def overlaps_communication(self) -> bool:
        """Some rank ran communication asynchronously, overlapped with its computation."""
        return any(self.split(k).get("comm_async", 0) > 0 for k in self.ranks)

    # ------------------------------------------------------------ records
    @property
    def steps(self) -> list[dict]:
        if self._steps is None:
            self._steps = read_jsonl(self.path / "steps.jsonl")
        return self._steps

    @property
    def spans(self) -> list[dict]:
        if self._spans is None:
            self._spans = read_jsonl(self.path / "spans.jsonl")
        return self._spans

    def measured_steps(self) -> list[int]:
        """Steps that count in averages: all after the first ``warmup`` (``timeline.measured_steps``)."""
        warm = int(self.summary.get("warmup", self.config.get("warmup", 1)) or 0)
        return measured_steps([r["step"] for r in self.steps], warm)

    def step_spans(self, step: int) -> list[dict]:
        return [s for s in self.spans if s["step"] == step]

    def step_rows(self, step: int) -> list[dict]:
        return [r for r in self.steps if r["step"] == step]


def shown(strategy: str) -> str:
    """How tables and figures name a strategy: a registered one by its name, one from the user's file by the
    file's name (``bucketed_ddp.py``, ``mine.py:Fast``), not its whole path."""
    path, colon, cls = strategy.rpartition(":") if re.search(r"\.py:\w+$", strategy) else (strategy, "", "")
    return Path(path).name + colon + cls if path.endswith(".py") else strategy


def series_of(strategy: str, config: dict) -> str:
    """``strategy`` (as :func:`shown` names it), with its gradient compression where the run has one:
    ``ddp (powersgd r2)``."""
    compression = compression_of(config)
    return f"{shown(strategy)} ({compression})" if compression else shown(strategy)


def _says_uncounted(details) -> bool:
    """A rank's details (or a record nested one level in them, as a pipeline's data_parallel) name
    communication outside ``comm.py``."""
    if not isinstance(details, dict):
        return False
    return UNCOUNTED_COMM in details or any(isinstance(v, dict) and UNCOUNTED_COMM in v for v in details.values())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none where it is missing); UsageError naming the file and the line
    where one is not a JSON object (a damaged or hand-edited record)."""
    if not path.exists():
        return []
    rows = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"{path}, line {number}: a damaged record ({exc})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}, line {number}: a damaged record (not a JSON object)")
            rows.append(row)
    return rows


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "summary.json").is_file()


def load_run(path) -> Run:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist; pass a run directory written by `paralab train`")
    if not path.is_dir() or not (path / "summary.json").is_file():
        hint = ""
        if path.is_dir() and (path / "runs").is_dir():
            hint = f" (it looks like a compare report: pass {path}/runs/*)"
        raise UsageError(f"{path} is not a finished run directory (no summary.json){hint}; "
                         "pass directories written by `paralab train`")
    try:
        summary = json.loads((path / "summary.json").read_text())
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: unreadable run record ({exc})") from None
    add_predictions(config, summary)  # the predictions beside what the run measured (beside.py)
    return Run(path, config, summary)


def load_runs(paths, skip_unfinished: bool = False, warn=None) -> list[Run]:
    """Load every path; with ``skip_unfinished``, directories without summary.json (a failed run
    of a comparison) are left out with a warning, as long as at least one finished run remains."""
    runs, skipped = [], []
    for p in paths:
        p = Path(p)
        if skip_unfinished and p.is_dir() and not (p / "summary.json").exists() and not (p / "runs").is_dir():
            skipped.append(p)
            continue
        runs.append(load_run(p))
    if not runs:
        if skipped:
            raise UsageError(f"none of these is a finished run directory (no summary.json): "
                             f"{', '.join(map(str, skipped[:3]))}; pass directories written by `paralab train`")
        raise UsageError("no run directories given")
    for p in skipped:
        (warn or (lambda m: None))(f"skipping {p}: not a finished run (no summary.json)")
    return runs


def sort_runs(runs: list[Run], order: list[str] | None = None) -> list[Run]:
    """By strategy (in ``order``, else registry order, else name), then worker count."""
    if order is None:
        try:
            from ..strategies import strategy_names
            order = strategy_names()
        except Exception:  # noqa: BLE001 - ordering only
            order = []
    rank = {name: i for i, name in enumerate(order)}
    return sorted(runs, key=lambda r: (rank.get(r.strategy, len(rank)), r.strategy, r.workers, r.label))
