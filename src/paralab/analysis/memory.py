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

Options: ``fp32_grads`` (mixed only) adds the fp32 gradient copy DeepSpeed's
estimators count, sharded with the optimizer state (``4 x Psi / N``; at
stage 3 it replaces the fp16 gradient shard: ``+2 x Psi / N``);
``offload="optimizer"`` puts the optimizer state (and that copy) on the host:
``device`` and ``host`` bytes; ``model_parallel`` M divides Psi first.
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
    fp32_grads: Formula | None = None  # DeepSpeed's fp32 gradient copy, if asked for
    offload: str | None = None         # "optimizer": the optimizer state (and fp32 gradients) on the host
    model_parallel: int = 1            # M: Psi is the model's parameters / M

    @property
    def host(self) -> float:
        """Bytes per worker on the host (offload), else 0."""
        if self.offload != "optimizer":
            return 0.0
        return self.optimizer_state.value + (self.fp32_grads.value if self.fp32_grads is not None else 0.0)

    @property
    def device(self) -> float:
        """Model states per worker on the device: the total less what is offloaded."""
        return self.total - self.host

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
        if self.fp32_grads is not None:
            out["fp32_grads"] = self.fp32_grads.value
        out["device"], out["host"] = self.device, self.host
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
        parts += [("fp32_grads", self.fp32_grads)] if self.fp32_grads is not None else []
        return {"strategy": self.name, "stage": self.stage, "parameters": self.parameters,
                "model_parallel": self.model_parallel, "offload": self.offload,
                "workers": self.workers, "optimizer": self.optimizer, "precision": self.precision,
                "bytes_per_parameter": {"p": self.per_parameter.params, "g": self.per_parameter.grads,
                                        "K": self.per_parameter.optimizer},
                "bytes": self.components(),
                "formulas": {k: {"formula": f.formula, "substituted": f.substituted, "value": f.value}
                             for k, f in parts}}

    def text(self) -> str:
        parts = [self.params, self.grads, self.optimizer_state]
        parts += [self.fp32_grads] if self.fp32_grads is not None else []
        parts.append(self.total_formula)
        if self.working is not None:
            parts.append(self.working)
        head = (f"{self.name}: {g(self.parameters)} parameters, {self.workers} workers, {self.optimizer}, "
                f"{self.precision} (p={self.per_parameter.params}, g={self.per_parameter.grads}, "
                f"K={self.per_parameter.optimizer}: {self.per_parameter.explain})")
        lines = [head] + [line for f in parts for line in f.lines()]
        if self.offload == "optimizer":
            lines.append(f"offload optimizer: device {fmt_bytes(self.device)} (parameters and gradients), host "
                         f"{fmt_bytes(self.host)} (the optimizer state" + (" and fp32 gradients" if self.fp32_grads
                                                                           else "") + ") per worker")
        return "\n".join(lines)


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
                      step_in_backward: bool = False, fp32_grads: bool = False, offload: str | None = None,
                      model_parallel: int = 1) -> MemoryEstimate:
    """Model-state bytes per worker for DDP (``stage=0``) or ZeRO ``stage`` 1, 2, 3.

    ``parameters``: Psi, the model's parameter count; ``workers``: N, the
    data-parallel workers; ``optimizer``: "sgd", "sgd-momentum" or "adam";
    ``precision``: "fp32" or "mixed". ``unit_parameters`` (optional): the
    largest unit's parameter count; at stages 1-3 it adds the *working* line
    (see the module's docstring). ``step_in_backward`` (stages 2-3, needs
    ``unit_parameters``): gradients are one unit's shard at a time.
    ``fp32_grads``, ``offload``, ``model_parallel``: see the module's docstring
    (``parameters`` is the whole model's: Psi here is it over M).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (got {stage!r})")
    if parameters < 0 or workers < 1:
        raise ValueError("parameters must be >= 0 and workers >= 1")
    if fp32_grads and precision != "mixed":
        raise ValueError("fp32_grads is the fp32 copy of 16-bit gradients: precision must be mixed")
    if offload not in (None, "optimizer"):
        raise ValueError(f"offload must be None or 'optimizer' (got {offload!r})")
    if model_parallel < 1:
        raise ValueError("model_parallel must be >= 1")
    b = bytes_per_parameter(optimizer, precision)
    psi, n = parameters / model_parallel, workers
    psi = int(psi) if float(psi).is_integer() else psi
    if unit_parameters is not None and model_parallel > 1:
        unit_parameters = unit_parameters / model_parallel
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
    copy = None
    if fp32_grads:  # DeepSpeed's estimators: an fp32 gradient shard beside the optimizer state
        copy = _component("fp32 gradient copy", 4, "4", psi, n, sharded=stage >= 1)
        copy.note = "kept beside the optimizer state (DeepSpeed's estimators count it)"
        formulas = {k: f"{f} + 4 x Psi" + (" / N" if k >= 1 else "") for k, f in formulas.items()}
        subs = {k: f"{t} + {copy.substituted}" for k, t in subs.items()}
        if stage == 3:  # the fp16 gradient shard is reduce-scattered straight into the fp32 one
            grads = Formula("gradients", "0 (reduced into the fp32 copy)", "0", 0.0, "B", parts={"sharded": True},
                            note="at ZeRO-3 each 16-bit gradient shard is turned into the fp32 copy, not kept")
            formulas[3] = "(p + K + 4) x Psi / N"
            subs[3] = f"({b.params} + {b.optimizer} + 4) x {g(psi)} / {n}"
    value = params.value + grads.value + state.value + (copy.value if copy is not None else 0.0)
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
    return MemoryEstimate(stage, psi, n, optimizer, precision, b, params, grads, state, total, working,
                          fp32_grads=copy, offload=offload, model_parallel=model_parallel)


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
