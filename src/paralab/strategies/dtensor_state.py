"""A rank's own slices of a DTensor-sharded model and optimizer, saved and restored.

PyTorch's built-ins that shard with DTensor (``torch-fsdp``, ``torch-tp``)
checkpoint the same way: each rank keeps the local tensor of every DTensor
(parameters, buffers, optimizer state) under the plain keys, and on load
copies them back in place and rebuilds the optimizer state as DTensors laid
out like their parameters. Putting the slices together is each strategy's
``consolidate`` (their layouts differ).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from .portable import Portable, optimizer_by_name, optimizer_for


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def held_gradients(params: list, world: int) -> list[tuple[torch.Tensor, int]]:
    """Each parameter's gradient as this rank holds it, for the whole model's norm (``--clip-grad``; ``world``:
    the ranks the layout spans). A DTensor's local tensor is counted once per rank of the mesh dimensions it is
    replicated over, times the ranks outside its mesh (which hold the same: a LayerNorm FSDP shards over dp is
    whole on every tp rank); a plain tensor's (a parameter the layout left out), once per rank. A gradient
    still pending its reduction (``Partial``: a sequence-parallel LayerNorm's) is reduced first, as the
    optimizer step would (DTensor's own collective, not timed by comm.py)."""
    held = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            held.append((g, world))
            continue
        if any(pl.is_partial() for pl in g.placements):
            g = p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        copies = world // g.device_mesh.size()
        for dim, pl in enumerate(g.placements):
            if pl.is_replicate():
                copies *= g.device_mesh.size(dim)
        held.append((g.to_local(), copies))
    return held


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model": ..., "optimizer": ...}``: copies of this rank's local tensors, plain keys."""
    opt = optimizer.state_dict()
    opt["state"] = {pid: {k: local(v).detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for pid, s in opt["state"].items()}
    return {"model": {k: local(v).detach().clone() for k, v in model.state_dict().items()}, "optimizer": opt}


@torch.no_grad()
def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, params: list, state: dict) -> None:
    """The inverse of :func:`local_state`; ``params`` in the optimizer's order."""
    for k, v in model.state_dict().items():
        local(v).copy_(state["model"][k])
    opt = state["optimizer"]
    for pid, s in opt["state"].items():
        p = params[int(pid)]
        for k, v in s.items():
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0:
                s[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride(), run_check=False)
    optimizer.load_state_dict(opt)


def chunk_of(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s local part of ``t`` split as ``Shard(dim)`` splits it (``torch.chunk``: the last
    ranks' parts shorter, or empty)."""
    parts = t.chunk(world, dim)
    return parts[rank].clone() if rank < len(parts) else t.narrow(dim, 0, 0).clone()


def portable_from_local(states: list[dict], names: list[str], dim_of) -> Portable:
    """Offline: every rank's :func:`local_state` (rank order) -> a Portable; ``names``: the optimizer's
    parameters in order; ``dim_of(key)``: the dimension a tensor is split along, None if replicated."""
    def whole(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
        dim = dim_of(key)
        return torch.cat(parts, dim) if dim is not None and parts[0].dim() > 0 else parts[0]
    tensors = {k: whole(k, [s["model"][k] for s in states]) for k in states[0]["model"]}
    by_rank = [optimizer_by_name(s["optimizer"], names) for s in states]
    optimizer = {n: {key: whole(n, [r[n][key] for r in by_rank]) if torch.is_tensor(v) else v
                     for key, v in st.items()} for n, st in by_rank[0].items()}
    return Portable(tensors, optimizer)


def local_from_portable(portable: Portable, model: nn.Module, optimizer: torch.optim.Optimizer, dim_of,
                        rank: int, world: int) -> dict:
    """This rank's :func:`local_state` made from a Portable (the inverse of :func:`portable_from_local`)."""
    def part(key: str, t: torch.Tensor) -> torch.Tensor:
        dim = dim_of(key)
        return chunk_of(t, dim, rank, world) if dim is not None and t.dim() > 0 else t
    names = [n for n, _ in model.named_parameters()]
    mine = {n: {key: part(n, v) if torch.is_tensor(v) else v for key, v in st.items()}
            for n, st in portable.optimizer.items()}
    return {"model": {k: part(k, portable.tensors[k]) for k in model.state_dict()},
            "optimizer": optimizer_for(optimizer, names, mine)}
