"""The run directory: config, per-step rows, spans, summary, evaluation, trace.

Rank 0 gathers every rank's rows and spans (one object gather at the end, so
multi-node runs need no shared file system) and writes:

    config.json   resolved config + environment
    steps.jsonl   per step and rank: loss, seconds by category, samples
    spans.jsonl   timeline spans of all ranks
    summary.json  time/iter (mean and median step), samples/s, split per rank, bytes, bandwidth,
                  test metrics, check
    eval.txt      per-class precision/recall/F1 and the confusion matrix (text: loss, perplexity)
    trace.json    Chrome/Perfetto trace

Everything plots and reports need is in these files.

A run that starts again from its own checkpoint (``--max-restarts``, torchrun's restarts, or ``--resume
RUN`` into RUN) is one run: while it trains, each rank appends what it recorded since its last
checkpoint to a journal (``records/rank<R>.jsonl``: one line per checkpoint, its rows and spans and the
attempt they belong to, on disk before the checkpoint commits), and the start after it takes the records of the steps before its checkpoint
from there (:func:`journal_read`). So ``steps.jsonl`` and ``spans.jsonl`` hold every step once, each with
the attempt that ran it (``attempt``), the attempts laid end to end in time; the steps done twice are
listed with the restarts in summary.json (``restarts[*].redone``). The journal goes once the records are
written, ``summary.json`` last (:func:`write_run`).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
from pathlib import Path

import torch

from ..analysis import moe as moe_analysis
from ..analysis import timeline
from ..analysis.cost import SCHEDULE_SOURCES, in_flight, schedule_bubble
from ..training.evaluate import format_report
from ..kinds import ALLOCATOR, HELD, STAGE
from ..recorder import CATEGORIES, union_length
from ..analysis.trace import chrome_trace

SPLIT_KEYS = CATEGORIES + ("other",)


def step_row(rank: int, step: int, t0: float, t1: float, result, split: dict, attempt: int = 1,
             lr: float | None = None, targets: int = 0) -> dict:
    """One rank's row of ``steps.jsonl``: its times, its reported loss, its samples, the learning rate the
    step used, its time split (and, for a mixture of experts, the routing; for documents, ``targets``: the
    valid targets of the step's global batch, what its loss divides by)."""
    seconds = t1 - t0
    accounted = sum(split[c] for c in CATEGORIES)
    split = {**split, "other": max(0.0, seconds - accounted)}
    row = {"rank": rank, "step": step, "attempt": attempt, "t0": t0, "t1": t1, "seconds": seconds,
           "loss": result.loss, "samples": result.samples, "lr": lr, "split": split}
    if getattr(result, "grad_norm", None) is not None:
        row["grad_norm"] = result.grad_norm  # --clip-grad: the whole model's gradient norm before clipping
    if targets:
        row["targets"] = targets  # documents (data/documents.py): padding and document ends left out
    if getattr(result, "moe", None):
        row["moe"] = result.moe  # per MoE layer: tokens per expert, dropped, the auxiliary loss (StepResult)
    return row


JOURNAL = "records"


def journal_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / JOURNAL / f"rank{rank}.jsonl"


def journal_append(run_dir: Path, rank: int, attempt: int, rows: list[dict], spans: list[dict]) -> None:
    """After a committed checkpoint: this rank's rows and spans since its last one, as one line (flushed
    to disk; a line cut short by a crash is skipped when read)."""
    path = journal_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"attempt": attempt, "steps": rows, "spans": spans}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def journal_read(run_dir: Path, rank: int, before: int) -> tuple[list[dict], list[dict]]:
    """This rank's rows and spans of steps ``0 .. before - 1`` from the journal: each step from the last
    attempt that recorded it (times on that attempt's clock: :func:`end_to_end` lays them out)."""
    chosen: dict[int, tuple[int, dict]] = {}  # step -> (attempt, row)
    spans_of: dict[tuple[int, int], list[dict]] = {}  # (attempt, step) -> spans
    try:
        lines = journal_path(run_dir, rank).read_text().splitlines()
    except OSError:
        return [], []
    for line in lines:
        try:
            entry = json.loads(line)
            attempt = int(entry["attempt"])
        except (ValueError, KeyError, TypeError):
            continue  # cut short by a crash
        for row in entry["steps"]:
            if row["step"] < before and attempt >= chosen.get(row["step"], (0, None))[0]:
                chosen[row["step"]] = (attempt, {**row, "attempt": attempt})
        for span in entry["spans"]:
            spans_of.setdefault((attempt, span["step"]), []).append({**span, "attempt": attempt})
    rows = [row for _, (_, row) in sorted(chosen.items())]
    spans = [s for step, (attempt, _) in sorted(chosen.items()) for s in spans_of.get((attempt, step), [])]
    return rows, spans


def carried(run_dir: Path, rank: int, before: int) -> tuple[list[dict], list[dict]]:
    """This rank's rows and spans of steps ``0 .. before - 1`` that a run started again in its own folder
    carries: the journal's (:func:`journal_read`), and for steps the journal no longer holds, those the run
    wrote when it finished (``steps.jsonl``, ``spans.jsonl``: a finished run extended with more steps keeps
    its earlier records, appended to, never rewritten)."""
    rows, spans = journal_read(run_dir, rank, before)
    have = {r["step"] for r in rows}
    try:
        written = [r for r in map(json.loads, (Path(run_dir) / "steps.jsonl").read_text().splitlines())
                   if r.get("rank") == rank and r["step"] < before and r["step"] not in have]
        wanted = {(r["step"], r.get("attempt", 1)) for r in written}
        written_spans = [s for s in map(json.loads, (Path(run_dir) / "spans.jsonl").read_text().splitlines())
                         if s.get("rank") == rank and (s.get("step"), s.get("attempt", 1)) in wanted]
    except (OSError, ValueError, KeyError, TypeError):  # none written, or not readable: the journal's alone
        return rows, spans
    rows = sorted([*rows, *({**r, "attempt": r.get("attempt", 1)} for r in written)], key=lambda r: r["step"])
    return rows, [*spans, *({**s, "attempt": s.get("attempt", 1)} for s in written_spans)]


def end_to_end(rows: list[dict], spans: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every rank's ``rows`` and ``spans`` (each with its ``attempt``; an attempt's ranks share one clock)
    shifted so that each attempt begins where the one before it ended: one timeline for the run."""
    out_rows, out_spans, at = [], [], None
    for attempt in sorted({r["attempt"] for r in rows} | {s["attempt"] for s in spans}):
        mine = [r for r in rows if r["attempt"] == attempt]
        theirs = [s for s in spans if s["attempt"] == attempt]
        start = min([r["t0"] for r in mine] + [s["t0"] for s in theirs])
        shift = 0.0 if at is None else at - start
        out_rows += [{**r, "t0": r["t0"] + shift, "t1": r["t1"] + shift} for r in mine]
        out_spans += [{**s, "t0": s["t0"] + shift, "t1": s["t1"] + shift} for s in theirs]
        at = max([r["t1"] for r in out_rows] + [s["t1"] for s in out_spans])
    return out_rows, out_spans


def environment(world: int, backend: str, device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "host": socket.gethostname(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "backend": backend, "device": device.type, "world": world}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["cores_available"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    return env


def write_json(path: Path, obj) -> None:
    _replace(path, lambda f: f.write(json.dumps(obj, indent=2, default=str) + "\n"))


def write_jsonl(path: Path, rows) -> None:
    _replace(path, lambda f: f.writelines(json.dumps(row, default=str) + "\n" for row in rows))


def _replace(path: Path, write) -> None:
    """``path`` written whole or not at all: to a temporary name renamed into place, removed if the write
    fails (a full disk leaves no half file behind)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def bus_factor(op: str, world: int) -> float:
    """Bus bandwidth factor (as nccl-tests): bytes each rank moves per byte of message."""
    if world <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    if op in ("gather", "scatter"):  # the root's link carries N-1 shards of the (per-rank) size recorded
        return world - 1
    return 1.0


def summarize(cfg, steps: list[dict], spans: list[dict], *, parameters: int, world: int,
              global_batch: int, evaluation: dict | None, check: dict | None, error: str | None,
              replicas: int = 1, extra: dict | None = None) -> dict:
    timed = sorted({r["step"] for r in steps})
    measured = timeline.measured_steps(timed, cfg.warmup)
    by_step: dict[int, list[dict]] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r)
    iter_times = [max(r["seconds"] for r in by_step[s]) for s in measured]
    seconds_per_iter = sum(iter_times) / len(iter_times) if iter_times else None
    # the median step too: on a shared machine one disturbed step moves the mean, not the median
    seconds_per_iter_median = statistics.median(iter_times) if iter_times else None

    ranks = sorted({r["rank"] for r in steps})
    split = {}
    for rank in ranks:
        rows = [r for r in steps if r["rank"] == rank and r["step"] in set(measured)]
        split[str(rank)] = {k: sum(r["split"].get(k, 0.0) for r in rows) / max(len(rows), 1)
                            for k in SPLIT_KEYS + ("forward", "backward", "comm_async")}
        split[str(rank)]["step"] = sum(r["seconds"] for r in rows) / max(len(rows), 1)

    measured_set = set(measured)
    comm_spans = [s for s in spans if s["category"] == "comm" and s["step"] in measured_set and s["bytes"]]
    comm_bytes = {str(rank): sum(s["bytes"] for s in comm_spans if s["rank"] == rank) / max(len(measured), 1)
                  for rank in ranks}
    by_op: dict[str, dict] = {}
    for s in comm_spans:
        op = s.get("args", {}).get("op", s["name"])
        entry = by_op.setdefault(op, {"bytes": 0, "seconds": 0.0, "calls": 0})
        entry["bytes"] += s["bytes"]
        entry.setdefault("_intervals", {}).setdefault(s["rank"], []).append((s["t0"], s["t1"]))
        entry["calls"] += 1
    for entry in by_op.values():  # per rank, the time this kind of call was in progress
        entry["seconds"] = sum(union_length(iv) for iv in entry.pop("_intervals").values())
    for op, entry in by_op.items():
        entry["bytes_per_step"] = entry["bytes"] / max(len(measured), 1) / max(len(ranks), 1)
        entry["algbw_GBps"] = entry["bytes"] / entry["seconds"] / 1e9 if entry["seconds"] else None
        factor = bus_factor(op, world)
        entry["busbw_GBps"] = entry["algbw_GBps"] * factor if entry["algbw_GBps"] else None
    collectives = ("all_reduce", "all_gather", "reduce_scatter", "gather", "scatter")
    bus = [e for op, e in by_op.items() if op in collectives]
    bus_bandwidth = None
    if bus:
        moved = sum(e["bytes"] * bus_factor(op, world) for op, e in by_op.items()
                    if op in collectives)
        secs = sum(e["seconds"] for e in bus)
        bus_bandwidth = moved / secs / 1e9 if secs else None

    def mean_loss(step):
        values = [r["loss"] for r in by_step.get(step, []) if r["loss"] is not None]
        return sum(values) / len(values) if values else None

    # samples each step really trained (an epoch's last batch can be short): the ranks'
    # own counts add up over data-parallel replicas; model/pipeline stages all see one batch
    global_samples = sum(sum(r["samples"] for r in by_step[s]) * replicas / len(by_step[s]) for s in measured)
    summary = {
        "strategy": cfg.strategy, "workers": world, "model": cfg.model, "width": cfg.width, "norm": cfg.norm,
        "dataset": cfg.dataset, "parameters": parameters, "global_batch": global_batch,
        "precision": cfg.precision, "steps": len(timed), "warmup": cfg.warmup, "measured_steps": len(measured),
        "seconds_per_iter": seconds_per_iter, "seconds_per_iter_median": seconds_per_iter_median,
        "samples_per_s": global_samples / sum(iter_times) if iter_times and sum(iter_times) else None,
        "split": split,
        "comm_bytes": comm_bytes, "comm_ops": by_op, "bus_bandwidth": bus_bandwidth,
        "bus_bandwidth_unit": "GB/s",
        "first_loss": mean_loss(timed[0]) if timed else None,
        "final_loss": mean_loss(timed[-1]) if timed else None,
        "test_loss": evaluation["loss"] if evaluation else None,
        "test_accuracy": evaluation["accuracy"] if evaluation else None,
        "test_perplexity": evaluation.get("perplexity") if evaluation else None,  # a text model's
        "check": None if check is None else {k: check[k] for k in
                                             ("result", "verdict", "worst_ratio", "failed", "steps",
                                              "max_weight_dev",
                                              "max_optimizer_dev", "max_loss_dev", "max_grad_norm_dev",
                                              "max_output_dev",
                                              "precision", "tolerances", "history", "unexercised")}
        | {k: check[k] for k in ("first_divergence", "held_exact", "loss_scale_followed", "experts_followed")
           if k in check},
        "error": error,
    }
    if getattr(cfg, "on_nonfinite", None) or getattr(cfg, "precision", None) == "fp16":
        # the steps whose update every rank skipped (--on-nonfinite skip; fp16's loss scale overflowing)
        summary["skipped_steps"] = sorted({r["step"] for r in steps if r.get("skipped")})
    summary.update(extra or {})
    return summary


def derive_details(cfg, spans: list[dict], per_rank: list[dict]) -> None:
    """Add to each rank's details what the spans say about it (``analysis/timeline.py``), beside the theory:

    - asynchronous all-reduces it waited for in spans of its own (``ddp``): ``overlap``;
    - a pipeline stage (a ``stage`` detail record): its measured ``bubble`` against its schedule's
      formula (``(P-1)/(M+P-1)`` for GPipe and 1F1B; ``analysis/cost.schedule_bubble``), and the most
      microbatches alive at once against the schedule's bound;

    The memory a rank measured is written as measured: the predictions beside it are added where a run is
    read (``analysis/beside.py``), not by the run.
    """
    by_rank: dict[int, list[dict]] = {}
    for s in spans:  # each rank's spans once, not the whole run's per rank and per figure
        by_rank.setdefault(s["rank"], []).append(s)
    for rank, details in enumerate(per_rank):
        mine = by_rank.get(rank, [])
        measured = timeline.overlap(mine, rank, cfg.warmup)
        if measured is not None:
            details["overlap"] = measured
        if STAGE in details:
            stages, m, k = details["stages"], details["microbatches"], details[STAGE]
            schedule = "gpipe" if details["schedule"] == "naive" else details["schedule"]
            details.update(timeline.bubble(mine, rank, cfg.warmup))
            v = details.get("virtual_stages", 1)
            details["peak_microbatches_alive"] = timeline.peak_in_flight(mine, rank)
            if schedule in SCHEDULE_SOURCES:  # PyTorch's V schedules (torch-pipeline): no formula here
                theory = schedule_bubble(schedule, stages, m, v)
                details["bubble_theory"], details["bubble_formula"] = theory.parts["fraction"], theory.substituted
                details["in_flight_bound"] = in_flight(schedule, stages, m, v)[k]


def write_run(run_dir: Path, cfg, comm, recorder, step_rows, strategy, *, parameters, world, backend, device,
              dataset, evaluation, check, error, global_batch, is_main, earlier=(), held=None,
              carried=((), ()), midway=None) -> None:
    """Gather every rank's records to rank 0, which writes the run directory. ``earlier``: this rank's
    [step, loss] pairs from before a resume that are not in ``carried`` (summary.json
    ``losses_before_resume``); ``carried``: the rows and spans of this run's earlier attempts
    (:func:`journal_read`), laid before this attempt's. ``midway``: called half way through (rank 0: the
    step records written, not yet ``summary.json``; the others: once their records are sent), a fault point
    for the tests of what a stop while writing leaves (``PARALAB_FAULT``'s ``records``)."""
    extra = strategy.extra_summary()
    peaks = recorder.allocator_peaks()  # CUDA only; absent on CPU
    if peaks:
        extra = {**extra, ALLOCATOR: peaks}
    if held:
        extra = {**extra, HELD: held}
    attempt = step_rows[0]["attempt"] if step_rows else 1
    rows = list(carried[0]) + list(step_rows)
    spans = list(carried[1]) + [s | {"attempt": attempt} for s in recorder.dump()]
    gathered = comm.gather_objects((rows, spans, extra, list(earlier)))
    failed = None
    if not is_main and midway is not None:
        midway()
    if is_main:
        try:
            _write_records(run_dir, cfg, strategy, gathered, parameters=parameters, world=world, backend=backend,
                           device=device, dataset=dataset, evaluation=evaluation, check=check, error=error,
                           global_batch=global_batch, midway=midway)
        except OSError as exc:  # a full disk, a folder made read-only: every rank stops alike (exit 4)
            failed = f"{getattr(exc, 'filename', None) or run_dir}: {exc.strerror or exc}"
    failed = comm.broadcast_object(failed)
    if failed is not None:  # the journals stay: `--resume RUN --out RUN` writes the records again
        raise RecordsNotWritten(f"could not write the run's records ({failed}); every checkpoint and journal is "
                                f"kept: once there is room, `--resume {run_dir} --out {run_dir}` writes them")
    # the records are written, summary.json last: only now may the journals go
    journal_path(run_dir, comm.rank).unlink(missing_ok=True)
    comm.all_gather_objects(None)  # every rank's journal gone (on this host) before its folder is removed
    if is_main:
        try:
            (run_dir / JOURNAL).rmdir()
        except OSError:
            pass


class RecordsNotWritten(RuntimeError):
    """Rank 0 could not write the run's records (a full disk, no permission): every rank stops with exit 4."""


def _write_records(run_dir: Path, cfg, strategy, gathered, *, parameters, world, backend, device, dataset,
                   evaluation, check, error, global_batch, midway=None) -> None:
    """Rank 0: the run directory's files from every rank's gathered records, ``summary.json`` written last (a
    run is finished once it is there: a run stopped before it is finished by ``--resume``)."""
    steps, spans = end_to_end([r for rows, *_ in gathered for r in rows], [s for _, ss, *_ in gathered for s in ss])
    steps = sorted(steps, key=lambda r: (r["step"], r["rank"]))
    spans = sorted(spans, key=lambda s: (s["t0"], s["rank"]))
    extras = {}
    per_rank = [dict(e) for _, _, e, _ in gathered]
    derive_details(cfg, spans, per_rank)
    if any(per_rank):
        extras["strategy_details"] = {str(r): e for r, e in enumerate(per_rank)}
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = strategy.ctx.mesh
    config = cfg.to_dict() | {"environment": environment(world, backend, device),
                              "mesh": mesh.shape.to_dict() if mesh is not None else None,
                              "dataset_source": dataset.source, "resolved_dataset": dataset.name}
    write_json(run_dir / "config.json", config)
    write_jsonl(run_dir / "steps.jsonl", steps)
    write_jsonl(run_dir / "spans.jsonl", spans)
    if midway is not None:
        midway()
    summary = summarize(cfg, steps, spans, parameters=parameters, world=world, global_batch=global_batch,
                        evaluation=evaluation, check=check, error=error, replicas=strategy.replicas()[0],
                        extra=extras)
    summary["dataset"] = dataset.name
    before = sorted([rank, step, loss] for rank, (*_, pairs) in enumerate(gathered) for step, loss in pairs)
    if before:  # a resumed run: the losses of the steps its checkpoint had trained
        summary["losses_before_resume"] = before
    if cfg.restarts:  # each restart, with the steps it made the group do again
        summary["restarts"] = [r | {"redone": list(range(r["resumed_from_step"], r["reached_step"]))
                                    if r.get("reached_step") is not None else []} for r in cfg.restarts]
    attempts = sorted({r.get("attempt", 1) for r in steps})
    if len(attempts) > 1:
        summary["attempts"] = {str(a): [min(r["step"] for r in steps if r.get("attempt", 1) == a),
                                        max(r["step"] for r in steps if r.get("attempt", 1) == a)]
                               for a in attempts}
    if getattr(cfg, "experts", 0):  # a mixture of experts: active vs total, and the load the routers saw
        summary["moe"] = moe_analysis.parameters(cfg) | {"experts": cfg.experts, "top_k": cfg.top_k,
                                                         "gating": cfg.gating,
                                                         "capacity_factor": cfg.capacity_factor, "ep": cfg.ep,
                                                         "load": moe_analysis.load(steps)}
    if evaluation is not None:
        _replace(run_dir / "eval.txt", lambda f: f.write(format_report(evaluation)))
    write_json(run_dir / "trace.json", chrome_trace(spans, world))
    write_json(run_dir / "summary.json", summary)  # last: what says the run is finished
