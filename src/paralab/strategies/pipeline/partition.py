"""Split a model's flat unit list into contiguous pipeline stages, and describe the cut.

Every paralab model is ``nn.Sequential(unit_0, unit_1, ...)``. A partition of
``W`` stages is ``W`` contiguous index ranges ``[(0, a), (a, b), ..., (z, n)]``,
each with at least one unit. The two computed cuts also give every stage a unit
with parameters, wherever the model has that many: a stage of pooling alone
would have nothing to train, no optimizer and no gradients to synchronise.
Methods (``--partition``):

- ``balanced`` (default): each unit's forward+backward time is measured on a
  sample batch, and the cut minimises the slowest stage's time (the pipeline
  runs at the pace of its slowest stage);
- ``params``: the same cut on parameter counts (balances memory, not time);
- explicit unit counts per stage, e.g. ``2,3,8``.

:func:`analyze_partition` says what the cut costs: each stage's parameters and
share of the time, and the activation (forward) and gradient (backward)
tensors crossing each boundary, with their shapes and bytes (CS1390 Task 2.1):
the receiver of a point-to-point message must know its size in advance.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ...errors import UsageError

#: per-sample input shape of every dataset paralab reads (CIFAR-shaped)
SAMPLE_SHAPE = (3, 32, 32)
METHODS = ("balanced", "params")


def parse_spec(spec: str | list[int], workers: int, units: int) -> str | list[int]:
    """Check a ``--partition`` value; return the method name or the list of counts."""
    if workers > units:
        raise UsageError(f"cannot split a model of {units} units over {workers} stages; "
                         f"use at most {units} workers")
    if isinstance(spec, (list, tuple)):
        spec = ",".join(str(c) for c in spec)
    spec = str(spec).strip()
    if spec in METHODS:
        return spec
    try:
        counts = [int(c) for c in spec.split(",")]
    except ValueError:
        raise UsageError(f"--partition must be {' | '.join(METHODS)} or unit counts such as 2,3,8 "
                         f"(got {spec!r})") from None
    if len(counts) != workers:
        raise UsageError(f"--partition {spec} gives {len(counts)} stage(s) but there are {workers} workers")
    if any(c < 1 for c in counts):
        raise UsageError(f"--partition {spec}: every stage needs at least one unit")
    if sum(counts) != units:
        raise UsageError(f"--partition {spec} adds up to {sum(counts)} units; the model has {units}")
    return counts


def ranges_from_counts(counts: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def split_costs(costs: list[float], parts: int, trains: list[bool] | None = None) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``parts`` non-empty ranges minimising the largest sum.

    ``trains`` (one flag per unit: it holds parameters): every range then holds at
    least one unit that trains, unless fewer than ``parts`` units do (then the
    flags are ignored). Dynamic programming over (parts, prefix); ties go to the
    split with the smaller sum of squared stage costs (the more even one).
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise UsageError(f"cannot split {n} units into {parts} stages")
    prefix, trained = [0.0], [0]
    for i, c in enumerate(costs):
        prefix.append(prefix[-1] + float(c))
        trained.append(trained[-1] + (1 if trains is None or trains[i] else 0))
    if trained[-1] < parts:  # fewer units train than there are stages: cut on costs alone
        trained = list(range(n + 1))
    inf = (float("inf"), float("inf"))
    # best[p][i]: (max stage cost, sum of squares) splitting the first i units into p stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                if best[p - 1][j] == inf or trained[i] == trained[j]:
                    continue
                s = prefix[i] - prefix[j]
                cand = (max(best[p - 1][j][0], s), best[p - 1][j][1] + s * s)
                if cand < best[p][i]:
                    best[p][i], cut[p][i] = cand, j
    bounds, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def unit_parameters(model: nn.Sequential) -> list[int]:
    return [sum(p.numel() for p in unit.parameters()) for unit in model]


def trains(model: nn.Sequential) -> list[bool]:
    """Which units hold parameters (what a computed cut gives every stage one of)."""
    return [n > 0 for n in unit_parameters(model)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_unit_times(model: nn.Sequential, sample_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward+backward of each unit on ``sample_input`` (median of ``repeats``).

    Runs on a copy in training mode, so the model's own BatchNorm statistics
    are untouched.
    """
    work = copy.deepcopy(model).train()
    device = sample_input.device
    times = []
    h = sample_input.detach()
    for i, unit in enumerate(work):
        inp = h.detach().requires_grad_(i > 0)
        params = [p for p in unit.parameters() if p.requires_grad]
        wrt = ([inp] if inp.requires_grad else []) + params
        samples, out = [], None
        for r in range(repeats + 1):  # the first run is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            out = unit(inp)
            if wrt:
                torch.autograd.grad(out, wrt, grad_outputs=torch.ones_like(out))
            _sync(device)
            if r:
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
        h = out.detach()
    return times


def sample_batch(batch: int, device: torch.device | str = "cpu", seed: int = 0, model: nn.Sequential | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """A random input batch: images, or what ``model``'s first unit reads if it says (its
    ``example_input``: the gpt's token ids, which stay integers whatever ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    first = model[0] if model is not None and len(model) else None
    if hasattr(first, "example_input"):
        return first.example_input(batch, g).to(device)
    x = torch.randn((batch,) + SAMPLE_SHAPE, generator=g)
    return x.to(device, dtype) if dtype is not None else x.to(device)


def partition_model(model: nn.Sequential, workers: int, method: str = "balanced",
                    sample_input: torch.Tensor | None = None, unit_times: list[float] | None = None
                    ) -> list[tuple[int, int]]:
    """Unit index ranges ``[(start, stop), ...]``, one per stage.

    ``method`` is ``balanced``, ``params`` or counts such as ``"2,3,8"``.
    ``balanced`` measures unit times on ``sample_input`` unless ``unit_times``
    is given. Timing differs between processes: in a distributed run one rank
    decides and the others take its answer.
    """
    spec = parse_spec(method, workers, len(model))
    if isinstance(spec, list):
        return ranges_from_counts(spec)
    if spec == "params":
        return split_costs([float(p) for p in unit_parameters(model)], workers, trains(model))
    if unit_times is None:
        if sample_input is None:
            sample_input = sample_batch(32)
        unit_times = measure_unit_times(model, sample_input)
    return split_costs(unit_times, workers, trains(model))


def unit_label(unit: nn.Module) -> str:
    """A short human name for a unit: ``conv 3->64``, ``maxpool``, ``block 64->128/2``, ``linear 512->10``."""
    name = type(unit).__name__
    if isinstance(unit, nn.MaxPool2d):
        return "maxpool"
    if name == "BasicBlock":
        conv = unit.conv1
        return f"block {conv.in_channels}->{unit.conv2.out_channels}" + (
            f"/{conv.stride[0]}" if conv.stride[0] != 1 else "")
    convs = [m for m in unit.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in unit.modules() if isinstance(m, nn.Linear)]
    if linears and not convs:
        lin = linears[-1]
        return f"linear {lin.in_features}->{lin.out_features}"
    if convs:
        return f"conv {convs[0].in_channels}->{convs[-1].out_channels}"
    return name.lower()


def boundary_shapes(model: nn.Sequential, sample_shape: tuple[int, ...] = SAMPLE_SHAPE) -> list[tuple[int, ...]]:
    """Per-sample shape of the tensor entering each unit, plus the model's output (n + 1 shapes)."""
    was_training = model.training
    model.eval()  # evaluation mode: no BatchNorm statistics change
    try:
        param = next(model.parameters(), None)
        if hasattr(model[0], "example_input"):  # a model with its own kind of input (the gpt's tokens)
            h = model[0].example_input(1, torch.Generator().manual_seed(0))
        else:
            h = torch.zeros((1,) + tuple(sample_shape), device=param.device if param is not None else "cpu",
                            dtype=param.dtype if param is not None else torch.float32)
        shapes = [tuple(h.shape[1:])]
        with torch.no_grad():
            for unit in model:
                h = unit(h)
                shapes.append(tuple(h.shape[1:]))
    finally:
        model.train(was_training)
    return shapes


@dataclass
class StageInfo:
    stage: int
    units: tuple[int, int]
    labels: list[str]
    parameters: int
    seconds: float | None
    time_share: float | None


@dataclass
class BoundaryInfo:
    after_stage: int           # between stage k and k + 1
    after_unit: int            # the last unit of stage k
    activation_shape: tuple    # forward: stage k -> k + 1
    activation_bytes: int
    gradient_shape: tuple      # backward: stage k + 1 -> k (same shape as the activation)
    gradient_bytes: int


@dataclass
class PartitionInfo:
    ranges: list[tuple[int, int]]
    batch: int
    stages: list[StageInfo]
    boundaries: list[BoundaryInfo]

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def bytes_per_step(self) -> int:
        """Activations forward plus gradients back over every boundary, for one batch."""
        return sum(b.activation_bytes + b.gradient_bytes for b in self.boundaries)


def analyze_partition(model: nn.Sequential, ranges: list[tuple[int, int]], batch: int,
                      unit_times: list[float] | None = None, sample_shape: tuple[int, ...] = SAMPLE_SHAPE,
                      element_size: int = 4) -> PartitionInfo:
    """Per stage: units, parameters, time share; per boundary: what crosses it for a batch of ``batch``.

    Boundary tensors travel in fp32 (``element_size`` 4): the gradient sent back
    has the activation's shape.
    """
    shapes = boundary_shapes(model, sample_shape)
    params = unit_parameters(model)
    total_time = sum(unit_times) if unit_times else None
    stages = []
    for k, (a, b) in enumerate(ranges):
        secs = sum(unit_times[a:b]) if unit_times else None
        stages.append(StageInfo(k, (a, b), [unit_label(model[i]) for i in range(a, b)], sum(params[a:b]),
                                secs, secs / total_time if total_time else None))
    boundaries = []
    for k, (_, b) in enumerate(ranges[:-1]):
        shape = (batch,) + shapes[b]
        size = element_size
        for d in shape:
            size *= d
        boundaries.append(BoundaryInfo(k, b - 1, shape, size, shape, size))
    return PartitionInfo(list(ranges), batch, stages, boundaries)
