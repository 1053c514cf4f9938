"""Memory per worker for model states: DDP and ZeRO stages 1, 2 and 3.

The model of Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models* (SC'20, sec. 3.1 and 5.1). For a model of Psi
parameters on N data-parallel workers, each worker holds ``p`` bytes per
parameter of parameters, ``g`` of gradients and ``K`` of optimizer state
(fp32: p = g = 4, K = 0/4/8 for sgd / sgd-momentum / adam; ``mixed``: p =
g = 2, K = 4 more for the fp32 master weights). Per worker:

- DDP (no partitioning):       ``(p + g + K) x Psi``
- ZeRO-1 (P_os, optimizer):    ``(p + g) x Psi + K x Psi / N``
- ZeRO-2 (P_os+g, + grads):    ``p x Psi + (g + K) x Psi / N``
- ZeRO-3 (P_os+g+p, + params): ``(p + g + K) x Psi / N``

``unit_parameters`` (the largest unit's parameter count, Psi_unit) adds a
separate *working* line, what a unit-by-unit implementation holds while
that unit runs backward: stage 3 ``(p + g) x Psi_unit``, stage 2
``2g x Psi_unit``, stage 1 ``g x Psi_unit``. ``step_in_backward=True``
(stages 2-3) makes the gradient line one unit's shard, ``g x Psi_unit / N``.
Activations, temporary buffers and fragmentation are not modelled.

Use::

    from paralab.analysis.memory import memory_per_worker, zero_table
    est = memory_per_worker(7_500_000_000, 64, stage=3, optimizer="adam", precision="mixed")
    est.total            # 1.875e9 bytes
    print(est.text())    # each component: formula, numbers substituted, result

Why each term, and what the bound leaves out: docs/analysis.md#the-memory-model-paralab-calc-memory
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Formula, fmt_bytes, g

OPTIMIZERS = ("sgd", "sgd-momentum", "adam")
PRECISIONS = ("fp32", "mixed")
STAGES = (0, 1, 2, 3)
#: the name of each stage as used on the command line and in reports
STAGE_NAMES = {0: "ddp", 1: "zero-1", 2: "zero-2", 3: "zero-3"}

#: optimizer state in fp32 elements per parameter (momentum: 1, Adam: 2)
_STATE_ELEMENTS = {"sgd": 0, "sgd-momentum": 1, "adam": 2}


@dataclass(frozen=True)
class BytesPerParameter:
    """p, g, K of the ZeRO paper for one precision and optimizer."""
    params: int      # p
    grads: int       # g
    optimizer: int   # K
    explain: str     # where K comes from, in words


def bytes_per_parameter(optimizer: str, precision: str = "fp32") -> BytesPerParameter:
    """The paper's p, g and K for ``optimizer`` ("sgd", "sgd-momentum", "adam") and ``precision``."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {optimizer!r})")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    states = _STATE_ELEMENTS[optimizer]
    what = {"sgd": "no state", "sgd-momentum": "momentum", "adam": "exp_avg + exp_avg_sq"}[optimizer]
    if precision == "fp32":
        return BytesPerParameter(4, 4, 4 * states, f"fp32 {what}" if states else what)
    master = "fp32 master weights" + (f" + fp32 {what}" if states else "")
    return BytesPerParameter(2, 2, 4 + 4 * states, master)


@dataclass
class MemoryEstimate:
    """Bytes per worker for one strategy: the components, their formulas, the total."""
    stage: int               # 0 = DDP, 1..3 = ZeRO stage
    parameters: int          # Psi
    workers: int             # N
    optimizer: str
    precision: str
    per_parameter: BytesPerParameter
    params: Formula          # each component as a Formula (value in bytes)
    grads: Formula
    optimizer_state: Formula
    total_formula: Formula
    working: Formula | None = None  # stages 1-3: the largest unit's transient tensors, if asked for
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage]

    @property
    def total(self) -> float:
        """Model states per worker in bytes (without the working set)."""
        return self.total_formula.value

    def components(self) -> dict[str, float]:
        """Bytes per component, for JSON records and tables."""
        out = {"params": self.params.value, "grads": self.grads.value,
               "optimizer": self.optimizer_state.value, "total": self.total}
        if self.working is not None:
            out["working"] = self.working.value
        out["peak"] = self.peak
        return out

    @property
    def peak(self) -> float:
        """Model states plus the working set (if any): the resident peak of a unit-by-unit implementation."""
        return self.total + (self.working.value if self.working is not None else 0.0)

    def to_dict(self) -> dict:
        parts = [("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer_state),
                 ("total", self.total_formula)] + ([("working", self.working)] if self.working else [])
        return {"strategy": self.name, "stage": self.stage, "parameters": self.parameters,
                "workers": self.workers, "optimizer": self.optimizer, "precision": self.precision,
                "bytes_per_parameter": {"p": self.per_parameter.params, "g": self.per_parameter.grads,
                                        "K": self.per_parameter.optimizer},
                "bytes": self.components(),
                "formulas": {k: {"formula": f.formula, "substituted": f.substituted, "value": f.value}
                             for k, f in parts}}

    def text(self) -> str:
        parts = [self.params, self.grads, self.optimizer_state, self.total_formula]
        if self.working is not None:
            parts.append(self.working)
        head = (f"{self.name}: {g(self.parameters)} parameters, {self.workers} workers, {self.optimizer}, "
                f"{self.precision} (p={self.per_parameter.params}, g={self.per_parameter.grads}, "
                f"K={self.per_parameter.optimizer}: {self.per_parameter.explain})")
        return "\n".join([head] + [line for f in parts for line in f.lines()])


def _component(title: str, coeff: int, symbol: str, parameters: int, workers: int, sharded: bool) -> Formula:
    psi, n = parameters, workers
    if sharded:
        value = coeff * psi / n
        return Formula(title, f"{symbol} x Psi / N", f"{coeff} x {g(psi)} / {n}", value, "B",
                       parts={"sharded": True})
    value = float(coeff * psi)
    return Formula(title, f"{symbol} x Psi", f"{coeff} x {g(psi)}", value, "B", parts={"sharded": False})


def memory_per_worker(parameters: int, workers: int, stage: int = 0, optimizer: str = "sgd-momentum",
                      precision: str = "fp32", unit_parameters: int | None = None,
                      step_in_backward: bool = False) -> MemoryEstimate:
    """Model-state bytes per worker for DDP (``stage=0``) or ZeRO ``stage`` 1, 2, 3.

    ``parameters``: Psi, the model's parameter count; ``workers``: N, the
    data-parallel workers; ``optimizer``: "sgd", "sgd-momentum" or "adam";
    ``precision``: "fp32" or "mixed". ``unit_parameters`` (optional): the
    largest unit's parameter count; at stages 1-3 it adds the *working* line
    (see the module's docstring). ``step_in_backward`` (stages 2-3, needs
    ``unit_parameters``): gradients are one unit's shard at a time.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (got {stage!r})")
    if parameters < 0 or workers < 1:
        raise ValueError("parameters must be >= 0 and workers >= 1")
    b = bytes_per_parameter(optimizer, precision)
    psi, n = parameters, workers
    params = _component("parameters", b.params, "p", psi, n, sharded=stage >= 3)
    grads = _component("gradients", b.grads, "g", psi, n, sharded=stage >= 2)
    state = _component("optimizer state", b.optimizer, "K", psi, n, sharded=stage >= 1)
    formulas = {0: "(p + g + K) x Psi", 1: "(p + g) x Psi + K x Psi / N",
                2: "p x Psi + (g + K) x Psi / N", 3: "(p + g + K) x Psi / N"}
    subs = {0: f"({b.params} + {b.grads} + {b.optimizer}) x {g(psi)}",
            1: f"({b.params} + {b.grads}) x {g(psi)} + {b.optimizer} x {g(psi)} / {n}",
            2: f"{b.params} x {g(psi)} + ({b.grads} + {b.optimizer}) x {g(psi)} / {n}",
            3: f"({b.params} + {b.grads} + {b.optimizer}) x {g(psi)} / {n}"}
    if step_in_backward:
        if stage < 2 or unit_parameters is None:
            raise ValueError("step_in_backward models stages 2-3 and needs unit_parameters")
        grads = Formula("gradients", "g x Psi_unit / N", f"{b.grads} x {g(unit_parameters)} / {n}",
                        b.grads * unit_parameters / n, "B", parts={"sharded": True, "step_in_backward": True},
                        note="each unit's shard is stepped in backward and dropped")
        formulas = {2: "p x Psi + g x Psi_unit / N + K x Psi / N", 3: "(p + K) x Psi / N + g x Psi_unit / N"}
        subs = {stage: " + ".join(f.substituted for f in (params, grads, state))}
    value = params.value + grads.value + state.value
    total = Formula(f"{STAGE_NAMES[stage]}: model states per worker", formulas[stage],
                    f"{subs[stage]} = {fmt_bytes(value)}", value, "B",
                    note="1 GB = 10^9 B; activations and temporary buffers not included")
    working = None
    if unit_parameters is not None and stage >= 3:
        working = Formula("working set: one unit gathered, and its full gradient", "(p + g) x Psi_unit",
                          f"({b.params} + {b.grads}) x {g(unit_parameters)}",
                          float((b.params + b.grads) * unit_parameters), "B", note="transient, beside the model states")
    elif unit_parameters is not None and stage == 2:
        working = Formula("working set: one unit's full gradient and its flat copy", "2g x Psi_unit",
                          f"2 x {b.grads} x {g(unit_parameters)}", float(2 * b.grads * unit_parameters), "B",
                          note="transient, beside the model states")
    elif unit_parameters is not None and stage == 1:
        working = Formula("working set: one unit's gradient copied flat", "g x Psi_unit",
                          f"{b.grads} x {g(unit_parameters)}", float(b.grads * unit_parameters), "B",
                          note="transient, beside the model states")
    return MemoryEstimate(stage, psi, n, optimizer, precision, b, params, grads, state, total, working)


def zero_table(parameters: int, workers: int, optimizer: str = "sgd-momentum",
               precision: str = "fp32") -> list[MemoryEstimate]:
    """DDP and ZeRO 1/2/3 side by side, in that order."""
    return [memory_per_worker(parameters, workers, s, optimizer, precision) for s in STAGES]


def optimizer_kind(optimizer: str, momentum: float = 0.0) -> str:
    """The model's optimizer name for paralab's ``--optimizer`` and ``--momentum``."""
    if optimizer == "adam":
        return "adam"
    return "sgd-momentum" if momentum else "sgd"


def beside_prediction(allocator: dict, predicted: dict) -> dict:
    """A rank's measured allocator peak (``kinds.ALLOCATOR``: ``max_memory_allocated``) beside the
    model's predicted peak (``MemoryEstimate.to_dict()``): bytes, and measured / predicted. The
    allocator also holds activations, buffers and fragmentation-free rounding that the model
    leaves out, so a ratio above 1 is expected; below 1 means the model counts something the
    strategy does not hold."""
    measured = allocator["peak_bytes"]
    model = predicted["bytes"].get("peak", predicted["bytes"]["total"])
    return {"peak_bytes": measured, "predicted_peak_bytes": model,
            "measured_over_predicted": measured / model if model else None}
