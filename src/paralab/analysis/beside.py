"""What a run measured, with what paralab predicts for it beside it: put together where a run is read.

A training run records what it measured and calls no model of its own
cost: each rank's ``held`` record (``run/held.py``: the model states and
saved activations of its first step, with a sharded strategy's ledgers
read over it) and, for such a strategy, its ``memory`` record (the
``model`` of what it holds, for the cost model). :func:`add_predictions`,
applied by :func:`~.runs.load_run` to every run a command reads (``paralab calc memory RUN``, ``plot memory``, the
compare report), adds beside each:

- ``held["predicted"]``: the planner's memory for the run's layout and that
  rank's pipeline stage (``plan/from_run.py``), or ``{"why_not": ...}``;
- ``memory["predicted"]``: the cost model's figures for that model
  (``memory.py``), and on CUDA the allocator's measured peak beside them.

So the planner can change and every old run is read with the new one.
"""
from __future__ import annotations

from types import SimpleNamespace

from ..kinds import ALLOCATOR, HELD, MEMORY, STAGE, MemoryModel
from .memory import beside_prediction, memory_per_worker


def add_predictions(config: dict, summary: dict) -> None:
    """Each rank's ``held`` and ``memory`` records in ``summary`` (summary.json, read) with the predictions
    beside them (in place). ``config``: the run's config.json."""
    per_rank = [d for d in (summary.get("strategy_details") or {}).values() if isinstance(d, dict)]
    for details in per_rank:
        memory = details.get(MEMORY)
        if isinstance(memory, dict) and memory.get("model") is not None and "predicted" not in memory:
            memory["predicted"] = predicted_memory(memory["model"])
            if ALLOCATOR in details:  # CUDA: the allocator's measured peak beside the prediction
                memory["allocator"] = beside_prediction(details[ALLOCATOR], memory["predicted"])
    if config and summary.get("global_batch") and any(HELD in d for d in per_rank):
        predict_held(config, per_rank, summary["global_batch"])


def predicted_memory(model: dict) -> dict:
    """The cost model's figures for a memory ``model`` record (``kinds.MemoryModel``: what a ledger's
    strategy holds)."""
    m = MemoryModel(**model)
    return memory_per_worker(m.parameters, m.workers, m.zero_stage, m.optimizer, m.precision,
                             unit_parameters=m.unit_parameters, step_in_backward=m.step_in_backward).to_dict()


def predict_held(config: dict, per_rank: list[dict], global_batch: int) -> None:
    """Beside each rank's ``held`` record, the planner's prediction for the run's layout and that rank's
    pipeline stage (``plan/from_run.py``), or why there is none."""
    from .plan.from_run import predict_run
    cfg = SimpleNamespace(**config)
    ranges = next((d["ranges"] for d in per_rank if STAGE in d and "ranges" in d), None)
    try:
        got = predict_run(cfg, global_batch, cut=ranges)
    except (ValueError, KeyError, ZeroDivisionError, AttributeError, TypeError) as exc:
        got = f"not predicted: {type(exc).__name__}: {exc}"  # a layout (or an old record) the planner cannot read
    for details in per_rank:
        held = details.get(HELD)
        if held is None or "predicted" in held:
            continue
        if isinstance(got, str):
            held["predicted"] = {"why_not": got}
            continue
        pp_rank = details.get(STAGE, 0) % max(cfg.pp, 1) if STAGE in details else 0
        states, activations = got.memory_by_rank[pp_rank]
        held["predicted"] = {"model_states_bytes": states, "activations_bytes": activations,
                             "total_bytes": states + activations, "layout": got.layout.label(),
                             "by": "analysis/plan (paralab plan's memory model: a sum of peaks, as measured)"}
