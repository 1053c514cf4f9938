"""Resumable state: one file per rank, written atomically, read with ``weights_only=True``.

``<run>/checkpoint/rank<R>.pt`` holds the step reached, the model identity
and the strategy's own state (sharded strategies keep their shard). The data
order and augmentation are functions of (seed, step), so no RNG state is needed
to resume bit-identically.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .errors import UsageError
from .options import identity_fields
from .strategies.options import StrategyOptions

# What must match for a resumed run to continue the same arithmetic: the model and
# strategy, everything that decides which samples each step reads, and the strategy
# options declared with identity=True (the layout: pp, zero_stage, microbatches...).
IDENTITY_KEYS = ("model", "width", "norm", "strategy", "optimizer", "seed", "batch_size", "per_worker_batch",
                 "dataset", "synthetic_size", "augment", *identity_fields(StrategyOptions))


def checkpoint_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "checkpoint" / f"rank{rank}.pt"


def identity(cfg) -> dict:
    return {k: getattr(cfg, k) for k in IDENTITY_KEYS} | {"world": cfg.world}


def save(run_dir: Path, rank: int, step: int, cfg, state: dict) -> Path:
    path = checkpoint_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"step": step, "identity": identity(cfg), "state": state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(run_dir: Path, rank: int) -> dict:
    return torch.load(checkpoint_path(run_dir, rank), map_location="cpu", weights_only=True)


def check_resumable(run_dir: Path, cfg) -> None:
    """Refuse --resume from a directory without a matching checkpoint (before any worker starts)."""
    ranks = [cfg.rank] if cfg.rank is not None else range(cfg.world)
    for rank in ranks:
        path = checkpoint_path(run_dir, rank)
        if not path.exists():
            raise UsageError(f"--resume {run_dir}: no checkpoint for rank {rank} ({path} is missing); "
                             "resume from a run made with --checkpoint-every or one that finished")
        try:
            saved = load(run_dir, rank)["identity"]
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"--resume {run_dir}: {path} is not a readable paralab checkpoint ({exc})")
        mine = identity(cfg)
        diffs = [f"{k}: checkpoint has {saved.get(k)!r}, this run {mine[k]!r}"
                 for k in mine if saved.get(k) != mine[k]]
        step = load(run_dir, rank)["step"]
        if not diffs and cfg.num_batches is not None and cfg.num_batches <= step:
            raise UsageError(f"--resume {run_dir}: the checkpoint has already trained {step} steps; "
                             f"ask for more than that with --num-batches (got {cfg.num_batches})")
        if diffs:
            raise UsageError(f"--resume {run_dir}: the checkpoint is from a different run "
                             f"({'; '.join(diffs)}); use the same options")
