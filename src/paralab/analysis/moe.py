"""A mixture of experts' figures: parameters and FLOPs per token (active vs total), and the load a run saw.

Parameters come from the shape (``models/gpt.py``: ``parameter_counts`` with
each block's MLP replaced by a router and E experts, K of which a token uses).
FLOPs per token are ``6 N + 12 L h s`` (``tensor.flops_per_token``) with N the
parameters that multiply a matrix, embedding tables left out: *active* counts
the K experts a token runs (plus the router), *total* all E (what a dense model
of the same size would cost). The load is what the steps' ``moe`` records say
(``strategies/base.moe_record``), summed over the ranks and steps.

The all-to-all volume (``a2a_bytes``): each of a rank's kept choices sends one
row of ``h`` elements to the rank of its expert and gets one back, so per MoE
layer, forward, one direction: ``choices x h x element size``, of which the
share for experts on other ranks, ``(ep - 1) / ep`` under an even load, crosses
the network; backward sends the same again both ways.
"""
from __future__ import annotations

import math

from ..models.gpt import VOCAB, moe_parameter_counts, parameter_counts
from .tensor import flops_per_token


def parameters(cfg) -> dict:
    """Total and active parameters of the MoE gpt of ``cfg``, and FLOPs per token of each."""
    c = parameter_counts(cfg.layers, cfg.embed, cfg.context, VOCAB)
    m = moe_parameter_counts(cfg.layers, cfg.embed, cfg.experts, cfg.top_k, cfg.expert_hidden)
    total = c["total"] - m["dense_mlp"] + m["router"] + m["expert_total"]
    active = total - m["expert_total"] + m["expert_active"]
    tables = c["tokens"] + c["positions"]
    per_token = {name: flops_per_token(n - tables, cfg.layers, cfg.embed, cfg.context).value
                 for name, n in (("active", active), ("total", total))}
    return {"parameters_total": total, "parameters_active": active, "expert_parameters": m["expert_total"],
            "router_parameters": m["router"], "flops_per_token_active": per_token["active"],
            "flops_per_token_total": per_token["total"]}


def a2a_bytes(choices: int, embed: int, element: int, ep: int) -> dict:
    """Per MoE layer and forward, one direction: the rows a rank sends, and those that leave it
    (an even load: ``(ep - 1) / ep`` of them go to other ranks)."""
    sent = choices * embed * element
    return {"bytes": sent, "bytes_remote": sent * (ep - 1) / ep}


def step_volume(tokens: int, top_k: int, experts: int, embed: int, layers: int, ep: int, element: int,
                capacity_factor: float | None = None) -> dict:
    """Under an even load: a rank's kept choices per layer and forward (all its ``tokens x K``, or the
    capacity ``E x ceil(F tokens K / E)`` if smaller), and its token all-to-all bytes per step: dispatch and
    combine, forward and backward (4 transfers) per layer."""
    choices = tokens * top_k
    if capacity_factor is not None:
        choices = min(choices, experts * math.ceil(capacity_factor * tokens * top_k / experts))
    one = a2a_bytes(choices, embed, element, ep)
    return {"choices": choices, "per_transfer": one["bytes"], "per_step": 4 * layers * one["bytes"],
            "per_step_remote": 4 * layers * one["bytes_remote"]}


#: optimizer state per parameter, in parameters' worth (SGD with momentum: one buffer; Adam: two)
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2}


def memory_per_rank(params: dict, ep: int, element: int, optimizer: str) -> dict:
    """Model-state bytes a rank holds under ep: everything but the experts whole, E / ep experts;
    parameters, gradients and optimizer state alike."""
    held = params["parameters_total"] - params["expert_parameters"] + params["expert_parameters"] // ep
    per = (2 + OPTIMIZER_STATE[optimizer]) * element
    return {"parameters_held": held, "bytes": held * per, "bytes_all_experts": params["parameters_total"] * per}


def load(steps: list[dict]) -> dict | None:
    """Per MoE layer: tokens routed to each expert (every rank and step), dropped choices, the
    auxiliary loss per step (mean over ranks), the smallest top-k margin; None without records. A
    record names its layer (``layer``: under a pipeline each rank holds some of them); older records
    are numbered by position."""
    rows = [r for r in steps if r.get("moe")]
    if not rows:
        return None
    by_layer: dict[int, list[tuple[int, dict]]] = {}
    for r in rows:
        for i, rec in enumerate(r["moe"]):
            by_layer.setdefault(rec.get("layer", i), []).append((r["step"], rec))
    layers = []
    for _, recs in sorted(by_layer.items()):
        counts = [sum(c) for c in zip(*(rec["counts"] for _, rec in recs))]
        by_step: dict[int, list[float]] = {}
        for step, rec in recs:
            by_step.setdefault(step, []).append(rec["aux"])
        layers.append({"tokens_per_expert": counts,
                       "imbalance": max(counts) / (sum(counts) / len(counts)) if sum(counts) else None,
                       "dropped": sum(rec["dropped"] for _, rec in recs),
                       "aux_per_step": [sum(v) / len(v) for _, v in sorted(by_step.items())],
                       "min_margin": min(rec["min_margin"] for _, rec in recs)})
    return {"layers": layers, "dropped": sum(layer["dropped"] for layer in layers),
            "min_margin": min(layer["min_margin"] for layer in layers)}
