"""``--check-cache DIR``: a single-process reference trained once, for every run whose reference is the same.

A comparison checks many runs whose references coincide: each data-parallel run
at 2 workers replays the same 2 shards of the same batches from the same
starting weights, whatever its flavour. The reference is deterministic, so the
first run to train it keeps what the check compares (its weights and optimizer
state after each checked step, and every step's loss per shard) in DIR, and a
later run whose reference would be the same loads them instead of training it
again. Nothing else about the check changes: every rank still compares its own
view of the strategy (weights, optimizer state, losses, the next batch's
outputs, replicas) with the reference.

"The same" is decided by content, not by description. The file is named by a
SHA-256 digest (:func:`digest`) of

- the starting weights' bytes and every batch the reference trains on, shard by
  shard (what the run's own data source gives), and each step's learning rate;
- how the reference splits and replays them (shards, microbatches, BatchNorm
  rule), its dtype, device and thread count (a kernel's summation order can
  depend on the threads), the optimizer and its hyper-parameters;
- every option of the run except those that only lay the training out over
  ranks, record it or launch it (:data:`LAYOUT_ONLY`; an option added later
  counts until it is listed there, so a new option can only make runs miss);
- the model's printed structure and the source of every module class in it,
  of the reference's replay and of the loss; paralab's and torch's versions,
  the CPU's kernel level, its architecture and model (a layout held to exact
  must meet a reference computed by the same kernels), and whether the run
  is held to exact (``band.held_exact``: no band kept).

Below fp64 the file also holds the noise band that first run measured
(``check/band.py``: numbers, one per compared tensor and step), so a later run
trains neither the reference nor the band's three. Runs with gradient
compression (whose reference transforms each shard's gradient) train their
own. The file holds tensors, numbers and names only, written by
``torch.save`` and read with ``weights_only=True`` (never unpickled),
checked against the model's names, shapes and dtypes, the checked steps and
the shards; one that does not load is trained again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

#: run options that only say how the training is laid out over ranks, how it is recorded or how it is
#: launched: the reference does not read them (its split, shards x microbatches x BatchNorm rule, is
#: digested from the reference itself)
LAYOUT_ONLY = frozenset((
    "strategy", "pp", "tp", "ep", "cp", "partition", "microbatches", "schedule", "virtual_stages",
    "sequence_parallel", "accumulate", "bucket_mb", "zero_stage", "step_in_backward", "prefetch", "replicate",
    "gpus", "dispatcher", "cp_method", "cp_balance", "recompute",
    "log_every", "warmup", "eval_batches", "eval_batch_size", "out", "progress", "checkpoint_every", "resume",
    "check", "save_init", "check_every", "check_cache", "overwrite", "keep_checkpoints",
    "workers", "cores_per_worker", "world_size", "rank", "master_addr", "master_port", "backend", "device",
    "timeout", "network", "max_restarts", "start", "launched_by", "network_emulated", "started_by", "restarts",
))


@dataclass
class Snapshot:
    """The reference after one step: its weights and buffers, and each parameter's optimizer state by name."""
    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, dict]


def usable(cfg, ref) -> bool:
    """Whether this run's reference may be shared: asked for, untrained so far, without compression, not fp16,
    not following a run's routing."""
    # (a clipped reference's gradient norms are not kept: it trains beside the run; an fp16 one follows its run's
    # overflow decisions, which another layout may take at other steps; so does a mixture of experts' below fp64
    # its run's near-ties, check/routing.py)
    return bool(getattr(cfg, "check_cache", None)) and ref.step == 0 and ref.compression is None \
        and not getattr(cfg, "clip_grad", None) and getattr(cfg, "precision", None) != "fp16" \
        and getattr(ref, "routes", None) is None


def _source_files(model) -> list[str]:
    from . import band, reference
    from ..strategies import base
    from ..training import losses
    files = {inspect.getsourcefile(type(m)) for m in model.modules()}
    files |= {inspect.getsourcefile(mod) for mod in (reference, band, base, losses)}
    return sorted(f for f in files if f)


def digest(cfg, ref, steps: list[int], wire=None, held: bool = False) -> str:
    """The SHA-256 of everything that decides the reference at the checked ``steps`` (see the module), and its
    noise band: the strategy's ``gradient_wire`` (``wire``), which the band's references round through, and
    whether the run is held to exact (``held``: no band kept; ``band.held_exact``), so that a layout held to
    exact and one judged by its band on the same reference keep one file each, not one overwriting the other's."""
    from .. import __version__
    from .band import kernels
    h = hashlib.sha256()

    def text(*parts):
        for p in parts:
            h.update(repr(p).encode())
            h.update(b"\0")

    def tensor(t: torch.Tensor):
        t = t.detach().cpu().contiguous()
        text(str(t.dtype), tuple(t.shape))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in LAYOUT_ONLY}
    model = ref.model
    first = next(model.parameters())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ref.optimizer.param_groups]
    text("paralab", __version__, *kernels(), str(first.device), str(first.dtype), sorted(options.items()),
         # one shard: the BatchNorm rules agree (shard 0's statistics are all of them)
         ref.replicas, ref.microbatches, ref.bn_rule if ref.replicas > 1 else "-", list(steps),
         type(ref.optimizer).__name__, groups, str(model), str(wire), held)
    for path in _source_files(model):
        text(os.path.basename(path))
        h.update(Path(path).read_bytes())
    for name, t in model.state_dict().items():
        text(name)
        tensor(t)
    for step in range(max(steps)):
        text(step, None if ref.lr_for is None else ref.lr_for(step))
        for r in range(ref.replicas):
            x, y = ref.source.batch(step, rank=r)
            tensor(x)
            tensor(y)
    return h.hexdigest()


def path_for(folder, key: str) -> Path:
    return Path(folder) / f"reference-{key[:32]}.pt"


def load(folder, key: str, model, steps: list[int], replicas: int) -> tuple[dict | None, str | None]:
    """The kept reference named ``key``: ``({"snapshots": {step: Snapshot}, "losses": {step: [per shard]}},
    None)``, its last weights loaded into ``model``; or ``(None, why not)``."""
    path = path_for(folder, key)
    if not path.is_file():
        return None, "none kept yet"
    try:
        kept = torch.load(path, map_location="cpu", weights_only=True)
        if kept.get("digest") != key:
            return None, f"{path.name} was kept for another reference"
        snapshots = {int(s["step"]): Snapshot(int(s["step"]), s["weights"], s["optimizer"])
                     for s in kept["snapshots"]}
        losses = kept["losses"]
        mine = model.state_dict()
        if sorted(snapshots) != sorted(steps) or tuple(losses.shape) != (max(steps), replicas):
            return None, f"{path.name} holds other steps or shards"
        for snap in snapshots.values():
            state = snap.weights
            if set(state) != set(mine) or any(state[k].shape != mine[k].shape or state[k].dtype != mine[k].dtype
                                              for k in mine):
                return None, f"{path.name} holds other tensors than the model's"
        model.load_state_dict(snapshots[max(steps)].weights, strict=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file only means the reference is trained again
        return None, f"{path.name} did not load ({type(exc).__name__}: {exc})"
    bands = kept.get("bands")  # below fp64: the noise band that run measured (check/band.py)
    if bands is not None:
        bands = {"tensors": {int(step): (w, o) for step, (w, o) in bands["tensors"].items()}, "end": bands["end"]}
    return {"snapshots": snapshots, "losses": {step: row for step, row in enumerate(losses.tolist())},
            "bands": bands}, None


def keep(folder, key: str, snapshots: dict[int, Snapshot], losses: dict[int, list[float]],
         bands: dict | None = None) -> str | None:
    """Write the reference named ``key`` (atomically): its ``snapshots`` at the checked steps and every step's
    loss per shard, and below fp64 its noise band (numbers only); None if kept, else why not."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".reference-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"digest": key,
                            "snapshots": [{"step": s.step, "weights": {k: v.cpu() for k, v in s.weights.items()},
                                           "optimizer": s.optimizer} for s in snapshots.values()],
                            "losses": torch.tensor([losses[step] for step in range(len(losses))],
                                                   dtype=torch.float64),
                            "bands": None if bands is None else
                            {"tensors": {step: list(pair) for step, pair in bands["tensors"].items()},
                             "end": bands["end"]}}, f)
            os.replace(tmp, path_for(folder, key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        return f"not kept ({exc.strerror or exc})"
    return None
