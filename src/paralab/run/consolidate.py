"""A run's model put together offline, in one process, from every rank's checkpoint file.

Every strategy checkpoints in its own layout (``run/checkpoint.py``); :func:`consolidate` reads the
newest committed generation's files (``weights_only``), rebuilds the run's model from its recorded
config under the checkpoint's identity, and lets the strategy that wrote them put them together
(its ``consolidate``, no process group). ``paralab export`` writes the result; the grader reads its
own reference run's model with it (``grading/weights.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError

#: every dataset paralab reads has 10 classes (the models' last layer)
NUM_CLASSES = 10


def read_states(run_dir: Path, tag: str | None) -> tuple[list[dict], int, dict]:
    """Every rank's checkpoint (weights_only), checked to be one run at one step: (files, step, identity)."""
    import sys

    from .checkpoint import checkpoint_path, read_all, torn_note
    if tag and checkpoint_path(run_dir, 0, tag) is None:
        raise UsageError(f"{run_dir} has no starting-weights checkpoint (no committed checkpoint/{tag}/); "
                         "a run keeps them only when trained with --save-init")
    torn = None if tag else torn_note(run_dir)
    if torn:
        print(f"paralab: {torn}", file=sys.stderr, flush=True)
    files = read_all(run_dir, tag)  # the newest committed generation, or UsageError saying why not
    return files, files[0]["step"], files[0]["identity"]


def run_config(run_dir: Path, ident: dict):
    """The run's config: config.json (a finished run) under the checkpoint's identity (always there)."""
    from .config import RunConfig
    recorded = {}
    config_file = run_dir / "config.json"
    if config_file.exists():
        try:
            recorded = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{config_file} is not readable JSON ({exc})")
    return RunConfig.from_dict({**recorded, **ident})


def consolidate(run_dir: Path, tag: str | None = None) -> tuple[dict, dict]:
    """(the whole model's tensors, facts about them) from RUN's rank files; offline, one process."""
    from ..models import MODALITY, build_model, model_shape
    from ..strategies import plan
    files, step, ident = read_states(run_dir, tag)
    cfg = run_config(run_dir, ident)
    world = int(ident["world"])
    try:
        shape, strategy_cls, composition = plan(cfg, world)
        model = build_model(cfg.model, width=cfg.width, norm=cfg.norm, num_classes=NUM_CLASSES, **model_shape(cfg))
    except (UsageError, ValueError) as exc:
        raise UsageError(f"{run_dir}: the checkpoint's run cannot be rebuilt here ({exc})")
    tensors = strategy_cls.consolidate([f["state"] for f in files], model)
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors]
    extra = [k for k in tensors if k not in expected]
    wrong = [f"{k}: {tuple(tensors[k].shape)} (model {tuple(v.shape)})" for k, v in expected.items()
             if k in tensors and tensors[k].shape != v.shape]
    if missing or extra or wrong:
        raise RuntimeError(f"the consolidated {cfg.strategy} checkpoint does not fit the model: "
                           f"missing {missing[:5]}, unexpected {extra[:5]}, shapes {wrong[:5]}")
    model.load_state_dict(tensors)  # strict: keys, shapes, and values it can take
    parts = [composition[k].__name__ for k in ("inner_cls", "replicas_cls") if k in composition]
    parts += [v.__name__ for v in (composition.get("inner_kwargs") or {}).values() if isinstance(v, type)]
    layout = strategy_cls.__name__ + (f" around {' with '.join(parts)}" if parts else "")
    facts = {"strategy": cfg.strategy, "layout": layout, "step": step, "world": world, "mesh": shape.to_dict(),
             "parameters": sum(p.numel() for p in model.parameters()),
             "build": f"build_model({cfg.model!r}, width={cfg.width}, norm={cfg.norm!r}, num_classes={NUM_CLASSES}"
                      + "".join(f", {k}={v}" for k, v in model_shape(cfg).items() if MODALITY[cfg.model] == "text")
                      + ")"}
    return {k: tensors[k] for k in expected}, facts
