"""The planner's memory prediction for a run that happened: its layout read from its configuration.

A run whose data-parallel flavour is the one the planner's layouts stand for
(one that keeps a copy of the gradients in buckets, ZeRO-0, or one that
shards at a ZeRO stage), with any ``--tp``, ``--pp``, ``--cp``,
``--replicate``, ``--recompute``, a mixture of experts with ``--ep`` (its
all-to-all dispatcher), in fp32, is a layout the planner models;
:func:`predict_run` rebuilds it (the model as paralab's own, the run's
microbatches and, for a pipeline, the cut it chose) and predicts each
pipeline rank's model states and activations. ``analysis/beside.py`` puts
the prediction beside what each rank measured it holds (``run/held.py``)
where a run directory is read, never in the run. Any other run gets the
reason it is not predicted.
"""
from __future__ import annotations

from ...strategies.pipeline.schedules import spec_of
from ..memory import optimizer_kind
from .cluster import PRESETS
from .layouts import Layout
from .predict import Prediction, Setting, predict
from .workload import cnn_workload, gpt_workload

def predict_run(cfg, global_batch: int, cut: list | None = None) -> Prediction | str:
    """The prediction for ``cfg``'s layout, or why there is none."""
    from ...strategies import get_strategy
    flavour = get_strategy(cfg.strategy).pipeline_replicas(cfg)  # None but for the data-parallel strategies
    zero = getattr(flavour, "zero_stage", 0)
    if flavour is None or not (zero or flavour.gradient_copy):
        return (f"the planner's layouts are bucketed (ZeRO-0) or sharded (ZeRO 1-3) data parallelism, not "
                f"{cfg.strategy}'s")
    if cfg.precision != "fp32":
        return f"the planner models fp32 (and 16-bit) states, not --precision {cfg.precision}"
    experts = getattr(cfg, "experts", 0)
    if experts and getattr(cfg, "dispatcher", "all-to-all") != "all-to-all" and cfg.ep > 1:
        return f"the planner models the all-to-all dispatcher of --ep, not --dispatcher {cfg.dispatcher}"
    if cfg.model != "gpt" and (cfg.norm or "batch") != "batch":
        return f"the planner counts the CNNs as built by default (BatchNorm), not --norm {cfg.norm}"
    moe = dict(experts=experts, top_k=cfg.top_k, expert_hidden=cfg.expert_hidden,
               capacity_factor=cfg.capacity_factor) if experts else {}
    work = (gpt_workload(cfg.layers, cfg.embed, cfg.heads, cfg.context, 256, activations="paralab", **moe)
            if cfg.model == "gpt" else cnn_workload(cfg.model, cfg.width))
    pp, tp, C, replicate = cfg.pp, cfg.tp, getattr(cfg, "cp", 1), getattr(cfg, "replicate", 1)
    dp = cfg.workers // (pp * tp * C)
    m = cfg.microbatches if pp > 1 else cfg.accumulate
    per_replica = global_batch // dp
    if per_replica % m:
        return f"{per_replica} samples per replica do not split into {m} microbatches"
    v = cfg.virtual_stages if pp > 1 and spec_of(cfg.schedule).virtual else 1
    if cut is not None and len(cut) != pp * v:
        cut = None
    lay = Layout(dp, tp, pp, zero, bool(cfg.sequence_parallel), cfg.schedule if pp > 1 else None, v,
                 per_replica // m, m, cfg.recompute, C, getattr(cfg, "cp_method", "ring"), replicate,
                 getattr(cfg, "ep", 1))
    setting = Setting(global_batch, "fp32", optimizer_kind(cfg.optimizer, cfg.momentum))
    return predict(work, lay, PRESETS["cpu"], setting, cut=cut if pp > 1 else None)
