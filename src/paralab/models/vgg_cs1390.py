"""CS1390's VGG-16: torchvision's VGG-16 with its classifier, cut into 13 units.

CS1390 (Assignment 1) trains torchvision's plain VGG-16 (13 3x3 convolutions
with bias and ReLU, no BatchNorm) on 32x32 CIFAR-10 images, with a
three-layer classifier, and its ``split_vgg16`` groups the model into 13
units, which is exactly the flat ``nn.Sequential`` built here:

=====  ==========================================  ==========================
unit   layers                                      output per sample
=====  ==========================================  ==========================
0      conv 3->64, conv 64->64                     64 x 32 x 32
1      maxpool, conv 64->128, conv 128->128        128 x 16 x 16
2      maxpool, 3 x conv ->256                     256 x 8 x 8
3      maxpool, 3 x conv ->512                     512 x 4 x 4
4      maxpool, 3 x conv 512->512, maxpool         512 x 1 x 1
5      flatten (``-pool``: 7x7 average pool, then  512 (``-pool``: 25088)
       flatten)
6      Linear(512 or 25088, 4096)                  4096
7, 10  ReLU (not in-place)                         4096
8, 11  Dropout(p=0.0): inactive                    4096
9      Linear(4096, 4096)                          4096
12     Linear(4096, classes)                       classes
=====  ==========================================  ==========================

``vgg16-cs1390`` has no average pool (33,638,218 parameters);
``vgg16-cs1390-pool`` keeps torchvision's ``AdaptiveAvgPool2d((7, 7))``
(134,301,514), both at ``width=1.0, norm="none"``. ``width`` scales every
channel count and the classifier's hidden 4096; ``norm="batch"`` puts a
BatchNorm after every convolution, as torchvision's ``vgg16_bn``.

Why, and where it differs from torchvision's: docs/courses.md#cs1390-assignment-1
"""
from __future__ import annotations

import torch.nn as nn

from ..errors import UsageError
from .vgg import scaled

#: channels of the five convolution blocks of VGG-16
BLOCKS = [[64, 64], [128, 128], [256, 256, 256], [512, 512, 512], [512, 512, 512]]
HIDDEN = 4096
NORMS = ("none", "batch")


class PoolFlatten(nn.Sequential):
    """torchvision's ``avgpool`` (7x7 adaptive average) followed by the flatten of its forward."""

    def __init__(self) -> None:
        super().__init__(nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten())


def vgg16_cs1390(*, pool: bool = False, width: float = 1.0, norm: str = "none",
                 num_classes: int = 10) -> nn.Sequential:
    """CS1390's VGG-16 as 13 units (see the module docstring); ``pool``: keep the 7x7 average pool."""
    if norm not in NORMS:
        raise UsageError(f"vgg16-cs1390: --norm must be none (CS1390's plain VGG-16) or batch "
                         f"(a BatchNorm after every convolution, as torchvision's vgg16_bn); got {norm!r}")
    if not width > 0:
        raise UsageError(f"vgg16-cs1390: --width must be positive (got {width})")
    units: list[nn.Module] = []
    c_in = 3
    for b, block in enumerate(BLOCKS):
        layers: list[nn.Module] = [] if b == 0 else [nn.MaxPool2d(kernel_size=2, stride=2)]
        for channels in block:
            c_out = scaled(channels, width)
            layers.append(nn.Conv2d(c_in, c_out, kernel_size=3, padding=1))
            if norm == "batch":
                layers.append(nn.BatchNorm2d(c_out))
            layers.append(nn.ReLU(inplace=True))  # after a conv of the same unit: never a stage's input
            c_in = c_out
        if b == len(BLOCKS) - 1:
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))  # 2x2 -> 1x1
        units.append(nn.Sequential(*layers))
    hidden = scaled(HIDDEN, width)
    units.append(PoolFlatten() if pool else nn.Flatten())
    units += [
        nn.Linear(c_in * (49 if pool else 1), hidden), nn.ReLU(), nn.Dropout(p=0.0),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p=0.0),
        nn.Linear(hidden, num_classes),
    ]
    return nn.Sequential(*units)
