"""Resumable state: one file per rank, written atomically, read with ``weights_only=True``.

``<run>/checkpoint/rank<R>.pt`` holds the step reached, the model identity
and the strategy's own state (sharded strategies keep their shard). The data
order and augmentation are functions of (seed, step), so no RNG state is needed
to resume bit-identically. ``--save-init`` also writes the starting state, in
the same layout, to ``<run>/checkpoint/init/rank<R>.pt`` (``paralab export
RUN --init``). ``paralab export`` turns any strategy's rank files into one
plain state_dict (each strategy's ``consolidate``).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import UsageError
from ..options import identity_fields
from ..strategies.all_options import StrategyOptions

# What must match for a resumed run to continue the same arithmetic: the model and
# strategy, everything that decides which samples each step reads, and the strategy
# options declared with identity=True (the layout: pp, zero_stage, microbatches...).
IDENTITY_KEYS = ("model", "width", "norm", "strategy", "optimizer", "seed", "batch_size", "per_worker_batch",
                 "dataset", "synthetic_size", "augment", "drop_last", "precision", *identity_fields(StrategyOptions))
# keys added after checkpoints were first written, and the value an older checkpoint implies
IDENTITY_DEFAULTS = {"drop_last": False, "precision": "fp32", "pp": 1}


#: the starting state written by ``--save-init`` (a checkpoint of step 0)
INIT = "init"


def checkpoint_path(run_dir: Path, rank: int, tag: str | None = None) -> Path:
    """``<run>/checkpoint/rank<R>.pt``, or with ``tag`` (``INIT``) ``<run>/checkpoint/<tag>/rank<R>.pt``."""
    folder = Path(run_dir) / "checkpoint"
    return (folder / tag if tag else folder) / f"rank{rank}.pt"


def identity(cfg) -> dict:
    return {k: getattr(cfg, k) for k in IDENTITY_KEYS} | {"world": cfg.world}


def save(run_dir: Path, rank: int, step: int, cfg, state: dict, tag: str | None = None,
         losses: list | None = None) -> Path:
    """Write rank ``rank``'s state at ``step`` atomically. ``losses``: this rank's [step, loss] pairs so
    far (JSON text in the file), so that a resumed run still has the whole run's losses."""
    path = checkpoint_path(run_dir, rank, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"step": step, "identity": identity(cfg), "state": state,
                        "losses": json.dumps(losses or [])}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(run_dir: Path, rank: int, tag: str | None = None, mmap: bool = False) -> dict:
    """One rank's checkpoint; ``weights_only``: the file's bytes cannot run code. ``mmap``: tensors
    are read only when touched (to read the step or identity of a large file cheaply)."""
    return torch.load(checkpoint_path(run_dir, rank, tag), map_location="cpu", weights_only=True, mmap=mmap)


def losses(saved: dict) -> list:
    """The [step, loss] pairs a checkpoint (:func:`load`) holds for its rank (none in older files)."""
    return json.loads(saved.get("losses") or "[]")


def steps(run_dir: Path, ranks, tag: str | None = None) -> dict[int, int | None]:
    """The step each rank's file in ``run_dir`` holds (None: missing or unreadable); ``ranks``: an
    iterable of ranks, or the world size (every rank)."""
    found = {}
    for rank in (range(ranks) if isinstance(ranks, int) else ranks):
        try:
            found[rank] = int(load(run_dir, rank, tag, mmap=True)["step"])
        except Exception:  # noqa: BLE001 - missing, truncated, not a checkpoint
            found[rank] = None
    return found


def resumable_step(run_dir: Path, cfg, ranks=None) -> int | None:
    """The step a run with ``cfg`` can resume from ``run_dir`` (the files of ``ranks``, default every
    rank, present, readable, of this run, at one step), else None."""
    ranks = list(range(cfg.world) if ranks is None else ranks)
    try:
        if load(run_dir, ranks[0], mmap=True)["identity"] != identity(cfg):
            return None
    except Exception:  # noqa: BLE001
        return None
    found = set(steps(run_dir, ranks).values())
    return found.pop() if len(found) == 1 and None not in found else None


def check_resumable(run_dir: Path, cfg) -> None:
    """Refuse --resume from a directory without a matching checkpoint (before any worker starts)."""
    ranks = [cfg.rank] if cfg.rank is not None else range(cfg.world)
    for rank in ranks:
        path = checkpoint_path(run_dir, rank)
        if not path.exists():
            raise UsageError(f"--resume {run_dir}: no checkpoint for rank {rank} ({path} is missing); "
                             "resume from a run made with --checkpoint-every or one that finished")
        try:
            whole = load(run_dir, rank, mmap=True)
            saved, step = whole["identity"], whole["step"]
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"--resume {run_dir}: {path} is not a readable paralab checkpoint ({exc})")
        mine = identity(cfg)
        diffs = [f"{k}: checkpoint has {saved.get(k, IDENTITY_DEFAULTS.get(k))!r}, this run {mine[k]!r}"
                 for k in mine if saved.get(k, IDENTITY_DEFAULTS.get(k)) != mine[k]]
        if not diffs and cfg.num_batches is not None and cfg.num_batches <= step:
            raise UsageError(f"--resume {run_dir}: the checkpoint has already trained {step} steps; "
                             f"ask for more than that with --num-batches (got {cfg.num_batches})")
        if diffs:
            raise UsageError(f"--resume {run_dir}: the checkpoint is from a different run "
                             f"({'; '.join(diffs)}); use the same options")
    if cfg.rank is None and cfg.world > 1:  # every rank's file is here: they must hold the same step
        found = steps(run_dir, cfg.world)
        if len(set(found.values())) > 1:
            raise UsageError(f"--resume {run_dir}: the rank files hold different steps "
                             f"({', '.join(f'rank {r}: {s}' for r, s in found.items())}); the run stopped while "
                             "saving them, and they cannot continue one run together")
