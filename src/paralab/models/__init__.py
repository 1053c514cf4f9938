"""Models as flat ``nn.Sequential`` stacks of *units*.

Every model here is ``nn.Sequential(unit_0, unit_1, ...)``: a unit is the
smallest piece a partitioning strategy may place on a stage (a conv block, a
pooling layer, a residual block, the classifier). Keeping the top level flat
is what lets model, pipeline and FSDP strategies split or wrap any model the
same way: by index into the unit list.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..options import option
from .gpt import GPTOptions, gpt
from .moe import MoEOptions
from .resnet import resnet18
from .vgg import VGG_CONFIGS, vgg
from .vgg_cs1390 import vgg16_cs1390

MODELS = {
    "vgg11": lambda **kw: vgg("vgg11", **kw),
    "vgg13": lambda **kw: vgg("vgg13", **kw),
    "vgg16": lambda **kw: vgg("vgg16", **kw),
    "vgg19": lambda **kw: vgg("vgg19", **kw),
    "resnet18": resnet18,
    # CS1390's torchvision VGG-16 with its classifier, as split_vgg16's 13 units (use --norm none)
    "vgg16-cs1390": lambda **kw: vgg16_cs1390(pool=False, **kw),
    "vgg16-cs1390-pool": lambda **kw: vgg16_cs1390(pool=True, **kw),
    # a small decoder-only transformer over byte tokens (shape: GPTOptions)
    # (with --experts E, every block's MLP a mixture of experts: MoEOptions)
    "gpt": lambda *, layers, heads, embed, context, dropout=0.0, experts=0, top_k=1, expert_hidden=0,
    capacity_factor=None, aux_loss_coef=0.01, router_skew=0.0, gating="softmax", **_: gpt(
        layers, heads, embed, context, experts=experts, top_k=top_k, expert_hidden=expert_hidden,
        capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef, router_skew=router_skew, gating=gating,
        dropout=dropout),
}

#: what a model reads and predicts: "image" (classes of a 3x32x32 image) or "text" (the next byte token)
MODALITY = {name: "text" if name == "gpt" else "image" for name in MODELS}


#: the normalisation a model has when ``build_model`` is not told (``norm=None``): CS744's
#: models have BatchNorm, CS1390's VGG-16 has none
#: (the transformer has LayerNorm, never BatchNorm)
DEFAULT_NORM = {name: "none" if name.startswith("vgg16-cs1390") or MODALITY[name] == "text" else "batch"
                for name in MODELS}
NORMS = ("batch", "none")


@dataclass
class ModelOptions:
    """model"""
    model: str = option("vgg11", "the model (gpt's shape: --layers --heads --embed --context)", choices=MODELS,
                        noun="model")
    width: float = option(1.0, "channel multiplier, e.g. 0.25 for fast runs", positive=True)
    norm: str | None = option(None, "normalisation: BatchNorm, or none (a BatchNorm-free model); default: the model's "
                                    "own (batch; none for the CS1390 VGG-16s, as CS1390 trains them)",
                              type=str, choices=NORMS)


def build_model(name: str, *, width: float = 1.0, norm: str | None = None,
                num_classes: int = 10, **shape) -> nn.Sequential:
    """Build model ``name``; ``width`` scales every channel count; ``norm`` is ``batch`` or
    ``none`` (None: the model's own, ``DEFAULT_NORM``). A transformer's shape comes in ``shape``
    (GPTOptions' fields; their defaults where left out): pass ``**model_shape(cfg)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if norm is None:
        norm = DEFAULT_NORM[name]
    kwargs = dict(width=width, norm=norm, num_classes=num_classes)
    if MODALITY[name] == "text":
        kwargs |= model_shape(GPTOptions()) | model_shape(MoEOptions()) | shape
    return MODELS[name](**kwargs)


def model_shape(cfg) -> dict:
    """The transformer shape options (GPTOptions' and MoEOptions' fields) of a RunConfig or argparse namespace."""
    fields = {**GPTOptions.__dataclass_fields__, **MoEOptions.__dataclass_fields__}
    return {f: getattr(cfg, f, fields[f].default) for f in fields}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def structure_only():
    """A context in which modules are built on the meta device with their in-place initialisers skipped
    (``normal_``, ``uniform_``, ``zero_``, ... compute nothing there, and the first ``normal_`` on the meta
    device costs over a second of imports): a model's names, shapes and units, no weights."""
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name, target = getattr(func, "__name__", ""), args[0] if args else kwargs.get("tensor")
            if name.endswith("_") and not name.endswith("__") and getattr(target, "is_meta", False):
                return target  # normal_, uniform_, zero_, fill_ ... of a meta tensor: nothing to compute
            return func(*args, **kwargs)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(SkipInit())
    return stack


def parameters_of(name: str, **kw) -> int | None:
    """How many parameters ``build_model(name, **kw)`` would have, without allocating them (built
    :func:`structure_only`). None where a tensor's size overflows (``--width 1e9``)."""
    try:
        with structure_only():
            return count_parameters(build_model(name, **kw))
    except (RuntimeError, TypeError, OverflowError) as exc:  # a size past torch's 64-bit counts
        if "overflow" in str(exc).lower():
            return None
        raise


__all__ = ["DEFAULT_NORM", "GPTOptions", "MoEOptions", "MODALITY", "MODELS", "ModelOptions", "NORMS", "model_shape", "VGG_CONFIGS",
           "build_model", "count_parameters", "parameters_of"]
