"""A training state in no layout: what a checkpoint becomes to resume under another strategy or layout.

:class:`Portable` holds, under the plain model's names (its ``state_dict()``
keys), every tensor whole, and for every trainable parameter its optimizer
state whole (SGD's ``momentum_buffer``, Adam's ``exp_avg``, ``exp_avg_sq``
and ``step``): the state a single process would hold at that step. A
strategy makes one from every rank's saved ``state_dict()`` offline
(``Strategy.portable(states, model)``, a classmethod, as ``consolidate``),
and takes its own part of one (``Strategy.load_portable``): its slice of a
tensor-parallel split, its padded flat shard of an fsdp unit, its stage's
keys. ``notes`` says what the old layout held that this form cannot carry.

The helpers below are what several strategies share: an optimizer's state
by parameter name and back, and a flat unit's (fsdp, ZeRO-1) padded shards
of parameters and of their optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class Portable:
    tensors: dict[str, torch.Tensor]                 # the plain model's state_dict, whole
    optimizer: dict[str, dict] = field(default_factory=dict)  # parameter name -> its optimizer state, whole
    notes: list[str] = field(default_factory=list)   # what the old layout held that is not carried
    loss_scale: list | None = None                    # fp16's loss scale and its count (training/loss_scale.py)


def trainable(units: dict[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(plain name, parameter) of the trainable parameters of ``units`` (plain index -> unit), in the
    order a module holding them in order yields them (what an optimizer built on it numbers)."""
    return [(f"{i}.{n}", p) for i, unit in units.items() for n, p in unit.named_parameters() if p.requires_grad]


def optimizer_by_name(saved: dict, names: list[str]) -> dict[str, dict]:
    """A ``torch.optim`` state_dict whose parameters were ``names`` in order -> {name: state}."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(ids) != len(names):
        raise ValueError(f"the optimizer state covers {len(ids)} parameters, the layout has {len(names)}")
    return {name: dict(saved["state"][i]) for name, i in zip(names, ids) if i in saved["state"]}


def optimizer_for(optimizer: torch.optim.Optimizer, names: list[str], by_name: dict[str, dict]) -> dict:
    """The inverse: a state_dict for ``optimizer`` (whose parameters are ``names`` in order), its
    hyper-parameters its own (this run's), its state the portable one's."""
    current = optimizer.state_dict()
    ids = [i for group in current["param_groups"] for i in group["params"]]
    return {"state": {i: dict(by_name[n]) for n, i in zip(names, ids) if n in by_name},
            "param_groups": current["param_groups"]}


def slots(unit: nn.Module) -> list[tuple[str, torch.Size]]:
    """A flat unit's parameters in the order ``fsdp/flat.py`` lays them out (name in unit, shape)."""
    return [(n, p.shape) for n, p in unit.named_parameters() if p.requires_grad]


def unflatten(flat: torch.Tensor, index: int, layout: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    """A flat unit's (padded) tensor -> its parameters' tensors under plain names (the padding cut)."""
    out, offset = {}, 0
    for name, shape in layout:
        n = shape.numel()
        if offset + n > flat.numel():
            raise ValueError(f"unit {index}'s shards hold {flat.numel()} values, fewer than its parameters")
        out[f"{index}.{name}"] = flat[offset:offset + n].view(shape).clone()
        offset += n
    return out


def shard_of(tensors: list[torch.Tensor], padded: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the flat tensor ``tensors`` make, zero-padded to ``padded``."""
    flat = torch.zeros(padded, dtype=tensors[0].dtype)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:sum(t.numel() for t in tensors)])
    size = padded // world
    return flat[rank * size:(rank + 1) * size].clone()


def flat_optimizer_portable(shard_states: list[dict], index: int, layout) -> dict[str, dict]:
    """One flat unit's optimizer state, as each rank's optimizer holds it for its shard (rank order),
    -> each parameter's whole state: per-element entries concatenated and cut like the parameters,
    scalars (Adam's step) given to every parameter of the unit."""
    if not shard_states or any(not s for s in shard_states):
        return {}  # never stepped: no state
    out: dict[str, dict] = {f"{index}.{name}": {} for name, _ in layout}
    for key, value in shard_states[0].items():
        if torch.is_tensor(value) and value.dim() > 0:
            whole = unflatten(torch.cat([s[key].reshape(-1) for s in shard_states]), index, layout)
            for name, t in whole.items():
                out[name][key] = t
        else:
            for name in out:
                out[name][key] = value.clone() if torch.is_tensor(value) else value
    return out


def flat_optimizer_shard(by_name: dict[str, dict], index: int, layout, padded: int, rank: int,
                         world: int) -> dict | None:
    """The inverse of :func:`flat_optimizer_portable` for one rank's shard (None: no state)."""
    names = [f"{index}.{name}" for name, _ in layout]
    if not all(n in by_name for n in names):
        return None
    first = by_name[names[0]]
    out = {}
    for key, value in first.items():
        if torch.is_tensor(value) and value.dim() > 0:
            out[key] = shard_of([by_name[n][key] for n in names], padded, rank, world)
        else:
            values = {float(by_name[n][key]) if torch.is_tensor(by_name[n][key]) else by_name[n][key] for n in names}
            if len(values) > 1:
                raise ValueError(f"unit {index}: its parameters' optimizer {key!r} differ ({sorted(values)}); "
                                 "one flat shard cannot hold them")
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def tp_chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice along ``dim`` (``torch.chunk``'s, as tensor parallelism cuts)."""
    return t.chunk(size, dim)[rank].clone()
