"""Strategy registry: command-line name -> class. Adding a strategy is one file and one line."""
from __future__ import annotations

import importlib

from ..errors import UsageError

REGISTRY = {
    "single": "paralab.strategies.single:Single",
    "allreduce": "paralab.strategies.allreduce:AllReduce",
}


def strategy_names() -> list[str]:
    return list(REGISTRY)


def get_strategy(name: str):
    if name not in REGISTRY:
        raise UsageError(f"unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
