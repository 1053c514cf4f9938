"""Resumable state: one file per rank, written atomically, read with ``weights_only=True``.

``<run>/checkpoint/rank<R>.pt`` holds the step reached, the model identity
and the strategy's own state (sharded strategies keep their shard). The data
order and augmentation are functions of (seed, step), so no RNG state is needed
to resume bit-identically. ``--save-init`` also writes the starting state, in
the same layout, to ``<run>/checkpoint/init/rank<R>.pt`` (``paralab export
RUN --init``). ``paralab export`` turns any strategy's rank files into one
plain state_dict (each strategy's ``consolidate``).

A checkpoint whose identity differs from the run's only in its layout
(:data:`LAYOUT_KEYS`: strategy, workers, pp, tp, ep, ZeRO stage, microbatches...)
resumes resharded: every rank reads every old rank file, the old strategy
makes them one :class:`~paralab.strategies.portable.Portable` (whole tensors
and optimizer state, plain names; :func:`read_portable`), and the new one
takes its part (``load_portable``). Anything else that differs is refused.
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
IDENTITY_DEFAULTS |= {"replicate": 1}  # HSDP (fsdp --replicate)
IDENTITY_DEFAULTS |= {"dropout": 0.0}  # the gpt's residual dropout
# the identity keys that only say how the same training is laid out over ranks: a checkpoint that differs
# from the run in these alone resumes resharded (the global batch, checked apart, must stay the same)
LAYOUT_KEYS = ("strategy", "world", "pp", "tp", "partition", "microbatches", "virtual_stages", "sequence_parallel",
               "accumulate", "compress", "powersgd_rank", "powersgd_start_iter", "zero_stage")
# expert parallelism (--ep) only says which ranks hold which experts: resharded too (strategies/expert/)
LAYOUT_KEYS += ("ep",)
LAYOUT_KEYS += ("cp", "cp_method", "cp_balance")  # context parallelism: every cp rank holds the whole state
LAYOUT_KEYS += ("replicate",)  # HSDP's replica groups (fsdp --replicate)


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
        saved = load(run_dir, ranks[0], mmap=True)["identity"]
        if saved != identity(cfg):
            if not another_layout(run_dir, cfg, ranks[0]):
                return None
            ranks = list(range(int(saved["world"])))  # another layout: every old rank's file
    except Exception:  # noqa: BLE001
        return None
    found = set(steps(run_dir, ranks).values())
    return found.pop() if len(found) == 1 and None not in found else None


def differences(saved: dict, cfg) -> dict[str, tuple]:
    """Identity key -> (the checkpoint's value, this run's), where they differ."""
    mine = identity(cfg)
    return {k: (saved.get(k, IDENTITY_DEFAULTS.get(k)), mine[k]) for k in mine
            if saved.get(k, IDENTITY_DEFAULTS.get(k)) != mine[k]}


def another_layout(run_dir: Path, cfg, rank: int | None = None) -> bool:
    """Whether ``run_dir``'s checkpoint is this run in another layout (else: the same layout). Reads the
    identity of ``rank``'s file where it exists, else rank 0's."""
    probe = rank if rank is not None and checkpoint_path(run_dir, rank).exists() else 0
    diffs = differences(load(run_dir, probe, mmap=True)["identity"], cfg)
    return bool(diffs) and all(k in LAYOUT_KEYS for k in diffs)


def saved_config(cfg, saved: dict):
    """The config of the run that wrote a checkpoint: this one, under the checkpoint's identity."""
    import dataclasses
    fields = {k: saved.get(k, IDENTITY_DEFAULTS.get(k)) for k in IDENTITY_KEYS if k in saved or k in IDENTITY_DEFAULTS}
    return dataclasses.replace(cfg, **fields, world_size=int(saved["world"]), rank=None, resume=None)


def describe(ident: dict) -> str:
    """A layout in words: ``fsdp (ZeRO-3) on 4 ranks``, ``ddp on 4 ranks, pp 2 x tp 2``."""
    import dataclasses
    from ..strategies import get_strategy
    options = {f.name for o in get_strategy(ident["strategy"]).options for f in dataclasses.fields(o)}
    what = ident["strategy"] + (f" (ZeRO-{ident['zero_stage']})" if "zero_stage" in options else "")
    dims = [f"{k} {ident[k]}" for k in ("pp", "tp", "ep", "cp", "replicate") if (ident.get(k) or 1) > 1]
    return f"{what} on {ident['world']} rank(s)" + (f", {' x '.join(dims)}" if dims else "")


def read_all(run_dir: Path, tag: str | None = None) -> list[dict]:
    """Every rank's file of ``run_dir``'s checkpoint (weights_only), checked to be one run at one step;
    UsageError naming the file that is missing, unreadable or from another run or step."""
    first = checkpoint_path(run_dir, 0, tag)
    if not first.exists():
        raise UsageError(f"{run_dir} has no checkpoint ({first} is missing); "
                         "a run saves one when it finishes, and every N steps with --checkpoint-every N")
    files, world, rank = [], None, 0
    while world is None or rank < world:
        path = checkpoint_path(run_dir, rank, tag)
        if not path.exists():
            raise UsageError(f"{path} is missing: the run had {world} ranks and every rank's file is needed "
                             "(ranks started with --rank keep theirs on their own host: copy them here)")
        try:
            saved = load(run_dir, rank, tag)
            ident, step = saved["identity"], int(saved["step"])
            if not isinstance(saved["state"], dict):
                raise TypeError("its state is not a dict")
        except Exception as exc:  # noqa: BLE001 - anything unreadable is the input's fault
            raise UsageError(f"{path} is not a readable paralab checkpoint ({exc})")
        if world is None:
            world = int(ident["world"])
        elif ident != files[0]["identity"] or step != files[0]["step"]:
            raise UsageError(f"{path} is not from the same run and step as rank 0's "
                             f"(step {step} vs {files[0]['step']}); the run stopped while saving")
        files.append(saved)
        rank += 1
    return files


def read_portable(run_dir: Path, cfg, model):
    """``run_dir``'s checkpoint, of another layout, in no layout: (Portable, step, the run's mean loss
    per step before it, its identity). ``model``: this run's model, freshly built (its names and
    shapes are what the checkpoint must fill). UsageError if the old layout cannot be made portable
    or does not fit the model."""
    from ..strategies import plan
    files = read_all(run_dir)
    saved = files[0]["identity"]
    old = saved_config(cfg, saved)
    try:
        _, old_cls, _ = plan(old, old.world)
        portable = old_cls.portable([f["state"] for f in files], model)
    except NotImplementedError as exc:
        raise UsageError(f"--resume {run_dir}: {exc}; resume it under its own layout ({describe(saved)})")
    except (KeyError, ValueError, IndexError, TypeError, RuntimeError) as exc:
        raise UsageError(f"--resume {run_dir}: its {describe(saved)} checkpoint could not be put together "
                         f"({type(exc).__name__}: {exc})")
    expected = model.state_dict()
    missing = [k for k in expected if k not in portable.tensors]
    wrong = [f"{k}: checkpoint {tuple(portable.tensors[k].shape)}, this run {tuple(v.shape)}"
             for k, v in expected.items() if k in portable.tensors and portable.tensors[k].shape != v.shape]
    extra = [k for k in portable.tensors if k not in expected]
    if missing or wrong or extra:
        raise UsageError(f"--resume {run_dir}: the checkpoint's tensors do not fit this run's model ("
                         + "; ".join(f"{what} {', '.join(keys[:4])}" for what, keys in
                                     (("missing", missing), ("shapes differ:", wrong), ("unexpected", extra)) if keys)
                         + "); resume with the same model options")
    portable.notes += carried_notes(old, cfg, model)
    by_step: dict[int, list[float]] = {}
    for f in files:
        for step, loss in losses(f):
            if loss is not None:
                by_step.setdefault(step, []).append(loss)
    mean = [[step, sum(v) / len(v)] for step, v in sorted(by_step.items())]
    return portable, int(files[0]["step"]), mean, saved


def carried_notes(old, new, model) -> list[str]:
    """What a resume into another layout carries and what it cannot, in words (printed at start)."""
    from ..strategies.base import has_batchnorm
    notes = ["weights and buffers, and the optimizer state of every parameter (momentum, Adam's moments and "
             "step), carried whole and resharded"]
    if has_batchnorm(model):
        notes.append("BatchNorm: the running statistics are carried as the checkpoint holds them (one set: "
                     "paralab broadcasts dp rank 0's to every replica after each step, so none is per replica); "
                     "but BatchNorm normalises each replica's shard (a pipeline: each microbatch) by its own "
                     f"batch statistics, so from here it follows this layout ({new.strategy} on {new.world}), "
                     "and the run equals no single layout's run unless both split the batch alike "
                     "(--norm none, or layer norm, makes it layout-free)")
    if old.compress == "powersgd":
        notes.append("NOT carried: PowerSGD's error-feedback and warm-start matrices (--compress powersgd) are "
                     "not in the checkpoint; this run starts without them")
    notes.append("a pipeline keeps nothing per microbatch between steps: nothing to carry")
    return notes


def check_resumable(run_dir: Path, cfg) -> None:
    """Refuse --resume from a directory without a matching checkpoint (before any worker starts)."""
    ranks = [cfg.rank] if cfg.rank is not None else range(cfg.world)
    probe = next((r for r in (*ranks, 0) if checkpoint_path(run_dir, r).exists()), None)
    if probe is not None:
        try:
            other = another_layout(run_dir, cfg, probe)
        except Exception:  # noqa: BLE001 - unreadable: the loop below says so
            other = False
        if other:
            return check_reshardable(run_dir, cfg)
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
        differ = differences(saved, cfg)
        other = [k for k in differ if k not in LAYOUT_KEYS]  # the layout alone would be resharded
        diffs = [f"{k}: checkpoint has {old!r}, this run {new!r}" for k, (old, new) in differ.items()
                 if k in (other or differ)]
        if "precision" in differ and cfg.check:
            diffs.append("a --check without --precision runs in fp64, exact; to continue this checkpoint give "
                         f"--precision {differ['precision'][0]} (its check is then that precision's)")
        if not diffs and cfg.num_batches is not None and cfg.num_batches <= step:
            raise UsageError(f"--resume {run_dir}: the checkpoint has already trained {step} steps; "
                             f"ask for more than that with --num-batches (got {cfg.num_batches})")
        if diffs:
            raise UsageError(f"--resume {run_dir}: the checkpoint is from a different run "
                             f"({'; '.join(diffs)}); use the same options"
                             + (" (the layout may differ: strategy, workers, pp, tp... are resharded)"
                                if other and len(other) < len(differ) else ""))
    if cfg.rank is None and cfg.world > 1:  # every rank's file is here: they must hold the same step
        found = steps(run_dir, cfg.world)
        if len(set(found.values())) > 1:
            raise UsageError(f"--resume {run_dir}: the rank files hold different steps "
                             f"({', '.join(f'rank {r}: {s}' for r, s in found.items())}); the run stopped while "
                             "saving them, and they cannot continue one run together")


def check_reshardable(run_dir: Path, cfg) -> None:
    """--resume from a checkpoint of another layout: every old rank file present and of one step, the
    global batch the same, both strategies able to reshard, and the tensors fitting this run's model
    (the whole conversion, made here once, before any worker starts)."""
    from ..models import build_model, model_shape
    from ..strategies import plan
    files = read_all(run_dir)
    saved, step = files[0]["identity"], int(files[0]["step"])
    old = saved_config(cfg, saved)
    _, new_cls, _ = plan(cfg, cfg.world)
    if not new_cls.reshards():
        raise UsageError(f"--resume {run_dir}: the checkpoint is {describe(saved)}, and {cfg.strategy} cannot "
                         f"resume from another layout; resume it as {describe(saved)}")
    if old.global_batch() != cfg.global_batch():
        raise UsageError(f"--resume {run_dir}: the checkpoint's global batch is {old.global_batch()}, this run's "
                         f"{cfg.global_batch()} (--per-worker-batch {cfg.per_worker_batch} over another number of "
                         "data-parallel replicas): every step must read the same samples; resume with as many "
                         "replicas, or from a run trained with --batch-size")
    if cfg.num_batches is not None and cfg.num_batches <= step:
        raise UsageError(f"--resume {run_dir}: the checkpoint has already trained {step} steps; "
                         f"ask for more than that with --num-batches (got {cfg.num_batches})")
    model = build_model(cfg.model, width=cfg.width, norm=cfg.norm, num_classes=10, **model_shape(cfg))
    read_portable(run_dir, cfg, model)
