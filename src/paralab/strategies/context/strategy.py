"""``--cp C``: context parallelism, each sample's sequence split over the ``cp`` group (the gpt).

Every rank of a cp group holds the whole model (or its tp slice, or its
pipeline stage) and the same samples as the others, but only ``T / C`` of
each sample's tokens (``layout.py``). Everything in a transformer but
attention works token by token, so it runs unchanged on those tokens; only
two things need the rest of the sequence:

- the position embedding: each token's *global* position
  (``Embedding.position_ids``), not ``0 .. T/C - 1``;
- attention: a query attends to every earlier token, wherever it lives. The
  attention core (``Attention.core``) becomes ring attention (``ring.py``:
  K/V passed around the ring, partial results merged by their log-sum-exp)
  or Ulysses (``ulysses.py``: all-to-all to head shards and back),
  ``--cp-method``.

The loss. A rank's loss is the mean over its own tokens, and every rank holds
the same number of them, so the mean of the C local means is the mean over
the whole sequence; gradients are averaged, once, over dp x cp (the mesh's
``dpcp`` group: the inner strategy's data-parallel flavour runs there), and
the reported loss is averaged over cp by one small all-reduce (what one
process reports). Dividing by C twice, or not at all, is the classic bug;
``--check`` catches either.

``paralab train cp --workers C --model gpt`` is pure context parallelism (cp =
workers / (pp x tp), gradients averaged by one all-reduce per parameter);
``paralab train ddp --workers 4 --cp 2 --model gpt`` is dp 2 x cp 2, the
named flavour averaging over dp x cp.

Composition (``strategies.plan``): :class:`ContextParallel` is the outermost
wrapper; inside it the layout runs as without cp (the flavour, a pipeline,
tensor parallelism), its units passed through :meth:`ContextParallelism.shard`
(``Context.shard``), its stage boundaries ``T / C`` tokens long
(``Context.activation_shape``). ``predict`` gathers the sequence back (for
evaluation and ``--check`` only).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...errors import UsageError
from ...mesh import MeshShape
from ...training import step as steps
from ...models.gpt import Block
from ...options import option
from ..allreduce import AllReduceReplicas
from ..base import Strategy
from . import balance
from .layout import Layout
from .ring import ring_attention
from .ulysses import ulysses_attention

METHODS = {"ring": ring_attention, "all-to-all": ulysses_attention}


@dataclass
class ContextOptions:
    """context parallelism (--cp, the gpt)"""
    cp_method: str = option("ring", "--cp: how attention sees the other ranks' tokens: ring (K/V passed around "
                                    "the cp group) or all-to-all (Ulysses: sequence shards to head shards and "
                                    "back; heads / tp must divide by cp)", choices=tuple(METHODS), identity=True)
    cp_balance: bool = option(True, "--cp: each rank holds a head chunk and a tail chunk of the sequence (2 cp "
                                    "chunks), so causal attention's work is equal; --no-cp-balance: one contiguous "
                                    "chunk each", identity=True)
    cp_balance_documents: bool = option(True, "--cp --packing (balanced): the 2 cp chunks dealt to the ranks every "
                                              "step by the attention blocks they compute, given where the documents "
                                              "end; --no-cp-balance-documents: the head + tail pairing")


class ContextParallelism:
    """The ``cp`` dimension of one rank: what it does to the units it holds (``ctx.cp``)."""

    def __init__(self, comm, layout: Layout, method: str, recorder, by_documents: bool = False):
        self.comm, self.layout, self.method, self.recorder = comm, layout, method, recorder
        self.positions = layout.positions(comm.rank)  # the modules hold this tensor: a new layout updates it in place
        self.by_documents = by_documents and layout.balanced and method == "ring"
        self.spreads: list[tuple[float, float]] = []  # per step: the ring's blocks over the even share, dealt and paired
        self.dealt = 0  # steps whose chunks were dealt otherwise than the head + tail pairing

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of this rank's tokens over the whole sequence (ring or Ulysses), in the current layout."""
        return METHODS[self.method](q, k, v, self.comm, self.layout, self.recorder)

    def at_step(self, ids: torch.Tensor | None) -> None:
        """Packed documents (``ids``: each token's document in this step's rows), balanced ring: deal the
        chunks for those rows (``balance.py``)."""
        if not self.by_documents or ids is None:
            return
        fixed = dataclasses.replace(self.layout, assignment=None)
        pairs = tuple(fixed.chunks_of(r) for r in range(fixed.size))  # head + tail
        work = balance.block_work(ids, fixed.chunks)
        self.layout = dataclasses.replace(fixed, assignment=balance.deal(work, pairs))
        self.dealt += self.layout.assignment != pairs
        self.positions.copy_(self.layout.positions(self.comm.rank))
        even = balance.even_time(work, fixed.size)
        self.spreads.append((balance.ring_time(work, self.layout.assignment) / even,
                             balance.ring_time(work, pairs) / even))

    def shard(self, units: dict[int, nn.Module]) -> dict[int, nn.Module]:
        """The embedding and every block's dropout told its tokens' global positions, every attention given the
        cp core."""
        for unit in units.values():
            if isinstance(unit, Block):
                unit.attn.attend = self.core  # inside Attention.core, so --recompute selective still wraps it
                unit.drop.position_ids = self.positions  # its dropout masks: this rank's tokens' positions
            elif isinstance(getattr(unit, "positions", None), nn.Embedding):  # the embedding, or its tp twin
                unit.position_ids = self.positions
        return units

    def activation_shape(self, index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Every per-sample shape of the gpt starts with the sequence: this rank's ``T / C`` tokens."""
        return (shape[0] // self.comm.world,) + tuple(shape[1:])

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``[B, T, ...]``."""
        return self.layout.take(t, self.comm.rank)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[B, T/C, ...]`` -> ``[B, T, ...]`` in position order (one all-gather)."""
        moved = t.movedim(1, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * self.comm.world,) + tuple(moved.shape[1:]))
        self.comm.all_gather_into(out, moved, name="cp_gather_logits")
        return out.index_select(0, self.layout.inverse().to(out.device)).movedim(0, 1)


class _GradientMesh:
    """The mesh as the inner strategy sees it: its data-parallel flavour averages over dp x cp (``dpcp``);
    everything else (the data shard it reads, pp, tp) is the mesh's own."""

    def __init__(self, mesh):
        self._mesh = mesh

    def comm(self, dim: str):
        return self._mesh.comm("dpcp" if dim == "dp" else dim)

    def __getattr__(self, name):
        return getattr(self._mesh, name)


class ContextParallel(Strategy):
    name = "cp"
    options = (ContextOptions,)
    clips = True  # the inner strategy clips
    #: the pure form (``paralab train cp``): dp 1, every rank reads the whole batch (its tokens of it)
    data_parallel = False

    def __init__(self, ctx, model_fn, optim_fn, inner_cls, inner_kwargs=None):
        super().__init__(ctx, model_fn, optim_fn)
        o = ctx.options
        self.cp = ContextParallelism(ctx.mesh.comm("cp"), Layout(o.context, ctx.mesh.size("cp"), o.cp_balance),
                                     o.cp_method, ctx.recorder, o.cp_balance_documents)
        inner_ctx = dataclasses.replace(ctx, cp=self.cp, mesh=_GradientMesh(ctx.mesh))
        self.inner = inner_cls(inner_ctx, model_fn, optim_fn, **(inner_kwargs or {}))
        self.microbatches, self.bn_rule = self.inner.microbatches, self.inner.bn_rule
        self.equal_microbatches = self.inner.equal_microbatches
        self.replicated = True  # every cp rank holds the same parameters

    # ------------------------------------------------------------ declarations
    @classmethod
    def pipeline_replicas(cls, cfg):
        """The pure form's flavour: one all-reduce per parameter, over the cp (and dp) ranks."""
        return AllReduceReplicas

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        """The pure form: cp takes the workers ``--pp`` and ``--tp`` leave (at least 2)."""
        rest = world // (cfg.pp * cfg.tp) if world % (cfg.pp * cfg.tp) == 0 else 0
        if cfg.cp not in (1, rest) or rest < 2:
            raise UsageError(f"strategy 'cp' is pure context parallelism over the workers left by --pp and --tp "
                             f"(here {world} / ({cfg.pp} x {cfg.tp})), at least 2; for data x context parallelism "
                             f"name the data-parallel flavour, e.g. 'paralab train allreduce --workers {world} "
                             f"--cp {cfg.cp if cfg.cp > 1 else 2} --model gpt'")
        return MeshShape.for_world(world, pp=cfg.pp, tp=cfg.tp, cp=rest)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        """What context parallelism needs of the model and the other options; then the inner layout's own
        checks, on the mesh without cp."""
        from ...models import MODALITY
        from .. import inner_plan
        shape, inner, _ = inner_plan(cfg, world)
        cp = shape.cp
        if MODALITY[cfg.model] != "text":
            raise UsageError(f"--cp {cp} splits a transformer's sequence; --model {cfg.model} has none: use "
                             "--model gpt (or drop --cp)")
        if cfg.experts or cfg.ep > 1:
            raise UsageError("--cp with a mixture of experts (--experts/--ep) is not composed: drop one of them")
        if cfg.sequence_parallel:
            raise UsageError("--cp with --sequence-parallel: both split the sequence; drop --sequence-parallel")
        problem = Layout(cfg.context, cp, cfg.cp_balance).problem()
        if problem:
            raise UsageError(problem)
        tp = cfg.tp
        if cfg.cp_method == "all-to-all" and (cfg.heads // tp) % cp:
            raise UsageError(f"--cp-method all-to-all gives each cp rank whole heads: the {cfg.heads} heads"
                             f"{f' / tp {tp}' if tp > 1 else ''} must divide by cp {cp}; change --heads or --cp, "
                             "or use --cp-method ring")
        if inner is not cls:
            inner.validate(cfg, world // cp)

    # ------------------------------------------------------------ the contract
    def replicas(self):
        return self.inner.replicas()

    def train_step(self, x, y):
        self.cp.at_step(steps.current().doc_ids)  # packed documents: this step's chunks for each rank
        result = self.inner.train_step(self.cp.take(x), self.cp.take(y))
        if result.loss is not None:  # the mean of the cp ranks' means: the whole sequence's
            loss = torch.tensor([result.loss], dtype=self.ctx.dtype)
            self.cp.comm.all_reduce(loss, name="cp_loss_all_reduce")
            result = dataclasses.replace(result, loss=loss.item() / self.cp.comm.world)
        return result

    @torch.no_grad()
    def predict(self, x):
        local = self.inner.predict(self.cp.take(x))
        return None if local is None else self.cp.gather(local)

    def full_state_dict(self):
        return self.inner.full_state_dict()

    def state_dict(self):
        inner = type(self.inner)
        return {"cp": {"rank": self.cp.comm.rank, "size": self.cp.comm.world,
                       "inner": f"{inner.__module__}:{inner.__qualname__}"},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])

    @classmethod
    def _inner_states(cls, states):
        """The inner class and the states of cp rank 0's ranks (every cp rank holds the same)."""
        module, name = states[0]["cp"]["inner"].split(":")
        return getattr(importlib.import_module(module), name), [s["inner"] for s in states if s["cp"]["rank"] == 0]

    @classmethod
    def consolidate(cls, states, model):
        inner_cls, inner = cls._inner_states(states)
        return inner_cls.consolidate(inner, model)

    @classmethod
    def portable(cls, states, model):
        inner_cls, inner = cls._inner_states(states)
        return inner_cls.portable(inner, model)

    def load_portable(self, portable):
        self.inner.load_portable(portable)

    def unexercised(self):
        ring = ["cp: a ring of 2 ranks, where each rank's next is also its previous, so the direction K/V travel "
                "is not exercised: --cp 4 (and --workers 4)"] if self.cp.method == "ring" and self.cp.comm.world == 2 \
            else []
        paired = ["cp: every step's chunks were dealt as the head + tail pairing (no better deal for where "
                  "its documents end), so a dealt layout (other chunks, in another order, on each rank) is not "
                  "exercised: more chunks (--cp 4, and --workers 4) or more document ends in a sequence (a longer "
                  "--context, a shorter --doc-length)"] if self.cp.spreads and not self.cp.dealt else []
        return ring + paired + self.inner.unexercised()

    def extra_summary(self):
        layout = self.cp.layout
        return {**self.inner.extra_summary(),
                "context_parallel": {"size": layout.size, "rank": self.cp.comm.rank, "method": self.cp.method,
                                     "balanced": layout.balanced, "chunks": list(layout.chunks_of(self.cp.comm.rank)),
                                     "tokens": layout.local, **self.document_balance()}}

    def document_balance(self) -> dict:
        """Packed documents on a balanced ring: the blocks the ring waits for (the busiest rank's in each rotation,
        ``balance.ring_time``) over an even share of them, mean over the steps, as dealt and as the head + tail
        pairing would have had them (1: even)."""
        if not self.cp.spreads:
            return {}
        dealt, fixed = zip(*self.cp.spreads)
        return {"document_balance": {"dealt_over_even": sum(dealt) / len(dealt),
                                     "head_tail_over_even": sum(fixed) / len(fixed), "steps": len(dealt)}}
