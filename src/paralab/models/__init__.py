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
}


#: the normalisation a model has when ``build_model`` is not told (``norm=None``): CS744's
#: models have BatchNorm, CS1390's VGG-16 has none
DEFAULT_NORM = {name: "none" if name.startswith("vgg16-cs1390") else "batch" for name in MODELS}


def build_model(name: str, *, width: float = 1.0, norm: str | None = None,
                num_classes: int = 10) -> nn.Sequential:
    """Build model ``name``; ``width`` scales every channel count; ``norm`` is ``batch`` or
    ``none`` (None: the model's own, ``DEFAULT_NORM``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if norm is None:
        norm = DEFAULT_NORM[name]
    return MODELS[name](width=width, norm=norm, num_classes=num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["DEFAULT_NORM", "MODELS", "VGG_CONFIGS", "build_model", "count_parameters"]
