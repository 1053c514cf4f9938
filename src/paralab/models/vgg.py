"""VGG for 32x32 inputs, as in CS744 Assignment 2.

Each entry of the configuration is either a channel count (3x3 conv with
bias, then BatchNorm, then ReLU) or ``M`` (2x2 max-pool). After five pools a
32x32 image is 1x1, so the classifier is one Linear(512, classes).
VGG-11 with BatchNorm has 9,231,114 parameters.
"""
from __future__ import annotations

import torch.nn as nn

VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
              512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
              512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


def scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


def conv_unit(c_in: int, c_out: int, norm: str) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=True)]
    if norm == "batch":
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


def vgg(name: str, *, width: float = 1.0, norm: str = "batch",
        num_classes: int = 10) -> nn.Sequential:
    units: list[nn.Module] = []
    c_in = 3
    for entry in VGG_CONFIGS[name]:
        if entry == "M":
            units.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            c_out = scaled(entry, width)
            units.append(conv_unit(c_in, c_out, norm))
            c_in = c_out
    units.append(nn.Sequential(nn.Flatten(), nn.Linear(c_in, num_classes)))
    return nn.Sequential(*units)
