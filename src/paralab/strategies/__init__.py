"""Strategy registry: command-line name -> class. Adding a strategy is one file and one line; a strategy
of the user's own is a file named on the command line (``user.py``).

:func:`plan` composes: the named strategy alone, or, under ``--pp P`` and/or
``--tp T``, the pipeline and/or tensor parallelism with the named strategy's
data-parallel flavour around each part (stage the model first, then shard
each stage's units over tp, then wrap them for data parallelism); under
``--ep N``, expert parallelism with the named flavour (``strategies/expert/``); under
``--cp C``, context parallelism around all of it (``context/``).
"""
from __future__ import annotations

import importlib
from functools import lru_cache

from ..errors import UsageError
from . import user

REGISTRY = {
    "single": "paralab.strategies.single:Single",
    "gather-scatter": "paralab.strategies.gather_scatter:GatherScatter",
    "allreduce": "paralab.strategies.allreduce:AllReduce",
    "ddp": "paralab.strategies.ddp:DDP",
    "torch-ddp": "paralab.strategies.torch_ddp:TorchDDP",
    "torch-dp": "paralab.strategies.torch_dp:TorchDP",
    "fsdp": "paralab.strategies.fsdp:FSDP",
    "torch-fsdp": "paralab.strategies.torch_fsdp:TorchFSDP",
    "model": "paralab.strategies.model_parallel:ModelParallel",
    "pipeline": "paralab.strategies.pipeline:Pipeline",
    "torch-pipeline": "paralab.strategies.torch_pipeline:TorchPipeline",
    "tp": "paralab.strategies.tensor:TensorParallel",
    "torch-tp": "paralab.strategies.torch_tp:TorchTP",
    "cp": "paralab.strategies.context:ContextParallel",
    "torch-cp": "paralab.strategies.torch_cp:TorchCP",
}


def strategy_names() -> list[str]:
    return list(REGISTRY)


def get_strategy(name: str):
    """The class of strategy ``name``: a registered one, or the user's ``PATH.py[:CLASS]`` (``user.py``)."""
    if user.is_file(name):
        return user.load(name)
    if name not in REGISTRY:
        import difflib
        near = difflib.get_close_matches(name, list(REGISTRY), n=1)
        guess = f" (did you mean {near[0]!r}?)" if near else ""
        raise UsageError(f"unknown strategy {name!r}{guess}; choose one of {', '.join(REGISTRY)}, or a file of your "
                         "own, PATH.py[:CLASS] (docs/own-strategy.md)")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


@lru_cache(maxsize=None)
def strategy_for(role: str) -> str | None:
    """The registered strategy that plays ``role`` (its class lists it in ``roles``), else None.

    Roles: "baseline", the single-process run speed-ups are measured against (and sweeps' 1-worker
    point); "scaling", the data-parallel strategy ``paralab sweep scaling`` studies by default.
    """
    for name in strategy_names():
        try:
            cls = get_strategy(name)
        except Exception:  # noqa: BLE001 - a strategy that does not import plays no role
            continue
        if role in (getattr(cls, "roles", None) or ()):
            return name
    return None


def plan(cfg, world: int):
    """(mesh shape, the class that runs, its extra keyword arguments) for ``cfg`` on ``world`` ranks.

    Raises UsageError where the layout cannot work (the strategy's own
    ``mesh_shape`` says why). Under ``--cp C`` context parallelism wraps the
    layout :func:`inner_plan` gives (``context/strategy.py``).
    """
    shape, cls, kwargs = inner_plan(cfg, world)
    cp = getattr(cfg, "cp", 1)
    if cp > 1 and shape.cp != cp:  # a pure form lays out its own mesh, with no cp in it
        raise UsageError(f"strategy {cfg.strategy!r} does not compose with --cp {cp}: name a data-parallel "
                         f"flavour, e.g. 'paralab train allreduce --workers {world} --cp {cp} --model gpt'")
    if shape.cp > 1:
        from .context import ContextParallel
        return shape, ContextParallel, {"inner_cls": cls, "inner_kwargs": kwargs}
    return shape, cls, kwargs


def inner_plan(cfg, world: int):
    """:func:`plan` without context parallelism's wrapper (what it wraps)."""
    from .data_parallel import DataParallel
    from .pipeline import Pipeline
    from .tensor import TensorParallel
    cls = get_strategy(cfg.strategy)
    if getattr(cfg, "ep", 1) > 1 and getattr(cfg, "cp", 1) > 1:
        raise UsageError("--cp with --ep (a mixture of experts) is not composed: drop one of them")
    if getattr(cfg, "replicate", 1) > 1:  # HSDP: a sharded strategy's dp split into replica x shard groups
        if not getattr(cls, "hsdp", False):
            able = [n for n in strategy_names() if getattr(get_strategy(n), "hsdp", False)]
            raise UsageError(f"--replicate {cfg.replicate} splits a sharded data-parallel dimension into replica "
                             f"groups (HSDP); strategy {cfg.strategy!r} does not shard: use {', '.join(able)} "
                             "or drop --replicate")
        if getattr(cfg, "ep", 1) > 1:
            raise UsageError("--replicate and --ep both subdivide the data-parallel replicas; drop one")
        if getattr(cfg, "cp", 1) > 1:
            raise UsageError("--replicate (HSDP) with --cp is not composed: drop one of them")
    if getattr(cfg, "ep", 1) > 1:  # expert parallelism: the named flavour over dp and over edp (strategies/expert/)
        from .expert import ExpertParallel
        shape, kwargs = ExpertParallel.mesh_shape(cfg, world), {"replicas_cls": cls.pipeline_replicas(cfg)}
        inner = ExpertParallel
        if shape.pp > 1:  # each stage's flavour is the named one twice, over dp and over edp
            from .expert import ExpertReplicas
            inner, kwargs = Pipeline, {"replicas_cls": ExpertReplicas.over(kwargs["replicas_cls"])}
        if shape.tp > 1:
            return shape, TensorParallel, {"inner_cls": inner, "inner_kwargs": kwargs}
        return shape, inner, kwargs
    shape = cls.mesh_shape(cfg, world)
    if issubclass(cls, (Pipeline, TensorParallel)):  # the pure forms (they build what they wrap themselves)
        if shape.tp > 1 and not issubclass(cls, TensorParallel):
            return shape, TensorParallel, {"inner_cls": cls}
        return shape, cls, {}
    if shape.tp > 1 and cls.pipeline_replicas(cfg) is None:  # it lays out tp itself (torch-tp): nothing to wrap
        return shape, cls, {}
    inner, kwargs = cls, {}
    if shape.pp > 1:
        inner, kwargs = Pipeline, {"replicas_cls": cls.pipeline_replicas(cfg)}
    if shape.tp > 1:  # the flavour wraps the sharded model (or each sharded stage)
        if shape.pp == 1 and getattr(cls, "runs_tensor_parallel", lambda cfg: False)(cfg):
            inner, kwargs = cls, {}  # the strategy itself on the sharded units (fsdp at ZeRO-2/3)
        elif shape.pp == 1:
            inner, kwargs = DataParallel, {"replicas_cls": cls.pipeline_replicas(cfg)}
        return shape, TensorParallel, {"inner_cls": inner, "inner_kwargs": kwargs}
    if shape.cp > 1 and shape.pp == 1:  # the flavour wraps the model whose attention sees the cp group
        inner, kwargs = DataParallel, {"replicas_cls": cls.pipeline_replicas(cfg)}
    return shape, inner, kwargs


def check_limit(cfg, world: int) -> str | None:
    """Why ``--check`` of ``cfg`` on ``world`` ranks cannot be trusted to pass although the arithmetic
    is right (None: it can): the ``check_limit`` of the class that runs (:func:`plan`: under ``--tp``
    the tensor parallelism around the named flavour), else of the named class. ``train --check``
    refuses such a run (``RunConfig.validate``), ``paralab compare --check`` leaves it out."""
    named = get_strategy(cfg.strategy)
    try:
        runs = plan(cfg, world)[1]
    except UsageError:  # a layout that cannot work: validation says why
        runs = named
    for cls in dict.fromkeys((runs, named)):
        why = cls.check_limit(cfg)
        if why:
            return why
    return None
