"""ResNet-18, CIFAR variant (3x3 stem, no stem pooling): 11,173,962 parameters.

Units: the stem, each of the eight basic blocks, and the head (global
average pool + Linear), so the model is a flat stack of ten units.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .vgg import scaled


def norm_layer(channels: int, norm: str) -> nn.Module:
    return nn.BatchNorm2d(channels) if norm == "batch" else nn.Identity()


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        bias = norm != "batch"  # a conv followed by BatchNorm needs no bias
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)
        self.bn1 = norm_layer(c_out, norm)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=bias)
        self.bn2 = norm_layer(c_out, norm)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=bias), norm_layer(c_out, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(*, width: float = 1.0, norm: str = "batch", num_classes: int = 10) -> nn.Sequential:
    c = [scaled(n, width) for n in (64, 128, 256, 512)]
    stem = nn.Sequential(nn.Conv2d(3, c[0], 3, padding=1, bias=norm != "batch"),
                         norm_layer(c[0], norm), nn.ReLU(inplace=True))
    units: list[nn.Module] = [stem]
    c_in = c[0]
    for stage, c_out in enumerate(c):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            units.append(BasicBlock(c_in, c_out, stride, norm))
            c_in = c_out
    units.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)))
    return nn.Sequential(*units)
