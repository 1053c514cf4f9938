"""Resumable state: what a rank saves and what a resume, a restart or an export may read back.

A checkpoint is a generation (``generations.py``): ``<run>/checkpoint/step-<S>/``
holds one file per rank and a manifest committed last; only committed
generations are read, files checked against their SHA-256 and loaded with
``weights_only=True``. Each rank's file holds the step reached, the model
identity, the strategy's own state (sharded strategies keep their shard)
and the rank's losses so far. The data order and augmentation are functions
of (seed, step), so no RNG state is needed to resume bit-identically.
``--save-init`` also writes the starting state, in the same layout, as the
``init`` generation (``paralab export RUN --init``). ``paralab export`` turns
any strategy's rank files into one plain state_dict (each strategy's
``consolidate``).

A checkpoint whose identity differs from the run's only in its layout
(:data:`LAYOUT_KEYS`: strategy, workers, pp, tp, ep, ZeRO stage, microbatches...)
resumes resharded: every rank reads every old rank file, the old strategy
makes them one :class:`~paralab.strategies.portable.Portable` (whole tensors
and optimizer state, plain names; :func:`read_portable`), and the new one
takes its part (``load_portable``). Anything else that differs is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UsageError
from ..options import identity_fields
from . import generations
from .generations import WriteError  # noqa: F401 - what a failed save raises, for its callers
from ..strategies.all_options import StrategyOptions

# What must match for a resumed run to continue the same arithmetic: the model and
# strategy, everything that decides which samples each step reads, and the strategy
# options declared with identity=True (the layout: pp, zero_stage, microbatches...).
IDENTITY_KEYS = ("model", "width", "norm", "strategy", "optimizer", "seed", "batch_size", "per_worker_batch",
                 "dataset", "synthetic_size", "augment", "drop_last", "packing", "doc_length", "precision",
                 *identity_fields(StrategyOptions))
# keys added after checkpoints were first written, and the value an older checkpoint implies
IDENTITY_DEFAULTS = {"drop_last": False, "precision": "fp32", "pp": 1}
IDENTITY_DEFAULTS |= {"replicate": 1}  # HSDP (fsdp --replicate)
IDENTITY_DEFAULTS |= {"dropout": 0.0}  # the gpt's residual dropout
IDENTITY_DEFAULTS |= {"lr_schedule": "constant"}  # a cosine's rate at each step depends on its length
IDENTITY_DEFAULTS |= {"packing": False, "doc_length": 64}  # documents (data/documents.py)
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


def checkpoint_path(run_dir: Path, rank: int, tag: str | None = None) -> Path | None:
    """Rank ``rank``'s file in the newest committed generation of ``run_dir`` (or the ``tag`` one), or None."""
    gen = generations.newest(run_dir, tag)
    return None if gen is None else gen.path(rank)


def identity(cfg) -> dict:
    return {k: getattr(cfg, k) for k in IDENTITY_KEYS} | {"world": cfg.world, "lr_schedule": schedule(cfg)}


def schedule(cfg) -> str:
    """The schedule as far as resuming goes: a cosine's rate at a step depends on its floor, its warm-up and
    the steps it decays over, so a cosine run resumes only to finish the steps it was started with."""
    if cfg.lr_schedule != "cosine":
        return cfg.lr_schedule
    length = f"--num-batches {cfg.num_batches}" if cfg.num_batches else f"--epochs {cfg.epochs}"
    return f"cosine to {cfg.min_lr:g} after {cfg.warmup_epochs:g} warm-up epochs over {length}"


def save(run_dir: Path, rank: int, step: int, cfg, state: dict, comm, tag: str | None = None,
         losses: list | None = None, written=None, loss_scale=None) -> None:
    """Rank ``rank``'s state at ``step``, committed with every other rank's as one generation (a collective;
    ``generations.write``). ``losses``: this rank's [step, loss] pairs so far (JSON text in the file), so
    that a resumed run still has the whole run's losses; ``loss_scale``: fp16's (``training/loss_scale.py``),
    the same on every rank. WriteError on every rank if any could not write."""
    payload = {"step": step, "identity": identity(cfg), "state": state, "losses": json.dumps(losses or [])}
    if loss_scale is not None:
        payload["loss_scale"] = loss_scale.state_dict()
    generations.write(run_dir, rank, step, payload, comm, identity(cfg), tag=tag, keep=cfg.keep_checkpoints,
                      written=written)


def load(run_dir: Path, rank: int, tag: str | None = None, at: int | None = None) -> dict:
    """Rank ``rank``'s state in the newest committed generation (``at``: step ``at``'s, as every rank was told),
    checked against its manifest (UsageError naming the file otherwise); ``weights_only``: the file's bytes
    cannot run code."""
    gen = generations.newest(run_dir, tag, at)
    if gen is None:
        raise UsageError(f"{run_dir} has no committed checkpoint")
    return torch.load(gen.verify(rank), map_location="cpu", weights_only=True)


def losses(saved: dict) -> list:
    """The [step, loss] pairs a checkpoint (:func:`load`) holds for its rank (none in older files)."""
    return json.loads(saved.get("losses") or "[]")


def torn_note(run_dir: Path, ours: bool = False) -> str | None:
    """One line about saves not committed (newer than the newest committed one), or None: a save in progress
    where a live run holds the folder, else one that stopped half way. ``ours``: this run holds it (a run
    resumed into its own folder: its saves are not in progress)."""
    torn = generations.torn(run_dir)
    if not torn:
        return None
    last = generations.newest(run_dir)
    from .folder import held
    live = not ours and held(Path(run_dir))
    why = "a save in progress: the run is still going" if live else "a rank stopped while saving"
    return (f"{', '.join(p.name for p in torn)} in {Path(run_dir) / 'checkpoint'} "
            f"{'is' if len(torn) == 1 else 'are'} incomplete ({why}): ignored; "
            + (f"the newest complete checkpoint is step {last.step}'s" if last else "no complete checkpoint"))


def usable_steps(run_dir: Path, cfg, rank: int) -> list[int]:
    """The steps of ``run_dir``'s committed generations that rank ``rank`` of a run with ``cfg`` can start from:
    its own file there (ranks started by hand on other hosts keep theirs on their own), or, for a checkpoint of
    another layout (resharded), every old rank's. The ranks gather these and take the newest step all of them
    have (``worker.resume_or_save_init``): one generation for every rank, whatever each saw."""
    steps = []
    for gen in generations.committed(run_dir):
        need = range(gen.world) if layout_only(gen.identity, cfg) else [rank]
        if all(gen.present(r) for r in need):
            steps.append(gen.step)
    return steps


def resumable_step(run_dir: Path, cfg, ranks=None) -> int | None:
    """The step a run with ``cfg`` can resume from ``run_dir``: its newest committed generation, if it is
    this run (or this run in another layout) and holds the files of ``ranks`` (default every rank's);
    else None."""
    gen = generations.newest(run_dir)
    if gen is None:
        return None
    if gen.identity != identity(cfg):
        if not layout_only(gen.identity, cfg):
            return None
        ranks = range(gen.world)  # another layout: every old rank's file
    ranks = list(range(gen.world) if ranks is None else ranks)
    return gen.step if all(gen.present(r) for r in ranks) else None


def differences(saved: dict, cfg) -> dict[str, tuple]:
    """Identity key -> (the checkpoint's value, this run's), where they differ."""
    mine = identity(cfg)
    return {k: (saved.get(k, IDENTITY_DEFAULTS.get(k)), mine[k]) for k in mine
            if saved.get(k, IDENTITY_DEFAULTS.get(k)) != mine[k]}


def layout_only(saved: dict, cfg) -> bool:
    """Whether a checkpoint of identity ``saved`` is this run in another layout (only LAYOUT_KEYS differ)."""
    diffs = differences(saved, cfg)
    return bool(diffs) and all(k in LAYOUT_KEYS for k in diffs)


def another_layout(run_dir: Path, cfg, rank: int | None = None, at: int | None = None) -> bool:
    """Whether ``run_dir``'s newest committed checkpoint (``at``: step ``at``'s) is this run in another layout
    (else: the same layout, or none)."""
    gen = generations.newest(run_dir, at=at)
    return gen is not None and layout_only(gen.identity, cfg)


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


def read_all(run_dir: Path, tag: str | None = None, at: int | None = None,
             max_bytes: int | None = None) -> list[dict]:
    """Every rank's file of ``run_dir``'s newest committed checkpoint (``at``: step ``at``'s; weights_only),
    each checked against the manifest; UsageError naming what is missing or does not match, or a file over
    ``max_bytes`` (refused unread: a file from someone else, as the grader reads a submission's)."""
    gen = generations.newest(run_dir, tag, at)
    if gen is None:
        torn = torn_note(run_dir) if not tag else None
        raise UsageError(f"{run_dir} has no complete checkpoint" + (f" ({torn})" if torn else "")
                         + "; a run saves one when it finishes, and every N steps with --checkpoint-every N")
    files = []
    for rank in range(gen.world):
        path = gen.path(rank)
        if max_bytes is not None and path.exists() and path.stat().st_size > max_bytes:
            raise UsageError(f"{path} holds {path.stat().st_size} bytes, more than {max_bytes} for this model")
        gen.verify(rank)
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(saved.get("state"), dict) or int(saved["step"]) != gen.step:
                raise TypeError("its state or step is not the manifest's")
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything unreadable is the input's fault
            raise UsageError(f"{path} is not a readable paralab checkpoint ({exc})")
        files.append(saved)
    return files


def read_portable(run_dir: Path, cfg, model, at: int | None = None):
    """``run_dir``'s checkpoint, of another layout, in no layout: (Portable, step, the run's mean loss
    per step before it, its identity). ``model``: this run's model, freshly built (its names and
    shapes are what the checkpoint must fill). UsageError if the old layout cannot be made portable
    or does not fit the model."""
    from ..strategies import plan
    files = read_all(run_dir, at=at)
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
    portable.loss_scale = files[0].get("loss_scale")
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
                     "each rank's, per bucket of the old layout; this run starts without them")
    notes.append("a pipeline keeps nothing per microbatch between steps: nothing to carry")
    return notes


def finishing(run_dir: Path, cfg, step: int, total: int | None) -> bool:
    """Whether ``--resume run_dir`` finishes a run that was stopped after committing its last step's checkpoint
    but before writing its records (killed while it evaluated): the same folder, its records behind the
    checkpoint (none, or a shorter run's: :func:`records_behind`), and the checkpoint's step the run's last. Such a resume trains nothing: it evaluates and writes the records."""
    return (total is not None and step == total and cfg.out is not None
            and Path(cfg.out).resolve() == Path(run_dir).resolve() and records_behind(Path(run_dir), step))


def records_behind(run_dir: Path, step: int) -> bool:
    """Whether ``run_dir``'s records (``summary.json``, written last) are missing or cover fewer steps than
    ``step``: a run stopped before its records, or a finished run being extended that stopped before its new
    ones."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"]) < step
    except (OSError, ValueError, KeyError, TypeError):
        return True


def check_resumable(run_dir: Path, cfg) -> None:
    """Refuse --resume from a directory without a matching checkpoint (before any worker starts)."""
    ranks = [cfg.rank] if cfg.rank is not None else range(cfg.world)
    gen = generations.newest(run_dir)
    if gen is None:
        torn = torn_note(run_dir)
        raise UsageError(f"--resume {run_dir}: no complete checkpoint there" + (f" ({torn})" if torn else "")
                         + "; resume from a run made with --checkpoint-every or one that finished")
    if layout_only(gen.identity, cfg):
        return check_reshardable(run_dir, cfg)
    for rank in ranks:
        try:
            gen.verify(rank)  # present, and the bytes its manifest committed
        except UsageError as exc:
            raise UsageError(f"--resume {run_dir}: {exc}") from None
        saved, step = gen.identity, gen.step
        differ = differences(saved, cfg)
        other = [k for k in differ if k not in LAYOUT_KEYS]  # the layout alone would be resharded
        diffs = [f"{k}: checkpoint has {old!r}, this run {new!r}" for k, (old, new) in differ.items()
                 if k in (other or differ)]
        if "precision" in differ and cfg.check:
            diffs.append("a --check without --precision runs in fp64, exact; to continue this checkpoint give "
                         f"--precision {differ['precision'][0]} (its check is then that precision's)")
        if "lr_schedule" in differ:
            diffs.append("a cosine schedule's rate at each step depends on its floor, warm-up and length, so a "
                         "cosine run resumes only to finish the steps it was started with")
        if not diffs and cfg.num_batches is not None and cfg.num_batches <= step \
                and not finishing(run_dir, cfg, step, cfg.num_batches):
            raise UsageError(f"--resume {run_dir}: the checkpoint has already trained {step} steps; "
                             f"ask for more than that with --num-batches (got {cfg.num_batches})")
        if diffs:
            raise UsageError(f"--resume {run_dir}: the checkpoint is from a different run "
                             f"({'; '.join(diffs)}); use the same options"
                             + (" (the layout may differ: strategy, workers, pp, tp... are resharded)"
                                if other and len(other) < len(differ) else ""))


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
