"""The noise band: how far from the reference a correct layout may land below fp64, measured for each run.

In fp64 a correct layout reproduces the single-process reference to about
1e-12, and ``--check`` judges it against fixed tolerances. In fp32, bf16 and fp16 it
cannot: a layout adds, casts and reduces in another order than one process,
each step carries those roundings into the next, and momentum, Adam's moments
and BatchNorm amplify them. A tolerance set by hand is either too tight at a
real learning rate (a correct run fails) or too loose at the course's (a bug
passes). So the check measures, for the very run it judges, how far the
reference itself moves under changes a correct layout may legitimately make.
Rank 0 trains three more references beside the one the run is compared with,
each changed in one way (``Replay.perturb``, ``check/reference.py``):

- ``reordered``: each step's gradient added up in another order (the global
  batch cut into more pieces and added last first; with BatchNorm, compression
  or experts, the shards' gradients added last first), as another layout's
  reduction adds it;
- ``rounded``: each gradient rounded once more, element by element by up to
  one unit roundoff of the precision the run computes in (bf16's or fp16's
  under autocast, TF32's where CUDA's matmuls or convolutions use it), as another
  layout's kernels and collectives round it; for a strategy that declares a
  narrower ``gradient_wire`` than it (a user's fp16 all-reduce, which the
  reference does not replay), each gradient is rounded through that dtype,
  and the band applies at every precision, fp64's too;
- ``exact``: the same training in float64 without autocast: how far the run's
  precision alone carries the reference from the exact answer.

The band of each compared tensor (each weight, each optimizer state, each
step's loss and gradient norm, the logits) is ``MULTIPLE`` times the largest
deviation of any of the three from the reference, and never less than
``FLOOR`` unit roundoffs of the tensor's largest magnitude. Why ``MULTIPLE``
is 8: the run and the reference are two roundings of the same exact training,
so the run lies about twice the ``exact`` spread from the reference (the
triangle inequality, each side about as far from the exact answer); and a
tensor's largest deviation is set by its few most sensitive elements (Adam's
first steps divide each gradient by its own size, so an element near zero
turns a rounding of the gradient into a large change of its weight), whose
roundings in two computations can differ by several times: 8 leaves a factor
of 4 for that. The floor keeps the band from vanishing where the three agree
to the bit (a step's first loss, before any update). How the band holds on
every built-in layout, and how far bugs land outside it:
docs/correctness.md ("Bug or rounding").

Held to exact instead (:func:`held_exact`): a layout whose arithmetic the
reference replays op for op has no rounding of its own to measure. paralab's
replicated data-parallel strategies (``Strategy.replayed``: ddp, allreduce,
gather-scatter, torch-ddp) on two shards of one microbatch each are such a
layout: each rank's forward and backward are the reference's on the same
rows and on tensors of its own, and the sum of two gradients is the same
bits in any order. On CPUs that run the same kernels with the same threads
on every rank, a correct run of them is exact in every precision, and
anything beyond exact is a bug, however small against a band (PowerSGD
without its error feedback moves bf16 weights by about half the band that
its projection's sensitivity to rounding measures). Not held: on CUDA (some
kernels add in any order), with ``--clip-grad`` (the reference clips with
torch's ``clip_grad_norm_``, which rounds the norm otherwise), over
documents (the reference's loss is torch's over the whole batch), with
accumulation, a resumed run (the reference trains from step 0, and the
checkpoint's steps may have run in another layout or on another machine),
FSDP (views into a flat tensor) or a user's strategy. "Op for op" up to
exact operations: the reference backs half of each shard's loss where the
run halves its summed gradient, the same bits (halving is exact).
"""
from __future__ import annotations

import platform

import torch

from ..mesh import MeshShape
from .reference import max_abs_diff

#: the change each of the band's references makes to the reference's training (see the module)
PERTURBATIONS = ("reordered", "rounded", "exact")
#: the band is this many times the largest deviation of a perturbed reference from the reference
MULTIPLE = 8.0
#: and at least this many unit roundoffs of the compared tensor's largest magnitude
FLOOR = 4.0


def unit_roundoff(precision: str, device: torch.device, wire: torch.dtype | None = None) -> float:
    """Half an ulp of 1 in the precision the run's arithmetic rounds to: a gradient wire's (a strategy's
    ``gradient_wire``) where it is the coarser; bf16 or fp16 under autocast; TF32 for fp32 on a CUDA device whose
    matmuls or convolutions use it (PyTorch's default for convolutions); fp32's; fp64's."""
    if wire is not None:
        return max(torch.finfo(wire).eps / 2, unit_roundoff(precision, device))
    if precision == "fp64":
        return 2.0 ** -53
    if precision == "bf16":
        return 2.0 ** -8
    if precision == "fp16":
        return 2.0 ** -11
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        return 2.0 ** -11
    return 2.0 ** -24


class Band:
    """The three perturbed references (:data:`PERTURBATIONS`), trained as far as asked, and the band each
    compared quantity gets from them. ``make(perturb, unit)`` builds one (a ``verdict.Reference``), on first
    need: a check whose comparisons are all exact (the same operations as one process) never trains them."""

    def __init__(self, make, precision: str, device: torch.device, wire: torch.dtype | None = None):
        self.unit = unit_roundoff(precision, device, wire)
        self.wire = wire
        self.make, self._refs = make, None

    @property
    def refs(self) -> list:
        if self._refs is None:
            self._refs = [self.make(p, self.unit) for p in PERTURBATIONS]
        return self._refs

    def describe(self) -> str:
        wire = f", the gradients rounded through {str(self.wire).replace('torch.', '')}" if self.wire else ""
        return (f"its noise band from {len(PERTURBATIONS)} more ({', '.join(PERTURBATIONS)}{wire}: "
                f"docs/correctness.md), {MULTIPLE:g} x their spread, at least {FLOOR:g} x {self.unit:.2g} of each "
                "tensor's scale")

    def advance_to(self, step: int) -> None:
        for ref in self.refs:
            ref.advance_to(step)

    def least_step(self) -> int:
        """The step the furthest-behind of its references stands at (0 before they are built)."""
        return min(ref.step for ref in self._refs) if self._refs is not None else 0

    def of(self, value, others) -> float:
        """The band of one tensor (or number) of the reference, from the perturbed references' ``others``."""
        value = torch.as_tensor(value).detach()
        if not value.is_floating_point() or value.numel() == 0:
            return 0.0  # integers (a BatchNorm's count) must match exactly
        spread = 0.0
        for other in others:
            other = torch.as_tensor(other).detach().to(value.device)
            if other.shape != value.shape:
                return float("inf")
            d = max_abs_diff(other, value)
            if d != d:  # a perturbed reference went to NaN: nothing can be told from rounding
                return float("inf")
            spread = max(spread, d)
        return max(MULTIPLE * spread, FLOOR * self.unit * float(value.abs().max()))

    def tensors(self, weights: dict, optimizer: dict) -> tuple[dict[str, float], dict[str, float]]:
        """Each weight's (and buffer's) band and each optimizer state entry's (``"name key"``), at the step the
        references stand at; ``weights`` and ``optimizer``: the reference's (a ``kept.Snapshot``'s)."""
        snaps = [ref.snapshot() for ref in self.refs]
        w = {name: self.of(t, [s.weights[name] for s in snaps]) for name, t in weights.items()}
        o = {f"{name} {key}": self.of(v, [s.optimizer[name][key] for s in snaps])
             for name, state in optimizer.items() for key, v in state.items() if v is not None}
        return w, o


def held_exact(cfg, strategy, source, comm, start: int = 0) -> str | None:
    """Why this run is held to exact below fp64, not to a band (the module docstring), or None. A collective
    where the run qualifies otherwise: every rank's kernels (torch, the CPU's instruction set, its threads)
    must be rank 0's, as the reference on rank 0 computes every shard. ``start``: the step a resumed run
    resumed at; a resumed run is not held (the reference trains from step 0, and the checkpoint's steps may
    have run in another layout, on other threads or another machine)."""
    mesh = strategy.ctx.mesh
    qualifies = (start == 0 and strategy.replayed and type(strategy).__module__.startswith("paralab.strategies.")
                 and (mesh.shape if mesh is not None else None) == MeshShape(dp=2) and strategy.microbatches == 1
                 and strategy.gradient_wire is None and not getattr(cfg, "clip_grad", None)
                 and not source.documents and strategy.ctx.device.type == "cpu")
    if not qualifies:
        return None
    mine = kernels()
    if any(list(k) != mine for k in comm.all_gather_objects(mine)):
        return None
    return (f"{strategy.name} on 2 shards of one microbatch each, on CPUs alike, is replayed op for op by the "
            "reference: a correct run is exact, so beyond exact is a bug (docs/correctness.md)")


def kernels() -> list:
    """What decides a CPU's roundings for given shapes: torch's version, the kernels' instruction set, the threads,
    the architecture and the CPU's model (a held run's ranks, and a kept reference's key, ``kept.digest``)."""
    return [torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), platform.machine(),
            cpu_model()]


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what the platform says)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
