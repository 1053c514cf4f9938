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
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


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
