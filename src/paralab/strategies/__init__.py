"""Strategy registry: command-line name -> class. Adding a strategy is one file and one line.

:func:`plan` composes: the named strategy alone, or, under ``--pp P``, the
pipeline with each stage wrapped in the named strategy's data-parallel
flavour (stage the model first, then wrap each stage for data parallelism).
"""
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


def plan(cfg, world: int):
    """(mesh shape, the class that runs, its extra keyword arguments) for ``cfg`` on ``world`` ranks.

    Raises UsageError where the layout cannot work (the strategy's own
    ``mesh_shape`` says why).
    """
    from .pipeline import Pipeline
    cls = get_strategy(cfg.strategy)
    shape = cls.mesh_shape(cfg, world)
    if shape.pp > 1 and not issubclass(cls, Pipeline):
        return shape, Pipeline, {"replicas_cls": cls.pipeline_replicas(cfg)}
    return shape, cls, {}
