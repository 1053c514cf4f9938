"""Models as flat ``nn.Sequential`` stacks of *units*.

Every model here is ``nn.Sequential(unit_0, unit_1, ...)``: a unit is the
smallest piece a partitioning strategy may place on a stage (a conv block, a
pooling layer, a residual block, the classifier). Keeping the top level flat
is what lets model, pipeline and FSDP strategies split or wrap any model the
same way: by index into the unit list.
"""
from __future__ import annotations

import torch.nn as nn

from .resnet import resnet18
from .vgg import VGG_CONFIGS, vgg

MODELS = {
    "vgg11": lambda **kw: vgg("vgg11", **kw),
    "vgg13": lambda **kw: vgg("vgg13", **kw),
    "vgg16": lambda **kw: vgg("vgg16", **kw),
    "vgg19": lambda **kw: vgg("vgg19", **kw),
    "resnet18": resnet18,
}


def build_model(name: str, *, width: float = 1.0, norm: str = "batch",
                num_classes: int = 10) -> nn.Sequential:
    """Build model ``name``; ``width`` scales every channel count."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](width=width, norm=norm, num_classes=num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "VGG_CONFIGS", "build_model", "count_parameters"]
