"""``tp`` and ``--tp T``: tensor parallelism, alone or composed with data and pipeline parallelism.

Tensor parallelism splits the *layers*: every rank of a ``tp`` group holds a
slice of each weight and computes its share of every layer, with collectives
inside the forward and backward (``ops.py``, ``gpt.py``, ``vgg.py``). It is a
transformation of the units a strategy holds, so it composes by being
applied in the middle of the fixed order::

    stage the model (--pp)  ->  shard each stage's units over tp  ->  wrap them for data parallelism (dp)

(torchtitan's order too). This file holds:

- :class:`TensorParallelism`, the dimension: it shards units, gives the loss
  (vocabulary-parallel for the gpt), the stage-boundary shapes, and puts
  the slices back together. A strategy reaches it as ``ctx.tp``: data
  parallelism shards its model, a pipeline stage its units, and both take
  their loss from ``ctx.loss``; nothing else in them knows about tp.
- :class:`TensorParallel`, the strategy that runs a layout with ``tp > 1``:
  it builds the inner strategy (a data-parallel flavour, or a pipeline of
  them) with ``ctx.tp`` set, and around it gathers the slices wherever the
  whole model is asked for (``full_state_dict``, evaluation logits, export).

``paralab train tp --workers 2`` is pure tensor parallelism (tp = workers /
pp); ``paralab train ddp --workers 4 --tp 2`` is dp 2 x tp 2;
``paralab train ddp --workers 8 --tp 2 --pp 2 --microbatches 4`` is 3-D.
Every rank of a tp group sees the same data (the mesh's dp index alone picks
the shard), so the reference run replays the inner strategy's split.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
from types import SimpleNamespace
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...errors import UsageError
from ...training import recompute
from ...training.losses import cross_entropy
from ...mesh import MeshShape
from ...options import option
from ..base import Strategy
from ..data_parallel import DataParallel
from ..portable import Portable, tp_chunk
from . import gpt as tp_gpt
from . import vgg as tp_vgg
from .group import TPGroup
from .ops import vocab_parallel_cross_entropy


@dataclass
class TensorOptions:
    """tensor parallelism (tp, or --tp)"""
    sequence_parallel: bool = option(False, "with --tp on the gpt: LayerNorm, residuals and dropout on sequence "
                                            "shards; all-gather / reduce-scatter instead of all-reduce",
                                     identity=True)


class TensorParallelism:
    """The ``tp`` dimension of one rank: how the units it holds are sharded, and undone."""

    def __init__(self, comm, sequence_parallel: bool, model: nn.Sequential, recompute: str = "none"):
        """``model``: a freshly built whole model, to learn which units exist and how each is split;
        ``recompute``: what the sharded twins recompute (``training/recompute.py``), as the plain units did."""
        self.group = TPGroup(comm, sequence_parallel)
        self.recompute = recompute
        self.comm = comm
        self.transformer = isinstance(model[0], tp_gpt.Embedding)
        if sequence_parallel and not self.transformer:
            raise UsageError("--sequence-parallel splits a transformer's sequence; the CNNs have none: drop it")
        self.units = len(model)
        self.roles = None if self.transformer else tp_vgg.conv_roles(model)
        self.built: dict[int, nn.Module] = {}  # the units shard() replaced by a new module, by index
        # where every split tensor's slices go, for the whole model (any rank may be asked for all of it)
        self.layout: dict[str, int] = {}
        for i, unit in self.shard(dict(enumerate(model))).items():
            for path, module in unit.named_modules():
                for key, dim in getattr(module, "split", {}).items():
                    self.layout[f"{i}.{path}.{key}" if path else f"{i}.{key}"] = dim
        self.built = {}  # not that throwaway model's: the strategy's own shard() fills it

    # ------------------------------------------------------------ what strategies ask (ctx.tp)
    def shard(self, units: dict[int, nn.Module]) -> dict[int, nn.Module]:
        """Each unit (keyed by its index in the whole model) replaced by this rank's sharded twin."""
        if self.transformer:
            twins = {i: tp_gpt.shard_unit(self.group, u) for i, u in units.items()}
        else:
            twins = {i: tp_vgg.shard_unit(self.group, i, u, self.roles) for i, u in units.items()}
        self.built.update({i: t for i, t in twins.items() if t is not units[i]})
        return recompute.apply(twins, self.recompute)

    def vocabulary_shares(self) -> list[tuple[int, int]]:
        """The first and last token id of the vocabulary share each embedding shard() built holds (tp rank r of
        T: ids r V / T .. (r + 1) V / T - 1); none for a CNN, or a pipeline stage without the embedding."""
        return [(e.start, e.start + e.local_vocab - 1) for e in self.built.values()
                if isinstance(e, tp_gpt.TPEmbedding)]

    def modules(self) -> nn.ModuleDict:
        """The modules shard() built in a unit's place (the gpt's embedding and head), named by the unit's index as
        the whole model names it: what the first divergence hooks beside the models' own."""
        return nn.ModuleDict({str(i): t for i, t in sorted(self.built.items())})

    def activation_shape(self, index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample shape entering unit ``index`` (``len(model)``: the output) once sharded."""
        if self.transformer:
            return tp_gpt.activation_shape(self.group, index, self.units, tuple(shape))
        return tp_vgg.activation_shape(self.group, index, self.roles, tuple(shape))

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The gpt's logits are this rank's vocabulary columns: the vocabulary-parallel loss.
        The CNN's classifier is replicated: the ordinary one."""
        if self.transformer:
            return vocab_parallel_cross_entropy(logits, target, self.group.rank * logits.shape[-1], self.comm)
        return cross_entropy(logits, target)

    # ------------------------------------------------------------ putting slices back together
    def gather(self, t: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """Every rank's slice along ``dim``, concatenated in rank order (a collective over tp)."""
        moved = t.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * self.comm.world,) + tuple(moved.shape[1:]))
        self.comm.all_gather_into(out, moved, name=name)
        return out.movedim(0, dim)

    def unshard(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain-keyed slices -> the whole tensors (same keys, every tp rank the same call order)."""
        whole = dict(state)
        for key in sorted(k for k in state if k in self.layout):
            whole[key] = self.gather(state[key], self.layout[key], "tp_gather_weights").cpu()
        return whole


def tp_of(strategy) -> TensorParallelism | None:
    """A strategy's tp dimension: composed (``ctx.tp``) or pure (``tp``'s own); None without one."""
    tp = getattr(strategy.ctx, "tp", None) or getattr(strategy, "tp", None)
    return tp if isinstance(tp, TensorParallelism) else None


class TensorParallel(Strategy):
    name = "tp"
    options = (TensorOptions,)
    moe = True
    clips = True  # the inner strategy (a flavour or a pipeline) clips, over the sharded units
    data_parallel = False  # the pure form: every rank sees the whole batch

    def __init__(self, ctx, model_fn, optim_fn, inner_cls=None, inner_kwargs=None):
        super().__init__(ctx, model_fn, optim_fn)
        self.tp = TensorParallelism(ctx.mesh.comm("tp"), ctx.options.sequence_parallel, model_fn(),
                                    ctx.options.recompute)
        if inner_cls is None:  # pure tp: one data-parallel replica, or a pipeline of tp stages
            from ..pipeline import Pipeline
            inner_cls = Pipeline if ctx.mesh.size("pp") > 1 else DataParallel
        self.inner_cls = inner_cls
        self.inner = inner_cls(dataclasses.replace(ctx, tp=self.tp), model_fn, optim_fn, **(inner_kwargs or {}))
        # what the reference replays and the records read: the inner strategy's
        self.microbatches, self.bn_rule = self.inner.microbatches, self.inner.bn_rule
        self.equal_microbatches = self.inner.equal_microbatches
        self.replicated = True  # full_state_dict is gathered whole on every rank: all must agree

    # ------------------------------------------------------------ declarations
    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        tp = world // cfg.pp if world % cfg.pp == 0 else 0
        if cfg.tp not in (1, tp) or tp == 0:
            raise UsageError(f"strategy 'tp' is pure tensor parallelism over the workers left by --pp (here "
                             f"{world} / {cfg.pp}); for data x tensor parallelism name the data-parallel flavour, "
                             f"e.g. 'paralab train ddp --workers {world} --tp {cfg.tp}'")
        return MeshShape.for_world(world, pp=cfg.pp, tp=tp)

    @classmethod
    def tp_size(cls, cfg, world: int) -> int:
        """The tensor-parallel size of a run: pure ``tp`` takes the workers ``--pp`` leaves, a composed
        layout its ``--tp``."""
        return world // cfg.pp if cfg.strategy == cls.name else cfg.tp

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        """Checks for any run with tp > 1, pure or composed."""
        from ...models import MODALITY
        from .. import get_strategy
        from ..pipeline import Pipeline
        shape = MeshShape.for_world(world, pp=cfg.pp, tp=cls.tp_size(cfg, world))
        if shape.pp > 1 and not issubclass(get_strategy(cfg.strategy), Pipeline):  # else validated already
            Pipeline.validate(cfg, world)
        if MODALITY[cfg.model] == "text":
            if cfg.heads % shape.tp:
                raise UsageError(f"--heads {cfg.heads} must be divisible by tp {shape.tp}: tensor parallelism gives "
                                 "each rank whole attention heads")
            if cfg.sequence_parallel and cfg.context % shape.tp:
                raise UsageError(f"--sequence-parallel: --context {cfg.context} must be divisible by tp {shape.tp} "
                                 "(each rank holds context / tp tokens)")
        elif cfg.sequence_parallel:
            raise UsageError("--sequence-parallel splits a transformer's sequence; the CNNs have none: drop it")

    @classmethod
    def check_limit(cls, cfg) -> str | None:
        from ...models import DEFAULT_NORM, MODALITY
        norm = cfg.norm or DEFAULT_NORM[cfg.model]
        if cls.tp_size(cfg, cfg.world) > 1 and MODALITY[cfg.model] == "image" and norm == "batch" and cfg.precision == "fp32":
            return ("a row-parallel convolution sums its input channels in tp partial sums, so its outputs "
                    "round differently from one process's, and BatchNorm over small feature maps (a narrow "
                    "VGG's 2x2) amplifies that past fp32's check within a few steps, by how much depends on "
                    "the CPU's kernels (in fp64 the same run matches to 1e-14): check it with --precision fp64 "
                    "or --norm none (or the gpt, --model gpt, which fp32 can check)")
        return None

    # ------------------------------------------------------------ the contract: the inner strategy's
    def replicas(self):
        return self.inner.replicas()

    def train_step(self, x, y):
        return self.inner.train_step(x, y)

    @torch.no_grad()
    def predict(self, x):
        """For evaluation and --check only: the last stage gathers the gpt's vocabulary columns into
        whole logits (training never does)."""
        local = self.inner.predict(x)
        if local is None or not self.tp.transformer:
            return local
        return self.tp.gather(local, local.dim() - 1, "tp_gather_logits")

    def full_state_dict(self):
        return self.tp.unshard(self.inner.full_state_dict())

    def state_dict(self):
        inner = type(self.inner)
        return {"tp": {"rank": self.tp.group.rank, "size": self.tp.group.size, "layout": self.tp.layout,
                       "inner": f"{inner.__module__}:{inner.__qualname__}"},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])

    @classmethod
    def consolidate(cls, states, model):
        """Offline: each tp rank's inner checkpoints put together as the inner strategy does, then the
        slices concatenated along their split dimension, in tp rank order."""
        meta = states[0]["tp"]
        module, name = meta["inner"].split(":")
        inner_cls = getattr(importlib.import_module(module), name)
        parts = [inner_cls.consolidate([s["inner"] for s in states if s["tp"]["rank"] == r],
                                       cls._sharded_twin(model, r, meta["size"]))
                 for r in range(meta["size"])]
        return {k: torch.cat([p[k] for p in parts], meta["layout"][k]) if k in meta["layout"] else v
                for k, v in parts[0].items()}

    @classmethod
    def portable(cls, states, model):
        """Offline: each tp rank's inner states made portable as the inner strategy does, on that
        rank's sharded twin of the model (built here, no process group); then every split tensor and
        its per-element optimizer state concatenated along the split dimension in tp rank order."""
        meta = states[0]["tp"]
        module, name = meta["inner"].split(":")
        inner_cls = getattr(importlib.import_module(module), name)
        parts = []
        for r in range(meta["size"]):
            parts.append(inner_cls.portable([s["inner"] for s in states if s["tp"]["rank"] == r],
                                            cls._sharded_twin(model, r, meta["size"])))
        layout = meta["layout"]
        tensors = {k: torch.cat([p.tensors[k] for p in parts], layout[k]) if k in layout else v
                   for k, v in parts[0].tensors.items()}
        optimizer = {}
        for k, first in parts[0].optimizer.items():
            optimizer[k] = {key: torch.cat([p.optimizer[k][key] for p in parts], layout[k])
                            if k in layout and torch.is_tensor(v) and v.dim() > 0 else v
                            for key, v in first.items()}
        return Portable(tensors, optimizer, parts[0].notes)

    @staticmethod
    def _sharded_twin(model, rank: int, size: int) -> nn.Sequential:
        """Offline (no process group): tp rank ``rank``'s sharded twin of ``model``, what its inner strategy
        held (an inner strategy that flattens its units, fsdp, needs their sliced shapes)."""
        tp = TensorParallelism(SimpleNamespace(rank=rank, world=size), False, copy.deepcopy(model))
        return nn.Sequential(*tp.shard(dict(enumerate(copy.deepcopy(model)))).values())

    def load_portable(self, portable):
        """This tp rank's slice of every split tensor and of its per-element optimizer state."""
        layout, rank, size = self.tp.layout, self.tp.group.rank, self.tp.group.size
        tensors = {k: tp_chunk(v, layout[k], rank, size) if k in layout else v for k, v in portable.tensors.items()}
        optimizer = {k: {key: tp_chunk(v, layout[k], rank, size)
                         if k in layout and torch.is_tensor(v) and v.dim() > 0 else v for key, v in st.items()}
                     for k, st in portable.optimizer.items()}
        self.inner.load_portable(Portable(tensors, optimizer, portable.notes))

    def unexercised(self):
        return self.inner.unexercised()

    def extra_summary(self):
        return {**self.inner.extra_summary(),
                "tensor_parallel": {"size": self.tp.group.size, "rank": self.tp.group.rank,
                                    "sequence_parallel": self.tp.group.sequence_parallel,
                                    "split_tensors": len(self.tp.layout)}}
