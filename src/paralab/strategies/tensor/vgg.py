"""Channel-split tensor parallelism for the VGG models (CS744's and CS1390's).

A convolution is a linear map over its input channels, so Megatron's pair
carries over channel by channel. The convolutions, in order, are taken two
at a time:

- the first of a pair is *column-parallel*: rank ``r`` computes output
  channels ``[r C / tp, (r + 1) C / tp)`` from the whole input (``f`` in
  front: identity forward, its input gradient all-reduced backward). The
  BatchNorm and ReLU after it, and a max-pool, work channel by channel, so
  they stay local, each on its own channels (a BatchNorm's statistics over a
  channel need only that channel);
- the second is *row-parallel*: rank ``r`` holds the weights of its input
  channels and computes a partial sum of every output channel; ``g``
  all-reduces the partial sums, then the bias is added once.

Between the two, each rank carries only ``C / tp`` channels; after the pair
every rank has the whole activation again. A last unpaired convolution (VGG-16
has 13) and the classifier stay replicated: every rank computes them whole,
with identical gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .group import TPGroup
from .ops import copy_to_tp, reduce_from_tp


def _conv(plain: nn.Conv2d, in_channels: int, out_channels: int) -> dict:
    return dict(in_channels=in_channels, out_channels=out_channels, kernel_size=plain.kernel_size,
                stride=plain.stride, padding=plain.padding, bias=plain.bias is not None, dtype=plain.weight.dtype)


class ColumnConv(nn.Conv2d):
    """This rank's output channels of a convolution, from the whole input."""
    split = {"weight": 0, "bias": 0}

    def __init__(self, tp: TPGroup, plain: nn.Conv2d):
        super().__init__(**_conv(plain, plain.in_channels, plain.out_channels // tp.size))
        self.tp = tp
        with torch.no_grad():
            self.weight.copy_(tp.shard(plain.weight, 0))
            if plain.bias is not None:
                self.bias.copy_(tp.shard(plain.bias, 0))

    def forward(self, x):
        return super().forward(copy_to_tp(x, self.tp.comm))


class RowConv(nn.Conv2d):
    """A convolution over this rank's input channels: partial sums, all-reduced, then the bias."""
    split = {"weight": 1}

    def __init__(self, tp: TPGroup, plain: nn.Conv2d):
        super().__init__(**_conv(plain, plain.in_channels // tp.size, plain.out_channels))
        self.tp = tp
        with torch.no_grad():
            self.weight.copy_(tp.shard(plain.weight, 1))
            if plain.bias is not None:
                self.bias.copy_(plain.bias)

    def forward(self, x):
        partial = F.conv2d(x, self.weight, None, self.stride, self.padding)
        out = reduce_from_tp(partial, self.tp.comm)
        return out if self.bias is None else out + self.bias.view(1, -1, 1, 1)


class LocalBatchNorm(nn.BatchNorm2d):
    """A BatchNorm over this rank's channels only (its slice of every parameter and statistic)."""
    split = {"weight": 0, "bias": 0, "running_mean": 0, "running_var": 0}

    def __init__(self, tp: TPGroup, plain: nn.BatchNorm2d):
        super().__init__(plain.num_features // tp.size, plain.eps, plain.momentum, dtype=plain.weight.dtype)
        state = plain.state_dict()
        self.load_state_dict({k: (tp.shard(v, 0) if k in self.split else v) for k, v in state.items()})


def conv_roles(model: nn.Sequential) -> list[tuple[int, str, str]]:
    """``(unit index, module path inside the unit, "column" | "row")`` for each paired convolution, in order."""
    convs = [(i, path) for i, unit in enumerate(model) for path, m in unit.named_modules()
             if isinstance(m, nn.Conv2d)]
    pairs = len(convs) // 2 * 2
    return [(i, path, "column" if n % 2 == 0 else "row") for n, (i, path) in enumerate(convs[:pairs])]


def _set(unit: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(unit.get_submodule(parent) if parent else unit, name, module)


def shard_unit(tp: TPGroup, index: int, unit: nn.Module, roles) -> nn.Module:
    """Shard the paired convolutions of unit ``index`` in place (and the BatchNorm after a column one)."""
    for i, path, role in roles:
        if i != index:
            continue
        conv = unit.get_submodule(path)
        split = conv.out_channels if role == "column" else conv.in_channels
        if split % tp.size:
            raise ValueError(f"unit {index}: the {split} channels this {role}-parallel convolution splits do not "
                             f"divide over tp {tp.size}; pick a --width whose channel counts do")
        _set(unit, path, (ColumnConv if role == "column" else RowConv)(tp, conv))
        if role == "column":  # the BatchNorm that follows it (same Sequential) keeps its channels only
            parent, _, name = path.rpartition(".")
            container = unit.get_submodule(parent) if parent else unit
            names = list(dict(container.named_children()))
            after = names[names.index(name) + 1] if names.index(name) + 1 < len(names) else None
            if after is not None and isinstance(getattr(container, after), nn.BatchNorm2d):
                setattr(container, after, LocalBatchNorm(tp, getattr(container, after)))
    return unit


def activation_shape(tp: TPGroup, index: int, roles, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample shape entering unit ``index`` once sharded: ``C / tp`` channels between a column
    convolution's unit and its row partner's."""
    for (i_col, _, _), (i_row, _, _) in zip(roles[0::2], roles[1::2]):
        if i_col < index <= i_row:
            return (shape[0] // tp.size,) + tuple(shape[1:])
    return shape
