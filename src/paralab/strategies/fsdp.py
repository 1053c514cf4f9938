"""``fsdp``: fully sharded data parallelism from primitives, ZeRO stages 1, 2 and 3.

One mechanism with three settings (``--zero-stage``, default 3). Every unit of
the model (the model is a flat ``nn.Sequential`` of units) that has
parameters becomes a :class:`FlatUnit`: its parameters are concatenated into
one flat tensor, zero-padded to a multiple of the N workers and cut into N
equal shards; rank r owns shard r. The optimizer (built from the run's
factory: SGD with or without momentum, or Adam) is given only the shards,
so its state covers 1/N of the model at every stage. The stages differ in
what else stays sharded:

==========  =========================  ==================================  =====================
stage        parameters                  gradients                           after the step
==========  =========================  ==================================  =====================
1 (P_os)     full on every rank          full until backward ends, then      all-gather the
                                         reduce-scattered to the shard       updated shards
2 (P_os+g)   full on every rank          each unit reduce-scattered as soon  all-gather the
                                         as its backward is done             updated shards
3 (P_os+g+p) only the shard; gathered    as stage 2                          nothing (the next
             per unit, freed after use                                       forward gathers)
==========  =========================  ==================================  =====================

A unit's shard moves through four primitives, the methods of
:class:`FlatUnit` (and :func:`step_shards`), each counting in the memory
ledger the bytes it allocates or frees, where it does so: **gather** (the
full parameters from every rank's shard: into fresh storage at stage 3, in
place at stages 1-2 after a step), **free** (stage 3: the gathered storage
released), **reduce-scatter** (the unit's flat gradient summed over ranks,
this rank's shard of it kept / N) and **step** (the optimizer on the shards
that have a gradient, their gradients dropped).

The step at stage 3 (stages 1-2 have nothing to gather or free):

- forward, unit by unit: wait for the unit's all-gather, launch the next
  unit's all-gather asynchronously (prefetch), bind the unit's parameters as
  views of the gathered flat tensor, run the unit, free the gathered storage
  (the last unit stays gathered: backward starts with it). Each unit's input
  is detached, so every unit is its own small autograd graph.
- backward, unit by unit from the last, with ``torch.autograd.grad``:
  re-gather the unit's parameters into the *same* storage (autograd saved
  views of it; refilling the storage instead of recomputing the forward
  keeps the compute and the BatchNorm statistics exactly those of one
  process), compute the gradients of the unit's input and parameters, free
  the parameters, flatten the parameter gradients into one padded tensor,
  launch the previous unit's gather, and reduce-scatter the flat gradient
  (``comm.reduce_scatter``: the backend's native reduce-scatter, or
  all-reduce then slice where it has none; which one ran is in
  ``extra_summary``), keeping only this rank's gradient shard, divided by N.
- the optimizer step on that unit's shard (step in backward), or on all
  shards after backward; gradients are dropped; BatchNorm buffers
  broadcast after the step.

Step in backward (stages 2-3, on by default; ``--no-step-in-backward``
turns it off): as soon as a unit's gradient shard is reduced, the optimizer
steps that unit's shard and the gradient shard is dropped, so gradient
shards never pile up (the step at the end would hold all of them at once).
The update is the same as one step after backward: ``torch.optim`` skips
parameters without a gradient and keeps its state (Adam's step count too)
per parameter, so stepping one unit's shard at a time computes exactly the
same thing. (Gradient clipping by the global norm would need every gradient
first; paralab has none.) At stage 2 the unit's all-gather of the updated
shards is launched right after its step, so it overlaps the rest of
backward.

At stages 1 and 2 the shard is a view into the full flat tensor, so the
optimizer updates it in place and an in-place all-gather (input = this
rank's slice of the output) completes the other ranks' slices. Those gathers
are launched asynchronously after the step and each is waited for only when
the next forward (or a read of the weights) reaches its unit.

The autograd views of the gathered storage carry their own version counter
(they are taken from ``flat.data``), so refilling the storage for backward
does not look like an in-place change of a saved tensor; this is how
PyTorch's own FSDP frees parameters between forward and backward.

Prefetch (stage 3, ``--prefetch``, on by default; ``--no-prefetch`` gathers
each unit only when it is reached, for measurement): every gather is issued
asynchronously one unit ahead. In forward it is launched before the current
unit computes (two units gathered at most); in backward only after the
current unit's gradients are computed and its parameters freed, so it
overlaps the reduce-scatter and the parameter-free units' backward instead:
launching it before the unit's backward would hold three units' full
tensors at once. Hiding a gather needs a resource the compute does not use
(a spare core, or a GPU's copy engines with NCCL).

BatchNorm: every rank normalises its own shard of the batch (as DDP);
running statistics follow the ``first-replica`` rule: rank 0's buffers are
authoritative and are broadcast after every step (one broadcast per dtype),
so every rank and the single-process reference (verify.py) agree.

Memory: a ledger counts the bytes of every parameter, gradient and optimizer
state tensor this strategy holds, as they are allocated and freed, and keeps
each category's peak and the peak of their sum (``resident_peak_bytes``);
``extra_summary`` reports them beside the cost model's prediction
(analysis/memory.py) for the same stage, workers, optimizer and precision
(autocast keeps all three in fp32), and on CUDA also
``torch.cuda.max_memory_allocated`` (which includes activations). At stage 3
the resident peak is in the backward of a large unit: a gathered unit and a
full gradient (two units' worth: a unit's parameters and its gradient must
coexist, as the convolution's backward reads the weight while it writes the
weight's gradient) sit beside the parameter and optimizer-state shards. At
the step at the end, the gradient shards of every unit after the running one
are held too. What this measures (and what prefetch and stepping in
backward buy) is in ``docs/fsdp.md``, from ``bench/fsdp.py``.

ZeRO-1 as a data-parallel flavour (:class:`ZeroOneReplicas`): the same flat
units and primitives, wrapped round any module with its parameters kept as
ordinary ``nn.Parameter``, so that a pipeline stage can be sharded over its
``dp`` replicas (``paralab train fsdp --zero-stage 1 --pp P``).

Not supported: ``--accumulate`` (refused), parameters shared between units.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm, nbytes
from ..errors import UsageError
from ..kinds import MEMORY, MemoryModel
from ..losses import cross_entropy
from ..options import option
from .base import StepResult, Strategy, broadcast_buffers
from .replicas import Replicas

CATEGORIES = ("params", "grads", "optimizer")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The memory model's name for a built optimizer: "adam", "sgd-momentum" or "sgd"."""
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    return "sgd-momentum" if optimizer.param_groups[0].get("momentum") else "sgd"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(nbytes(t) for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


class Ledger:
    """Bytes held per category, as tensors are allocated and freed; peaks of each and of the sum."""

    def __init__(self):
        self.now = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.peak_split: dict[str, int] = dict(self.now)  # each category at the moment of peak_total
        self.peak_where = ""

    def add(self, category: str, size: int, where: str = "") -> None:
        self.now[category] += size
        self.peak[category] = max(self.peak[category], self.now[category])
        total = sum(self.now.values())
        if total > self.peak_total:
            self.peak_total, self.peak_split, self.peak_where = total, dict(self.now), where

    def sub(self, category: str, size: int) -> None:
        self.now[category] -= size

    def set(self, category: str, size: int, where: str = "") -> None:
        self.add(category, size - self.now[category], where)

    def report(self) -> dict:
        return {"peak_bytes": dict(self.peak), "sum_of_peaks_bytes": sum(self.peak.values()),
                "resident_peak_bytes": self.peak_total, "resident_peak_split": dict(self.peak_split),
                "resident_peak_at": self.peak_where}


class FlatUnit:
    """One unit's trainable parameters as a flat tensor, padded to a multiple of the ranks, sharded by rank.

    ``slots`` remembers where each parameter lives in the flat tensor. The
    parameters are held one of two ways:

    - removed (fsdp): they are deleted from the unit's modules and replaced
      by plain attributes that :meth:`bind` points at views of whichever
      full flat tensor is current;
    - kept (``keep_parameters=True``, :class:`ZeroOneReplicas`): they stay
      the modules' ``nn.Parameter``, their ``.data`` re-pointed by
      :meth:`hold_full` at views of the full flat tensor, so the module's own
      forward and backward run unchanged (``p.grad`` accumulates as usual).

    After set-up the unit holds either its full parameters (:meth:`hold_full`,
    stages 1-2: the shard is a view of this rank's slice) or only its shard
    (:meth:`hold_shard`, stage 3). The primitives below move its tensors over
    ``comm`` and count every byte they allocate or free in ``ledger``.
    """

    def __init__(self, index: int, module: nn.Module, comm: Comm, ledger: Ledger, device: torch.device,
                 keep_parameters: bool = False):
        self.index, self.module, self.comm, self.ledger, self.device = index, module, comm, ledger, device
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if len(list(module.named_parameters(remove_duplicate=False))) != len(list(module.named_parameters())):
            raise ValueError(f"unit {index} shares a parameter between layers; it cannot be flattened")
        self.slots = []  # (owning module, attribute, name in unit, shape, offset, numel)
        offset = 0
        for name, p in named:
            path, _, attr = name.rpartition(".")
            self.slots.append((module.get_submodule(path) if path else module, attr, name, p.shape,
                               offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // comm.world) * comm.world
        self.shard_numel = self.padded // comm.world
        self.dtype = named[0][1].dtype
        flat = torch.zeros(self.padded, dtype=self.dtype, device=named[0][1].device)
        torch.cat([p.detach().reshape(-1) for _, p in named], out=flat[:offset])
        self.initial = flat  # the starting values, consumed by hold_full or hold_shard
        self.params = [p for _, p in named] if keep_parameters else []
        if not keep_parameters:
            for owner, attr, *_ in self.slots:
                del owner._parameters[attr]
                setattr(owner, attr, None)
        self.sharded = False                       # only the shard is held; the full parameters are gathered
        self.full: torch.Tensor | None = None      # the full flat parameters, when materialised
        self.resident = False                      # full's storage is allocated (gathered or in flight)
        self.pending = None                        # an in-flight asynchronous all-gather
        self.shard: nn.Parameter | None = None     # rank's slice: the optimizer's parameter
        self.grad: torch.Tensor | None = None      # stage 1: the unreduced flat gradient, until backward ends

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def full_bytes(self) -> int:
        return self.padded * self.element_size

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self.element_size

    def _my_slice(self, flat: torch.Tensor) -> torch.Tensor:
        s = self.shard_numel
        return flat[self.comm.rank * s:(self.comm.rank + 1) * s]

    # ------------------------------------------------------------ holding the parameters
    def hold_full(self) -> None:
        """Keep the full flat parameters; the shard is a view of this rank's slice, updated in place."""
        self.full = self.initial.to(self.device)
        self.initial = None
        self.resident = True
        for p, (_, _, _, shape, offset, numel) in zip(self.params, self.slots):
            p.data = self.full[offset:offset + numel].view(shape)
        self.shard = nn.Parameter(self._my_slice(self.full))
        self.ledger.add("params", self.full_bytes, "init")

    def hold_shard(self) -> None:
        """Keep only this rank's shard (a copy); the full parameters are gathered when they are needed."""
        self.shard = nn.Parameter(self._my_slice(self.initial).clone().to(self.device))
        self.initial = None
        self.sharded = True
        self.ledger.add("params", self.shard_bytes, "init")

    def bind(self, flat: torch.Tensor, train: bool) -> list[torch.Tensor]:
        """Point the unit's parameter attributes at views of ``flat``; return them.

        For training the views are autograd leaves with a version counter of
        their own (taken from ``flat.data``), so the storage can be freed after
        forward and refilled for backward.
        """
        base = flat.data if train else flat
        views = []
        for owner, attr, _, shape, offset, numel in self.slots:
            v = base[offset:offset + numel].view(shape)
            if train:
                v = v.detach().requires_grad_()
            setattr(owner, attr, v)
            views.append(v)
        return views

    def unbind(self) -> None:
        for owner, attr, *_ in self.slots:
            setattr(owner, attr, None)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Complete tensors (unpadded) under the unit's parameter names."""
        return {name: flat[offset:offset + numel].view(shape).clone()
                for _, _, name, shape, offset, numel in self.slots}

    # ------------------------------------------------------------ primitives: parameters
    def gather(self, async_op: bool) -> None:
        """All-gather every rank's shard into ``full``: a sharded unit's into storage allocated now,
        a unit holding its full parameters in place (after a step updated this rank's slice)."""
        if not self.resident:
            if self.full is None:
                self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            else:
                self.full.untyped_storage().resize_(self.full_bytes)
            self.resident = True
            self.ledger.add("params", self.full_bytes, f"gather unit {self.index}")
        pending = self.comm.all_gather_into(self.full, self.shard.detach(), name="all_gather_params",
                                            async_op=async_op)
        self.pending = pending if async_op else None

    def prefetch(self) -> None:
        """A sharded unit's gather launched ahead of its use, unless it is gathered already."""
        if self.sharded and not self.resident:
            self.gather(async_op=True)

    def wait(self) -> None:
        """Wait for this unit's all-gather in flight, if any."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def materialize(self) -> None:
        """Make sure ``full`` holds the full, current parameters (waits for a gather in flight)."""
        if self.pending is not None:
            self.wait()
        elif not self.resident:
            self.gather(async_op=False)

    def free(self) -> None:
        """A sharded unit's gathered storage released; autograd's saved views keep only metadata."""
        if not self.sharded or not self.resident:
            return
        self.wait()  # never free memory a collective is still writing
        self.full.untyped_storage().resize_(0)
        self.resident = False
        self.ledger.sub("params", self.full_bytes)

    @torch.no_grad()
    def current(self) -> torch.Tensor:
        """The full parameters, current (outside training: a sharded unit's are gathered into a
        temporary tensor, not counted)."""
        self.wait()
        if not self.sharded:
            return self.full
        out = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        self.comm.all_gather_into(out, self.shard.detach(), name="all_gather_state")
        return out

    # ------------------------------------------------------------ primitives: gradients
    def flatten_grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The parameters' gradients as one flat tensor padded like the parameters; the caller drops
        ``grads`` now."""
        with self.comm.recorder.span("compute", "backward", unit=self.index, what="flatten_grad"):
            pad = self.padded - self.numel
            flat_grad = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(pad)] if pad else []))
        self.ledger.add("grads", self.full_bytes, f"flatten grad unit {self.index}")
        self.ledger.sub("grads", sum(nbytes(g) for g in grads))
        return flat_grad

    def reduce_scatter(self, flat_grad: torch.Tensor) -> str:
        """Sum ``flat_grad`` over ranks, keep this rank's slice / N as the shard's gradient; the caller
        drops ``flat_grad`` now. Returns which reduce-scatter ran (see ``Comm.reduce_scatter``)."""
        shard_grad = torch.empty(self.shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
        self.ledger.add("grads", self.shard_bytes, f"reduce-scatter unit {self.index}")
        kind = self.comm.reduce_scatter(shard_grad, flat_grad, name="reduce_scatter_grads")
        shard_grad.div_(self.comm.world)
        self.shard.grad = shard_grad.to(self.shard.dtype)
        self.ledger.sub("grads", self.full_bytes)
        return kind

    def drop_grad_shard(self) -> None:
        self.shard.grad = None
        self.ledger.sub("grads", self.shard_bytes)


def step_shards(rec, optimizer: torch.optim.Optimizer, ledger: Ledger, units: list[FlatUnit], **where) -> None:
    """The step primitive: the optimizer on the shards of ``units`` (the only ones with a gradient),
    their gradients dropped; units holding their full parameters then re-gather them.

    ``torch.optim`` skips parameters whose ``.grad`` is None and keeps its
    state per parameter (Adam's step count too), so stepping unit by unit
    updates every shard exactly as one step over all of them would. The
    re-gathers are asynchronous, each waited for only when the next forward
    (or a read of the weights) reaches its unit.
    """
    with rec.span("optimizer", "step", **where):
        optimizer.step()
        ledger.set("optimizer", optimizer_state_bytes(optimizer), "optimizer step")
        for fu in units:
            fu.drop_grad_shard()
    for fu in units:
        if not fu.sharded:
            fu.gather(async_op=True)


@dataclass
class FSDPOptions:
    """fsdp: ZeRO stage, optimizer step placement, prefetch"""
    zero_stage: int = option(3, "fsdp: what is sharded: 1 optimizer state, 2 + gradients, 3 + parameters",
                             choices=(1, 2, 3), identity=True)
    step_in_backward: bool = option(True, "fsdp stages 2-3: step each unit's shard as soon as its gradient is "
                                          "reduced, so gradient shards never pile up (off: one step after "
                                          "backward)")
    prefetch: bool = option(True, "fsdp stage 3: gather the next unit's parameters one unit ahead")


class FSDP(Strategy):
    name = "fsdp"
    data_parallel = True
    bn_rule = "first-replica"
    options = (FSDPOptions,)

    @classmethod
    def validate(cls, cfg, world):
        if cfg.accumulate != 1:
            raise UsageError("fsdp does not support --accumulate; drop it (use a larger --batch-size)")

    @classmethod
    def pipeline_replicas(cls, cfg):
        """Under ``--pp``: ZeRO-1 wraps each pipeline stage; stages 2-3 do not compose."""
        return ZeroOneReplicas if cfg.zero_stage == 1 else None

    @classmethod
    def why_not_pipelined(cls, cfg) -> str:
        return (f"ZeRO stage {cfg.zero_stage} reduce-scatters each unit's gradient inside its backward, once per "
                "microbatch under a pipeline (as DeepSpeed, only --zero-stage 1 composes with pipeline stages)")

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.stage = ctx.options.zero_stage
        self.shard_params = self.stage >= 3
        self.shard_grads = self.stage >= 2
        self.replicated = not self.shard_params  # stages 1-2 keep a full replica on every rank
        # stages 2-3 reduce each unit's gradient as soon as its backward is done, so its shard can be
        # stepped there and then (stage 1 has no reduced gradient before backward ends)
        self.step_in_backward = self.shard_grads and ctx.options.step_in_backward
        self.prefetch = ctx.options.prefetch
        self.ledger = Ledger()
        self.reduce_scatter_kind: str | None = None

        model = model_fn()  # every rank builds the same model (seeded factory), then keeps its shard
        self.keys = list(model.state_dict().keys())
        self.units = list(model)
        self.flat: dict[int, FlatUnit] = {}
        for i, unit in enumerate(self.units):
            if any(p.requires_grad for p in unit.parameters()):
                self.flat[i] = FlatUnit(i, unit, self.comm, self.ledger, ctx.device)
        self.model = model.to(ctx.device)  # what is left: modules without parameters, and buffers
        self.param_units = sorted(self.flat)
        self.flat_units = [self.flat[i] for i in self.param_units]
        for fu in self.flat_units:
            if self.shard_params:
                fu.hold_shard()
            else:
                fu.hold_full()
        self.optimizer = optim_fn([fu.shard for fu in self.flat_units])
        self.parameters = sum(fu.numel for fu in self.flat_units)

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        """Forward unit by unit; the loss; backward unit by unit from the last, each unit's gradient
        reduce-scattered to its shard as soon as it is computed (stage 1: once backward is over) and,
        stepping in backward, the shard stepped at once (else one step at the end); then BatchNorm
        statistics from rank 0."""
        self.model.train()
        graphs, logits = self._forward(x)
        with self.rec.span("compute", "forward", unit="loss"):
            with self.ctx.autocast():
                loss = cross_entropy(logits, y)
        with self.rec.span("compute", "backward", unit="loss"):
            grad = torch.autograd.grad(loss, logits)[0]
        for i in reversed(range(len(self.units))):
            grad = self._backward_unit(i, graphs.pop(), grad)
        if not self.shard_grads:  # stage 1: every flat gradient was held until backward is over
            for fu in self.flat_units:
                self.reduce_scatter_kind = fu.reduce_scatter(fu.grad)
                fu.grad = None
        if not self.step_in_backward:
            self._step(self.flat_units, unit="all")
        broadcast_buffers(self.comm, self.model)
        return StepResult(loss.item(), len(y))

    def _forward(self, x: torch.Tensor):
        """Unit by unit, each its own autograd graph (its input detached): the unit's parameters
        gathered (the next unit's gather launched) and bound, the unit run, its parameters freed (the
        last unit's stay: backward starts with them). Returns each unit's (input, output, parameter
        views), and the logits."""
        last = self.param_units[-1] if self.param_units else None
        self._prefetch(self._neighbour(-1, 1))
        graphs, h = [], x
        for i, unit in enumerate(self.units):
            fu = self._forward_ready(i)
            h_in = h.detach().requires_grad_(i > 0)
            with self.rec.span("compute", "forward", unit=i):
                leaves = fu.bind(fu.full, train=True) if fu is not None else []
                with self.ctx.autocast():
                    h = unit(h_in)
            if fu is not None and i != last:
                fu.free()
            graphs.append((h_in, h, leaves))
        return graphs, h

    def _backward_unit(self, i: int, graph, grad: torch.Tensor) -> torch.Tensor | None:
        """Unit ``i``'s backward, given its (input, output, parameter views) and its output's gradient;
        returns its input's gradient.

        The unit's parameters are re-gathered into the storage its forward
        used, the gradients of its input and parameters computed, the
        parameters freed and their gradients flattened; the previous unit's
        gather is launched only now (before this backward it would hold three
        units' full tensors at once), so it overlaps the reduce-scatter of
        this unit's flat gradient and, stepping in backward, its shard's step.
        """
        h_in, h_out, leaves = graph
        fu = self.flat.get(i)
        if fu is not None:
            fu.materialize()
        inputs = ([h_in] if i > 0 else []) + leaves
        if not inputs:  # a first unit without parameters: nothing to differentiate
            return None
        with self.rec.span("compute", "backward", unit=i):
            grads = torch.autograd.grad(h_out, inputs, grad, allow_unused=True, materialize_grads=True)
        grad_in = grads[0] if i > 0 else None
        if fu is None:
            return grad_in
        param_grads = grads[1:] if i > 0 else grads
        self.ledger.add("grads", sum(nbytes(g) for g in param_grads), f"backward unit {i}")  # autograd's
        fu.free()
        fu.unbind()
        flat_grad = fu.flatten_grads(param_grads)
        del grads, param_grads
        self._prefetch(self._neighbour(i, -1))
        if not self.shard_grads:
            fu.grad = flat_grad  # stage 1: reduced once backward is over
            return grad_in
        self.reduce_scatter_kind = fu.reduce_scatter(flat_grad)
        del flat_grad
        if self.step_in_backward:
            self._step([fu], unit=i)  # this unit's shard only; its gradient shard goes at once
        return grad_in

    def _step(self, units: list[FlatUnit], unit) -> None:
        step_shards(self.rec, self.optimizer, self.ledger, units, unit=unit)

    # ------------------------------------------------------------ which unit's parameters, when
    def _forward_ready(self, i: int) -> FlatUnit | None:
        """Unit ``i``'s flat parameters, gathered (the next unit's gather launched), or None if it has none."""
        fu = self.flat.get(i)
        if fu is not None:
            fu.materialize()
            self._prefetch(self._neighbour(i, 1))
        return fu

    def _prefetch(self, index: int | None) -> None:
        if self.prefetch and index is not None:
            self.flat[index].prefetch()

    def _neighbour(self, i: int, step: int) -> int | None:
        """The next unit with parameters after (step=1) or before (step=-1) unit ``i``."""
        j = i + step
        while 0 <= j < len(self.units):
            if j in self.flat:
                return j
            j += step
        return None

    def _settle(self) -> None:
        """Wait for every gather still in flight (before reading or saving the parameters)."""
        for fu in self.flat_units:
            fu.wait()

    # ------------------------------------------------------------ evaluation and state
    @torch.no_grad()
    def predict(self, x):
        self.model.eval()
        self._prefetch(self._neighbour(-1, 1))
        h = x
        for i, unit in enumerate(self.units):
            fu = self._forward_ready(i)
            if fu is not None:
                fu.bind(fu.full, train=False)
            with self.ctx.autocast():
                h = unit(h)
            if fu is not None:
                fu.free()
                fu.unbind()
        return h.to(self.ctx.dtype)

    @torch.no_grad()
    def full_state_dict(self):
        """Complete, unpadded tensors under the plain model's keys, on every rank (collective)."""
        self._settle()
        tensors = {}
        for i, fu in zip(self.param_units, self.flat_units):
            tensors.update({f"{i}.{k}": v for k, v in fu.unflatten(fu.current()).items()})
        tensors.update({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return {k: tensors[k] for k in self.keys}

    def state_dict(self):
        self._settle()
        return {"zero_stage": self.stage, "world": self.ctx.world, "rank": self.ctx.rank,
                "shards": [fu.shard.detach().clone() for fu in self.flat_units],
                "optimizer": self.optimizer.state_dict(),
                "buffers": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}

    @torch.no_grad()
    def load_state_dict(self, state):
        if state.get("zero_stage") != self.stage or state.get("world") != self.ctx.world:
            raise ValueError(f"checkpoint is fsdp stage {state.get('zero_stage')} on {state.get('world')} "
                             f"workers; this run is stage {self.stage} on {self.ctx.world}")
        self._settle()
        for fu, shard in zip(self.flat_units, state["shards"]):
            fu.shard.copy_(shard)
            if not fu.sharded:
                fu.gather(async_op=False)  # the other ranks' slices of the full parameters
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.load_state_dict(state["buffers"])
        self.ledger.set("optimizer", optimizer_state_bytes(self.optimizer), "load")

    @classmethod
    @torch.no_grad()
    def consolidate(cls, states, model):
        """Offline: per unit with parameters (as :class:`FlatUnit` lays it out: its trainable
        parameters in registration order, flat, zero-padded to a multiple of the ranks), the ranks'
        shards in rank order are the padded flat tensor; the padding is cut and the rest cut back
        into the parameters. Buffers (BatchNorm statistics): rank 0's, broadcast after every step."""
        world = states[0]["world"]
        if len(states) != world or [s["rank"] for s in states] != list(range(world)):
            raise ValueError(f"fsdp: {len(states)} rank state(s) for a run on {world} workers")
        units = [(i, unit) for i, unit in enumerate(model) if any(p.requires_grad for p in unit.parameters())]
        if any(len(s["shards"]) != len(units) for s in states):
            raise ValueError(f"fsdp: the checkpoint holds {len(states[0]['shards'])} sharded units; "
                             f"this model has {len(units)}")
        tensors = {}
        for n, (i, unit) in enumerate(units):
            flat = torch.cat([s["shards"][n].reshape(-1) for s in states])
            offset = 0
            for name, p in unit.named_parameters():
                if p.requires_grad:
                    if offset + p.numel() > flat.numel():
                        raise ValueError(f"fsdp: unit {i}'s shards hold {flat.numel()} values, fewer than its "
                                         "parameters")
                    tensors[f"{i}.{name}"] = flat[offset:offset + p.numel()].view(p.shape).clone()
                    offset += p.numel()
        tensors.update(states[0]["buffers"])
        return tensors

    # ------------------------------------------------------------ records
    def memory_model(self) -> MemoryModel:
        """What the cost model needs to predict this rank's memory (``records.py`` asks it)."""
        # autocast (bf16) keeps parameters, gradients and state in fp32: the fp32 model applies
        return MemoryModel(parameters=self.parameters, workers=self.ctx.world, zero_stage=self.stage,
                           optimizer=optimizer_kind(self.optimizer), precision="fp32",
                           unit_parameters=max((fu.numel for fu in self.flat_units), default=0),
                           step_in_backward=self.step_in_backward)

    def extra_summary(self):
        measured = self.ledger.report()
        if self.ctx.device.type == "cuda":
            measured["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        largest = max(self.flat_units, key=lambda fu: fu.numel, default=None)
        return {
            "zero_stage": self.stage,
            "reduce_scatter": self.reduce_scatter_kind,
            "prefetch": self.prefetch and self.shard_params,
            "step_in_backward": self.step_in_backward,
            "units_sharded": len(self.flat_units),
            "padding_elements": sum(fu.padded - fu.numel for fu in self.flat_units),
            "shard_elements": sum(fu.shard_numel for fu in self.flat_units),
            "largest_unit": None if largest is None else {"index": largest.index, "parameters": largest.numel,
                                                          "bytes": largest.full_bytes},
            MEMORY: {"measured": measured, "model": self.memory_model().to_dict()},
        }


class ZeroOneReplicas(Replicas):
    """ZeRO stage 1 as a data-parallel flavour: each replica's optimizer owns only its shard.

    Applied to any module (the whole model, or one pipeline stage's units):
    each child unit with trainable parameters (the module itself if it has
    parameters of its own) becomes a :class:`FlatUnit` that *keeps* its
    parameters: they stay the module's ``nn.Parameter``, their storage a view
    of the unit's padded flat tensor, so the module's own forward runs
    unchanged and autograd accumulates the full gradients in ``p.grad``. The
    optimizer is given this rank's slice of each flat tensor (a view).

    - ``finish()``: per unit, the gradients flattened and padded, reduce-
      scattered; this rank keeps the mean of its slice as the shard's gradient,
      the full gradients are dropped;
    - ``step()``: the optimizer steps the shards (in place, in the flat
      tensors), then an in-place all-gather per unit completes the other
      ranks' slices: launched asynchronously, waited for when the unit's next
      forward starts, or before its tensors are read (``state_dict``),
      loaded, or evaluated (``sync_buffers(after_step=False)``).

    Numerically plain data parallelism (as ``fsdp --zero-stage 1``).
    Constraints: the module is on its device before it is wrapped and is not
    moved afterwards (moving re-allocates the parameters, undoing the views);
    no parameter shared between units; one dtype per unit; a checkpoint loads
    only on the same dp world.
    """

    flavour = "zero1"

    def __init__(self, module: nn.Module, optim_fn, comm: Comm, ctx):
        self.ledger = Ledger()
        self.reduce_scatter_kind: str | None = None
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        self.units = []
        for i, unit in enumerate([module] if own else module.children()):
            trainable = [p for p in unit.parameters() if p.requires_grad]
            if not trainable:
                continue
            device = trainable[0].device
            fu = FlatUnit(i, unit, comm, self.ledger, device, keep_parameters=True)
            fu.hold_full()
            for register in (unit.register_forward_pre_hook, unit.register_state_dict_pre_hook,
                             unit.register_load_state_dict_pre_hook):
                register(lambda *_, fu=fu: fu.wait())
            self.units.append(fu)
        if len({id(p) for fu in self.units for p in fu.params}) != sum(len(fu.params) for fu in self.units):
            raise ValueError("zero1: a parameter is shared between units; it cannot be sharded")
        super().__init__(module, optim_fn, comm, ctx)

    def build_optimizer(self, optim_fn) -> torch.optim.Optimizer:
        return optim_fn([fu.shard for fu in self.units])

    def settle(self) -> None:
        """Wait for every all-gather still in flight."""
        for fu in self.units:
            fu.wait()

    @torch.no_grad()
    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:  # unused in this step: a zero gradient, as the reduction expects one
                p.grad = torch.zeros_like(p)
        self.ledger.add("grads", sum(nbytes(p.grad) for p in self.params), "backward")
        for fu in self.units:
            flat_grad = fu.flatten_grads([p.grad for p in fu.params])
            for p in fu.params:
                p.grad = None
            self.reduce_scatter_kind = fu.reduce_scatter(flat_grad)
            del flat_grad

    def step(self) -> None:
        self.settle()  # never step a shard whose flat tensor a gather is still writing
        step_shards(self.rec, self.optimizer, self.ledger, self.units)

    def sync_buffers(self, after_step: bool = True) -> None:
        if not after_step:  # the weights are about to be read or evaluated
            self.settle()
        super().sync_buffers(after_step)

    def state_dict(self) -> dict:
        self.settle()
        return {"zero1": {"world": self.comm.world, "shards": [fu.shard.detach().clone() for fu in self.units]},
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["zero1"]
        if saved["world"] != self.comm.world:
            raise ValueError(f"checkpoint is zero1 over {saved['world']} data-parallel replicas; "
                             f"this run has {self.comm.world}")
        self.settle()
        for fu, shard in zip(self.units, saved["shards"]):
            fu.shard.copy_(shard)
            fu.gather(async_op=False)  # the full parameters current on every replica
        self.optimizer.load_state_dict(state["optimizer"])
        self.ledger.set("optimizer", optimizer_state_bytes(self.optimizer), "load")

    def summary(self) -> dict:
        return {"zero_stage": 1, "reduce_scatter": self.reduce_scatter_kind, "units_sharded": len(self.units),
                "shard_elements": sum(fu.shard_numel for fu in self.units),
                "padding_elements": sum(fu.padded - fu.numel for fu in self.units),
                "memory": {"measured": self.ledger.report()}}
