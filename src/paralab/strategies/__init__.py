"""Strategy registry: command-line name -> class. Adding a strategy is one file and one line."""
from __future__ import annotations

import importlib

from ..errors import UsageError

REGISTRY = {
    "single": "paralab.strategies.single:Single",
    "gather-scatter": "paralab.strategies.gather_scatter:GatherScatter",
    "allreduce": "paralab.strategies.allreduce:AllReduce",
    "ddp": "paralab.strategies.ddp:DDP",
    "torch-ddp": "paralab.strategies.torch_ddp:TorchDDP",
    "fsdp": "paralab.strategies.fsdp:FSDP",
    "torch-fsdp": "paralab.strategies.torch_fsdp:TorchFSDP",
    "model": "paralab.strategies.model_parallel:ModelParallel",
    "pipeline": "paralab.strategies.pipeline:Pipeline",
}


def strategy_names() -> list[str]:
    return list(REGISTRY)


def get_strategy(name: str):
    if name not in REGISTRY:
        raise UsageError(f"unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
