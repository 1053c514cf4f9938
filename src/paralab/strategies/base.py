"""The strategy contract: one object per rank that owns the whole training step.

A strategy is built from a model factory, an optimizer factory and the rank's
:class:`Context`. The training loop only ever calls:

- ``train_step(x, y) -> StepResult``: forward, backward, synchronisation and
  optimizer step for one global step. ``x, y`` is what :meth:`replicas` asked
  for: this rank's data-parallel shard of the global batch.
- ``predict(x)``: logits where this rank has them (else None), eval mode.
- ``full_state_dict()``: the whole model, same keys as the plain model.
- ``state_dict()`` / ``load_state_dict()``: this rank's own resumable state.
- ``consolidate(states, model)`` (a classmethod, offline): every rank's saved
  ``state_dict()`` put back together into the whole model's tensors, in one
  process without a process group (``paralab export``).
- ``portable(states, model)`` (offline) / ``load_portable(portable)``: the same,
  with every parameter's optimizer state, in no layout (``portable.py``), and
  this rank's part of it: resuming under another strategy or layout.

A strategy declares how a global batch is split, so the loop hands each rank
exactly its samples and the reference run (check/reference.py) replays the same
arithmetic: ``replicas()`` (how many data-parallel shards and which one is
ours: the mesh's ``dp`` dimension) and ``microbatches`` (how each shard is
cut inside a step).

Where a strategy sits on the mesh (``paralab.mesh``) is declared by
:meth:`Strategy.mesh_shape`; how it composes with pipeline stages
(``--pp``) by :meth:`Strategy.pipeline_replicas`: the data-parallel flavour
(``replicas.py``) a pipeline stage is wrapped in, or None where the strategy
cannot be composed. The options it reads are dataclasses it lists in
``options`` (``paralab.options``), received typed as ``ctx.options``.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import UsageError
from ..training.losses import cross_entropy
from ..mesh import Mesh, MeshShape
from ..training import step as steps
from ..models.moe import take_aux_loss, take_history
from ..recorder import Recorder
from ..training import grad_norm
from ..training.loss_scale import LossScale


@dataclass
class Guard:
    """One step's gradient norm and non-finite guard (``--clip-grad``, ``--on-nonfinite``): what
    :meth:`Strategy.clip_gradients` decided, read by :meth:`Strategy.run_step` into the step's result. A context
    and every context a composed strategy derives from it (``dataclasses.replace``) share one."""
    norm: float | None = None   # the whole model's gradient norm before clipping (None: not computed)
    skipping: str = ""          # why this step's update is skipped (--on-nonfinite skip), or ""
    losses_finite: list = field(default_factory=list)  # this step's losses, finite or not (--on-nonfinite)

    def begin(self) -> None:
        self.norm, self.skipping = None, ""
        self.losses_finite.clear()


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    comm: Comm
    recorder: Recorder
    precision: str = "fp32"
    options: object = None       # the strategies' options, typed (strategies.all_options.StrategyOptions)
    mesh: Mesh | None = None     # the rank grid; None: one dimension, dp over the whole world
    batch_size: int = 0          # the global batch (a pipeline sizes its partition measurement with it)
    tp: object = None            # tensor parallelism (strategies/tensor): None, or what shards the units held
    cp: object = None            # context parallelism (strategies/context): None, or what splits the sequence
    clip_grad: float | None = None  # --clip-grad: the whole model's gradient norm clipped to it (grad_norm.py)
    on_nonfinite: str | None = None  # --on-nonfinite stop | skip: a guard before every optimizer step
    guard: Guard = field(default_factory=Guard)  # this step's norm and skip decision (shared by derived contexts)
    loss_scale: LossScale | None = None  # --precision fp16: the dynamic loss scale (shared by derived contexts)

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The cross-entropy: tensor parallelism's where it splits the logits, else the plain one."""
        return self.tp.loss(logits, target) if self.tp is not None else cross_entropy(logits, target)

    def loss(self, logits: torch.Tensor, target: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """The training loss (:meth:`cross_entropy`), watched by the non-finite guard (``--on-nonfinite``);
        under fp16 its gradient scaled by the loss scale (``training/loss_scale.py``; ``share``: times this
        share too), its value not."""
        loss = self.cross_entropy(logits, target)
        if self.on_nonfinite:
            self.guard.losses_finite.append(torch.isfinite(loss.detach()).all())
        return self.scaled(loss, share)

    def scaled(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``loss`` as a step minimises it: under fp16 its gradient times the loss scale (and ``share``), its
        value unchanged (what :meth:`loss` returns; a mixture of experts' load-balancing losses join the
        gradients through it too, ``training_loss`` and a pipeline stage's ``carry_aux_loss``)."""
        return loss if self.loss_scale is None else self.loss_scale.scaled(loss, share)

    @property
    def guarded(self) -> bool:
        """Whether :meth:`Strategy.clip_gradients` has work this step: a norm to clip to, a non-finite guard,
        or fp16's loss scale to take out of the gradients."""
        return bool(self.clip_grad or self.on_nonfinite or self.loss_scale is not None)

    @property
    def skipping(self) -> str:
        """Why this step's update is skipped (``--on-nonfinite skip``: every rank alike), or ""."""
        return self.guard.skipping

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step, unless this step's update is skipped; its gradients dropped either way."""
        if not self.guard.skipping:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def shard(self, units: dict[int, nn.Module]) -> dict[int, nn.Module]:
        """The units (keyed by their index in the whole model) as this rank holds them: under
        tensor parallelism its slice of each; under context parallelism with its sequence's attention."""
        units = self.tp.shard(units) if self.tp is not None else units
        return self.cp.shard(units) if self.cp is not None else units

    def activation_shape(self, index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample shape of the tensor entering unit ``index`` (a pipeline's stage boundary)."""
        shape = self.tp.activation_shape(index, shape) if self.tp is not None else tuple(shape)
        return self.cp.activation_shape(index, shape) if self.cp is not None else shape

    @property
    def dtype(self) -> torch.dtype:
        """Parameters, activations between ranks and logits: float64 under ``--precision fp64``, else
        float32 (bf16 and fp16 autocast compute in 16 bits but keep fp32 parameters and send fp32)."""
        return torch.float64 if self.precision == "fp64" else torch.float32

    def autocast(self):
        if self.precision in AUTOCAST:
            return torch.autocast(self.device.type, dtype=AUTOCAST[self.precision])
        return nullcontext()


#: the precisions that train under autocast, and its dtype (parameters, gradients and messages stay float32)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    loss: float | None  # mean loss over the samples this rank saw (None: no loss here)
    samples: int        # samples this rank trained on
    moe: list | None = None  # a mixture of experts: per MoE layer, this step's routing (moe_record)
    grad_norm: float | None = None  # --clip-grad: the whole model's gradient norm before clipping
    skipped: str = ""                # --on-nonfinite skip: why every rank skipped this step's update ("": it did not)


def moe_record(model: nn.Module) -> list | None:
    """Per MoE layer, what its router decided this step over this rank's forwards (None: no MoE):
    tokens routed to each expert (kept choices), dropped choices, the load-balancing loss (mean over
    the forwards), the smallest top-k margin, and where the experts are split the tokens each of this
    rank's experts received (``received``); ``layer``: the layer's block index (a pipeline stage holds
    some of them)."""
    out = []
    for layer, forwards in take_history(model, numbered=True):
        if not forwards:
            continue
        rec = {"layer": layer, "counts": [sum(c) for c in zip(*(f["counts"] for f in forwards))],
               "dropped": sum(f["dropped"] for f in forwards),
               "aux": sum(f["aux"] for f in forwards) / len(forwards),
               "min_margin": min(f["min_margin"] for f in forwards)}
        if "received" in forwards[0]:
            rec["received"] = [sum(c) for c in zip(*(f["received"] for f in forwards))]
        out.append(rec)
    return out or None


def training_loss(ctx_loss, model: nn.Module, logits: torch.Tensor, target: torch.Tensor, scaled=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss a step minimises, the loss it reports): the cross-entropy (``ctx_loss``) plus a mixture of
    experts' weighted load-balancing losses from the forward that gave ``logits`` (``models/moe.py``; through
    ``scaled``, ``Context.scaled``, as ``ctx_loss`` scales the cross-entropy), and the cross-entropy alone.
    Every layout reports the cross-entropy (a pipeline's load-balancing losses sit on the stages that hold
    the experts, not beside the loss); those are recorded per MoE layer."""
    loss = ctx_loss(logits, target)
    aux = take_aux_loss(model)
    if aux is None:
        return loss, loss
    aux = aux.to(loss.dtype)
    return loss + (scaled(aux) if scaled is not None else aux), loss


ModelFactory = Callable[[], nn.Sequential]
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int):
    """Cut a batch into ``m`` contiguous microbatches, each with its loss weight.

    The weight is the microbatch's share of the samples (``1/m`` when ``m``
    divides the batch), so the weighted sum of microbatch mean losses is the
    mean loss of the whole batch. Strategies and the reference share this.
    """
    n = len(y)
    return [(xs, ys, len(ys) / n) for xs, ys in zip(torch.tensor_split(x, m), torch.tensor_split(y, m))
            if len(ys)]


@torch.no_grad()
def broadcast_buffers(comm: Comm, module: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics) to every rank, one flat broadcast per dtype
    (two dozen tiny broadcasts would cost more in latency than their bytes)."""
    if comm.world == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for buffers in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        comm.broadcast(flat, 0, name="broadcast_buffers")
        if comm.rank != 0:
            for b, part in zip(buffers, flat.split([b.numel() for b in buffers])):
                b.copy_(part.view_as(b))


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class Strategy:
    name = "base"
    #: each rank trains on its own shard of the global batch (else: all see it whole)
    data_parallel = True
    #: every rank holds a full replica whose parameters must stay identical
    replicated = True
    #: how BatchNorm running statistics relate to a single process (see check/reference.py):
    #: "first-replica": rank 0's statistics are authoritative (broadcast each step);
    #: "sequential": one module sees each microbatch in turn.
    bn_rule = "first-replica"
    #: what the commands use this strategy for: "baseline" (speed-ups are measured against it),
    #: "scaling" (the data-parallel strategy scaling sweeps study by default)
    roles: tuple[str, ...] = ()
    #: the option classes (paralab.options) this strategy reads from ``ctx.options``
    options: tuple[type, ...] = ()
    #: it trains a mixture of experts (models/moe.py): the load-balancing loss is part of its loss
    #: (``training_loss``, or carried by a pipeline stage's outputs); else --experts is refused
    moe: bool = False
    #: it can clip the whole model's gradient norm (``--clip-grad``) and guard its step (``--on-nonfinite``):
    #: it implements :meth:`held_gradients` and calls :meth:`clip_gradients` between synchronising the
    #: gradients and the optimizer step, and steps its optimizers with ``ctx.update`` (or honours
    #: ``ctx.skipping``); :meth:`run_step` puts the norm and the skip into the step's result
    clips: bool = False
    #: it refuses microbatches of unequal sizes (a pipeline), so they are no path of it a check could leave out
    equal_microbatches: bool = False
    #: a narrower dtype its gradients cross the wire in, which the check's reference does not replay (a user's
    #: fp16 all-reduce, say): the check then judges it by its noise band, at any precision, one of whose
    #: references rounds each gradient through this dtype (check/band.py). None: none, or one replayed
    #: (``--compress``: the reference compresses alike)
    gradient_wire: torch.dtype | None = None
    #: the check's reference replays its arithmetic op for op on two data-parallel shards of one microbatch each:
    #: each rank's parameters and gradients are tensors of its own (as the reference's are), and any all-reduce
    #: adds two gradients bit for bit (a + b = b + a). Below fp64 such a run on a CPU is then held to exact, not
    #: to a noise band (``check/band.py``, held_exact). Not FSDP's: its parameters are views into one flat tensor,
    #: and a CPU's kernels may round by where in memory a view starts
    replayed: bool = False

    def __init__(self, ctx: Context, model_fn: ModelFactory, optim_fn: OptimizerFactory):
        self.ctx = ctx
        self.rec: Recorder = ctx.recorder
        self.comm: Comm = ctx.comm
        self.microbatches = 1  # how this rank's shard is cut inside a step (set by the strategies that cut it)

    # ------------------------------------------------------------ declarations
    @classmethod
    def validate(cls, cfg, world: int) -> None:
        """Raise UsageError for options this strategy cannot run with."""

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        """The grid this strategy runs on: ``--pp`` stages, ``--tp`` shards, data parallelism over the rest."""
        if cfg.pp > 1 and cls.pipeline_replicas(cfg) is None:
            raise UsageError(f"strategy {cls.name!r} cannot be composed with pipeline stages (--pp {cfg.pp}): "
                             f"{cls.why_not_pipelined(cfg)}")
        if cfg.tp > 1 and cls.pipeline_replicas(cfg) is None:
            raise UsageError(f"strategy {cls.name!r} cannot be composed with tensor parallelism (--tp {cfg.tp}): "
                             f"{cls.why_not_pipelined(cfg)}; for pure tensor parallelism use 'paralab train tp'")
        cp = getattr(cfg, "cp", 1)
        if cp > 1 and cls.pipeline_replicas(cfg) is None:
            raise UsageError(f"strategy {cls.name!r} cannot be composed with context parallelism (--cp {cp}): it "
                             "has no data-parallel flavour (the one --pp and --tp compose with) to average the "
                             "gradients over dp x cp; name a strategy that has one")
        return MeshShape.for_world(world, pp=cfg.pp, tp=cfg.tp, cp=cp)

    @classmethod
    def check_limit(cls, cfg) -> str | None:
        """Why ``--check`` of this strategy at ``cfg`` cannot be trusted to pass although the
        arithmetic is right (a known limit of the fp32 comparison, see check/reference.py); None: it can.
        ``paralab compare`` leaves such runs out of a checked comparison, saying why."""
        return None

    @classmethod
    def pipeline_replicas(cls, cfg):
        """The data-parallel flavour (a Replicas class) that wraps a part of the model: each pipeline
        stage under ``--pp``, the sharded model under ``--tp``."""
        return None

    @classmethod
    def why_not_pipelined(cls, cfg) -> str:
        return "it has no data-parallel flavour that wraps a pipeline stage"

    def replicas(self) -> tuple[int, int]:
        """(number of data-parallel shards, this rank's shard): the mesh's dp dimension."""
        if self.ctx.mesh is not None:
            return self.ctx.mesh.size("dp"), self.ctx.mesh.coords["dp"]
        return (self.ctx.world, self.ctx.rank) if self.data_parallel else (1, 0)

    # ------------------------------------------------------------ contract
    def run_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """One training step, as every driver takes it: :meth:`train_step`, with the step's gradient norm and
        skip decision (:meth:`clip_gradients`) in its result."""
        guard = self.ctx.guard
        guard.begin()
        result = self.train_step(x, y)
        return dataclasses.replace(result, grad_norm=guard.norm, skipped=guard.skipping)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """Forward, backward, synchronise, (clip,) optimizer step, on this rank's shard of the step."""
        raise NotImplementedError

    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    @classmethod
    def consolidate(cls, states: list[dict], model: nn.Module) -> dict[str, torch.Tensor]:
        """Offline, in one process (no process group): every rank's :meth:`state_dict`, in rank
        order, as its checkpoint holds it -> the whole model's tensors under the plain model's keys,
        what :meth:`full_state_dict` gives. ``model`` is the run's model, freshly built: its keys
        and shapes say how the saved pieces fit (its values are not used)."""
        raise NotImplementedError(f"strategy {cls.name!r} cannot put its rank checkpoints together")

    @classmethod
    def portable(cls, states: list[dict], model: nn.Module):
        """Offline, as :meth:`consolidate`: every rank's saved state -> a
        :class:`~.portable.Portable` (the whole tensors and each parameter's whole optimizer state,
        plain names), to resume under another layout. ``model``: the module the ranks held, freshly
        built (under tensor parallelism, their sharded twin)."""
        raise NotImplementedError(f"strategy {cls.name!r} cannot resume into another layout")

    def load_portable(self, portable) -> None:
        """This rank's part of a :class:`~.portable.Portable` (its slices, shards, stage), loaded as
        :meth:`load_state_dict` would load this layout's own checkpoint."""
        raise NotImplementedError(f"strategy {self.name!r} cannot resume from another layout")

    @classmethod
    def reshards(cls) -> bool:
        """Whether this strategy can resume from, and be resumed as, another layout."""
        return cls.portable.__func__ is not Strategy.portable.__func__ and \
            cls.load_portable is not Strategy.load_portable

    def extra_summary(self) -> dict:
        """Strategy-specific figures for summary.json (e.g. hidden communication)."""
        return {}

    def unexercised(self) -> list[str]:
        """The paths of this strategy that this layout leaves trivial, so a ``--check`` says nothing about
        them (each a line naming the option that would exercise it): ``check/verdict.py`` prints them."""
        return []

    # ------------------------------------------------------------ the gradient norm (--clip-grad)
    def held_gradients(self) -> list[tuple[torch.Tensor, object]]:
        """After the step's gradients are synchronised: each gradient this rank holds, with how many ranks
        hold the same one (a number, or per element a tensor of its shape): training/grad_norm.py."""
        raise NotImplementedError(f"strategy {self.name!r} cannot compute the whole model's gradient norm")

    def clip_gradients(self) -> None:
        """Between the gradients' synchronisation and the optimizer step, one all-reduce over every rank for:

        - ``--clip-grad``: the whole model's gradient norm, every gradient this rank holds scaled to it;
        - ``--on-nonfinite``: whether any rank's loss or gradient is not finite this step. ``stop`` raises
          :class:`~paralab.training.grad_norm.NonFinite` naming the ranks, on every rank; ``skip`` sets
          ``ctx.skipping`` to why (``ctx.update`` then drops the gradients: the optimizers do not step).

        - ``--precision fp16``: first each gradient this rank holds divided by the loss scale; where any rank's
          gradient is not finite every rank skips the update and the scale halves (``training/loss_scale.py``).

        The norm before clipping goes into ``ctx.guard`` (:meth:`run_step` reports it); with none of these,
        nothing is done."""
        ctx, guard = self.ctx, self.ctx.guard
        if not ctx.guarded:
            return
        held = self.held_gradients()
        with self.rec.span("optimizer", "grad_norm"):
            if ctx.loss_scale is not None:
                ctx.loss_scale.unscale_(g for g, _ in held)
            local = grad_norm.square_sum(held)
            bad_loss = None  # None: no finite flags in the all-reduce; else whether this rank's loss was not finite
            if ctx.on_nonfinite or ctx.loss_scale is not None:  # the guard's flags, or fp16's overflow
                bad_loss = bool(ctx.on_nonfinite) and not all(bool(f) for f in guard.losses_finite)
                guard.losses_finite.clear()
        norm, losses, grads = grad_norm.reduce(ctx.comm, local, ctx.device, bad_loss)
        guard.norm = norm
        if ctx.loss_scale is not None and not losses:
            change = ctx.loss_scale.update(bool(grads))
            if grads:  # an overflow: what loss scaling expects now and then, not an error; no norm to report
                guard.norm = None
                guard.skipping = (f"step {self.rec.step + 1} (steps.jsonl step {self.rec.step}): the gradient "
                                  f"overflowed on rank{'s' if len(grads) > 1 else ''} {', '.join(map(str, grads))} "
                                  f"({change})")
                return
        if losses or grads:
            where = "; ".join(f"{what} is not finite on rank{'s' if len(ranks) > 1 else ''} "
                              f"{', '.join(map(str, ranks))}" for what, ranks in (("the loss", losses),
                                                                                   ("the gradient", grads)) if ranks)
            why = f"step {self.rec.step + 1} (steps.jsonl step {self.rec.step}): {where}"
            if ctx.on_nonfinite == "stop":
                raise grad_norm.NonFinite(f"{why} (--on-nonfinite stop: no rank took this step's update)")
            guard.skipping = why
            return
        if ctx.clip_grad:
            with self.rec.span("optimizer", "clip_grad"):
                grad_norm.clip_([g for g, _ in held], norm, ctx.clip_grad)

    def copies(self, key: str) -> int:
        """How many ranks of the dimensions outside data parallelism hold parameter ``key``'s gradient (plain
        name): tensor parallelism's size for a parameter it does not split, else 1."""
        tp = self.ctx.tp
        return 1 if tp is None or key in tp.layout else tp.group.size

    @staticmethod
    def plain_keys(units: dict[int, nn.Module]) -> dict[int, str]:
        """``id(parameter) -> its plain name`` for units keyed by their index in the whole model."""
        return {id(p): f"{i}.{name}" for i, unit in units.items() for name, p in unit.named_parameters()}

    # ------------------------------------------------------------ shared pieces
    @torch.no_grad()
    def eval_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Logits of a whole (local or sharded-module) model in eval mode, in the run's dtype
        (fp32, or fp64 under ``--precision fp64``)."""
        model.eval()
        with self.ctx.autocast():
            return model(x).to(self.ctx.dtype)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         before_last: Callable | None = None, last: Callable | None = None) -> float:
        """Forward and backward over this rank's microbatches; gradients accumulate.

        ``before_last`` / ``last`` (if given) are context-manager factories
        entered around every microbatch but the last, and around the last one
        (gradient accumulation: ``no_sync``, then the synchronising backward).
        Returns the mean loss over the batch.
        """
        chunks = split_microbatches(x, y, self.microbatches)
        steps.split([len(c[1]) for c in chunks])  # where each microbatch's rows sit (dropout, documents)
        total = 0.0
        for i, (xs, ys, weight) in enumerate(chunks):
            around = last if i == len(chunks) - 1 else before_last
            with around() if around else nullcontext(), steps.microbatch(i):
                with self.rec.span("compute", "forward", mb=i):
                    with self.ctx.autocast():
                        loss, reported = training_loss(self.ctx.loss, model, model(xs), ys, self.ctx.scaled)
                with self.rec.span("compute", "backward", mb=i):
                    (loss * weight).backward()
            total += reported.item() * weight
        return total
