"""The check's verdict held outside the sandbox: a run's final weights against the grader's own.

A submission's run writes its records from its own processes, which the student's code shares, so
the verdict in its ``summary.json`` is only as honest as that code: a file that loosens the check's
tolerances (one line), or writes a summary of its own, would pass. The grader therefore also trains
the answer itself, outside the sandbox and with paralab's own code (:func:`read_truth` of its run: the
assignment's ``reference`` at its largest worker count, or ``single`` on one worker; in fp64 any correct
layout ends where one process does), and reads each run's last committed checkpoint in its own process
(:func:`final_weights`, through ``run/checkpoint.read_all``): ``torch.load(weights_only=True)``, so a
checkpoint's bytes cannot run code, files larger than :data:`SIZE_FACTOR` times the answer refused unread, and
the model put together by code the student did not write:

- ``replicas``: every rank's file holds the whole model (``DataParallel``'s state), and each is compared;
- ``schedule``: the stages' tensors, put together as the pipeline strategy does (``Pipeline.consolidate``);
- ``strategy``: the layout is the student's own, so ``paralab export`` puts it together in the sandbox
  (``grade.py`` runs it there) and the grader reads the one file it wrote.

The weights pass within twice the check's weight tolerance at the run's precision (each side is within
it of one process). What a sandboxed file can still forge is what only its processes see: which
collectives it called and the bytes they sent (docs/grading.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SIZE_FACTOR = 16  # a rank's checkpoint file may hold this many times the model's bytes (optimizer state, ...)
CHECKPOINT_SLACK = 1 << 20


def precision_of(train: list[str]) -> str:
    """The ``--precision`` an assignment trains in (the check's default, fp64, when not given)."""
    return train[train.index("--precision") + 1] if "--precision" in train[:-1] else "fp64"


def tolerance(train: list[str]) -> float:
    from ..check.reference import TOLERANCES
    return 2 * TOLERANCES.get(precision_of(train), TOLERANCES["fp32"])["weights"]


@dataclass
class Truth:
    """The answer: the whole model after ``step`` steps as paralab's own run ended it, in float64."""
    tensors: dict
    step: int
    tolerance: float


def read_truth(folder: Path, train: list[str]) -> tuple[Truth | None, str]:
    """The final checkpoint of paralab's own run in ``folder`` (trusted: written by paralab's strategy), put
    together: (the truth, '') or (None, why not)."""
    from ..run.consolidate import consolidate
    from ..errors import UsageError
    try:
        tensors, facts = consolidate(folder)
    except (UsageError, OSError, RuntimeError) as exc:
        return None, f"the grader's reference run left no model ({exc})"
    return Truth({k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}, facts["step"],
                 tolerance(train)), ""


def _bounded_load(path: Path, limit: int):
    """A file written in the sandbox, refused unread over ``limit`` bytes, loaded ``weights_only``."""
    import torch
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path.name} holds {size} bytes, more than {limit} for this model")
    return torch.load(path, map_location="cpu", weights_only=True)


def final_weights(run_dir: Path, form: str, truth: dict, step: int,
                  exported: Path | None = None) -> tuple[list[dict], str]:
    """A finished run's weights after ``step``, read here: a list of whole models (one per rank for
    ``replicas``, one otherwise), or ([], why they cannot be read). ``exported``: the ``strategy`` form's
    file, written by ``paralab export`` in the sandbox."""
    from ..errors import UsageError
    limit = SIZE_FACTOR * sum(v.numel() * v.element_size() for v in truth.values()) + CHECKPOINT_SLACK
    try:
        if form == "strategy":
            if exported is None or not exported.is_file():
                return [], "`paralab export` of its checkpoint wrote no model (see export.log)"
            model = _bounded_load(exported, limit)
            return ([model] if isinstance(model, dict) else []), ("" if isinstance(model, dict) else
                                                                  "the exported file is not a state_dict")
        from ..run import generations
        from ..run.checkpoint import read_all
        gen = generations.newest(run_dir, None, None)
        if gen is None:
            return [], "the run left no committed checkpoint"
        if gen.step != step:
            return [], f"its last checkpoint is at step {gen.step}, not {step}"
        states = [f["state"] for f in read_all(run_dir, at=gen.step, max_bytes=limit)]
        if form == "replicas":
            models = [s.get("model") for s in states]
            if not all(isinstance(m, dict) for m in models):
                return [], "a rank's checkpoint holds no whole model"
            return models, ""
        from ..strategies.pipeline.strategy import Pipeline
        return [Pipeline.consolidate(states, None)], ""
    except (UsageError, OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        return [], f"its checkpoint cannot be read ({exc})"
    except Exception as exc:  # noqa: BLE001 - torch's weights-only unpickler refuses in its own ways
        return [], f"its checkpoint cannot be read ({type(exc).__name__}: {str(exc)[:200]})"


def deviation(models: list[dict], truth: dict) -> tuple[float, str]:
    """The largest absolute difference of any model's tensor from the truth's, and where (a missing or
    misshapen tensor: infinity)."""
    import torch
    worst, where = 0.0, ""
    for i, model in enumerate(models):
        for key, want in truth.items():
            got = model.get(key)
            label = f"{key}" + (f" (rank {i})" if len(models) > 1 else "")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return float("inf"), f"{label}: missing or of another shape"
            diff = (got.double() - want).abs().max().item() if want.numel() else 0.0
            if not diff <= worst:  # NaN counts as the worst
                worst, where = (float("inf") if diff != diff else diff), label
    return worst, where


def describe(worst: float, where: str, tol: float) -> str:
    return (f"final weights equal the grader's own reference (largest difference {worst:.3g} at {where or '-'},"
            f" within {tol:g})" if worst <= tol else
            f"final weights differ from the grader's own reference: {worst:.3g} at {where} (allowed {tol:g})")

