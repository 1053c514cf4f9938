"""``torch-tp``: PyTorch's DTensor tensor parallelism (``parallelize_module``), the comparison for ``tp``.

The gpt (``paralab.models.gpt``) is laid out as our ``tp`` lays it out
(Megatron's layout, ``strategies/tensor/gpt.py``), but by PyTorch: each
rank builds the whole model from the seed, then ``parallelize_module``
turns the split weights into ``DTensor`` shards over a ``DeviceMesh`` made
from the tp group (``DeviceMesh.from_group``), with one ``ParallelStyle``
per submodule::

    0.tokens            RowwiseParallel     vocabulary split; partial rows summed (all-reduce)
    i.attn, i.mlp       PrepareModuleInput  the block's input made Replicate once: one all-reduce of its
                                            gradient in backward for q, k and v together (f)
    i.attn.q / k / v    ColwiseParallel     heads / tp heads on each rank
    i.attn.proj         RowwiseParallel     partial sums all-reduced (g)
    i.mlp.fc            ColwiseParallel
    i.mlp.proj          RowwiseParallel
    L+1.out             ColwiseParallel     vocabulary columns, kept a DTensor sharded on the last dim

Each block's attention gets ``heads = heads / tp`` (its ``view(b, t,
self.heads, -1)`` then sees the local heads). The loss is ``F.cross_entropy``
inside ``loss_parallel()`` on the vocabulary-sharded logits.
``--sequence-parallel``: LayerNorms become ``SequenceParallel``, the
attention / MLP inputs are all-gathered from sequence shards
(``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate``), the row-parallel
outputs reduce-scattered onto them (``output_layouts Shard(1)``), the head
all-gathers; the embedding's output is cut to this rank's sequence shard
(``PrepareModuleOutput``: ``Replicate`` -> ``Shard(1)``).

DTensor's collectives are not ``comm`` spans (``collectives_timed``: false);
what this file gathers itself (``full_state_dict``, the logits for
evaluation) goes through ``comm.py``. Pure tp on the gpt only (exit 2 else).

Why, and how it compares with our tp: docs/tensor-parallel.md#torch-tp-pytorchs
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from ..errors import UsageError
from ..mesh import MeshShape
from .base import StepResult, Strategy
from .dtensor_state import (held_gradients, load_local_state, local, local_from_portable, local_state,
                            portable_from_local)
from .tensor.gpt import sequence_shard
from .tensor.strategy import TensorOptions


def tp_plan(model: nn.Sequential, sequence_parallel: bool) -> dict:
    """The ``parallelize_module`` plan for the gpt's units: submodule path -> ParallelStyle."""
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between regions
    plan = {"0.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if sequence_parallel:  # the whole embedding (tokens + positions) cut to this rank's sequence shard
        plan["0"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    head = len(model) - 1
    for i in range(1, head):
        if sequence_parallel:
            plan[f"{i}.ln1"], plan[f"{i}.ln2"] = SequenceParallel(), SequenceParallel()
        for region, column, row in (("attn", ("q", "k", "v"), "proj"), ("mlp", ("fc",), "proj")):
            plan[f"{i}.{region}"] = PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate())
            for name in column:
                plan[f"{i}.{region}.{name}"] = ColwiseParallel()
            plan[f"{i}.{region}.{row}"] = RowwiseParallel(output_layouts=between)
    if sequence_parallel:
        plan[f"{head}.ln"] = SequenceParallel()
    plan[f"{head}.out"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    return plan


def _shard_dim(t) -> int | None:
    """The dimension a DTensor is split along on the (one-dimensional) tp mesh; None if it is whole."""
    if isinstance(t, DTensor):
        placement = t.placements[0]
        if isinstance(placement, Shard):
            return placement.dim % t.dim()
    return None


class TorchTP(Strategy):
    name = "torch-tp"
    data_parallel = False  # every tp rank sees the whole batch
    options = (TensorOptions,)
    clips = True

    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        if cfg.pp > 1 or cfg.tp not in (1, world):
            raise UsageError(f"strategy 'torch-tp' is pure tensor parallelism over all {world} workers (tp = "
                             f"workers); composing PyTorch's DTensor layout with --pp / data parallelism is not "
                             f"built here: drop --pp/--tp, or use our tp, which composes (e.g. 'paralab train tp "
                             f"--workers {world} --pp {max(cfg.pp, 2)}', 'paralab train ddp --workers {world} --tp 2')")
        return MeshShape.for_world(world, tp=world)

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        from ..models import MODALITY
        from ..models.gpt import VOCAB
        if MODALITY[cfg.model] != "text":
            raise UsageError(f"torch-tp lays out the gpt (--model gpt) only: DTensor's styles split linear and "
                             f"embedding layers; for tensor parallelism of {cfg.model} use our channel split, "
                             f"'paralab train tp --model {cfg.model}'")
        if cfg.heads % world:
            raise UsageError(f"--heads {cfg.heads} must be divisible by tp {world}: tensor parallelism gives each "
                             "rank whole attention heads")
        if VOCAB % world:
            raise UsageError(f"torch-tp: the vocabulary ({VOCAB} bytes) must divide over tp {world}: use a power "
                             "of two workers")
        if cfg.sequence_parallel and cfg.context % world:
            raise UsageError(f"--sequence-parallel: --context {cfg.context} must be divisible by tp {world} "
                             "(each rank holds context / tp tokens)")

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.tp = ctx.mesh.comm("tp") if ctx.mesh is not None else ctx.comm
        self.sequence_parallel = ctx.options.sequence_parallel
        group = self.tp.group if self.tp.group is not None else dist.group.WORLD
        self.device_mesh = DeviceMesh.from_group(group, ctx.device.type)
        self.model = model_fn().to(ctx.device)
        parallelize_module(self.model, self.device_mesh, tp_plan(self.model, self.sequence_parallel))
        for unit in list(self.model)[1:-1]:  # this rank's heads (q, k, v are column-split)
            unit.attn.heads //= self.tp.world
            if self.sequence_parallel:  # the residual stream is this rank's sequence shard (its dropout's)
                unit.drop.position_ids = sequence_shard(self.tp.rank, self.tp.world, unit.drop.context)
        self.layout = {k: d for k, v in self.model.state_dict().items() if (d := _shard_dim(v)) is not None}
        self.params = list(self.model.parameters())
        # the LayerNorms and the position table are not in the plan, so they stay plain tensors beside the
        # DTensors; the optimizers' multi-tensor ("foreach") kernels, torch's default on CUDA, refuse a
        # list that mixes the two kinds, so this optimizer updates tensor by tensor (the default on CPU;
        # the same arithmetic)
        self.optimizer = optim_fn(self.params, foreach=False)

    # ------------------------------------------------------------ gathering through comm.py
    def _gather(self, t: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """Every tp rank's slice along ``dim``, concatenated in rank order."""
        moved = t.detach().movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * self.tp.world,) + tuple(moved.shape[1:]))
        self.tp.all_gather_into(out, moved, name=name)
        return out.movedim(0, dim)

    # ------------------------------------------------------------ contract
    def train_step(self, x, y) -> StepResult:
        self.model.train()
        loss = self.forward_backward(self.model, x, y, last=loss_parallel)  # forward and backward inside it
        self.clip_gradients()
        with self.rec.span("optimizer", "step"):
            self.ctx.update(self.optimizer)
        return StepResult(loss, len(y))

    def held_gradients(self):
        """The DTensors' local slices (a replicated one counted once per tp rank) and the plain parameters'
        gradients the plan leaves whole on every tp rank."""
        return held_gradients(self.params, self.tp.world)  # tp is the whole world (mesh_shape)

    @torch.no_grad()
    def predict(self, x):
        """Whole logits (evaluation and --check only): the vocabulary columns gathered."""
        logits = self.eval_logits(self.model, x)
        return self._gather(local(logits), logits.dim() - 1, "torch_tp_gather_logits")

    @torch.no_grad()
    def full_state_dict(self):
        return {k: (self._gather(local(v), self.layout[k], "torch_tp_gather_weights") if k in self.layout
                    else local(v).detach()).clone()
                for k, v in self.model.state_dict().items()}

    def state_dict(self):
        return {"tp": {"rank": self.tp.rank, "size": self.tp.world, "layout": self.layout},
                **local_state(self.model, self.optimizer)}

    def load_state_dict(self, state):
        if state["tp"]["size"] != self.tp.world:
            raise ValueError(f"checkpoint is from tp {state['tp']['size']}; this run has tp {self.tp.world}")
        load_local_state(self.model, self.optimizer, self.params, state)
        for group in self.optimizer.param_groups:  # a loaded group brings its saved settings: keep ours
            group["foreach"] = False

    @classmethod
    def consolidate(cls, states, model):
        """Offline: each split tensor's slices concatenated along its split dimension in tp rank order;
        the replicated ones (equal on every rank) from rank 0."""
        meta = states[0]["tp"]
        if len(states) != meta["size"]:
            raise ValueError(f"torch-tp: {len(states)} rank state(s) for a run on tp {meta['size']}")
        ordered = sorted(states, key=lambda s: s["tp"]["rank"])
        return {k: torch.cat([s["model"][k] for s in ordered], meta["layout"][k]) if k in meta["layout"] else v
                for k, v in ordered[0]["model"].items()}

    @classmethod
    def portable(cls, states, model):
        """Split tensors and their optimizer state concatenated along their dimension in tp rank order."""
        layout = states[0]["tp"]["layout"]
        ordered = sorted(states, key=lambda s: s["tp"]["rank"])
        return portable_from_local(ordered, [n for n, _ in model.named_parameters()], layout.get)

    def load_portable(self, portable):
        self.load_state_dict({"tp": {"rank": self.tp.rank, "size": self.tp.world, "layout": self.layout},
                              **local_from_portable(portable, self.model, self.optimizer, self.layout.get,
                                                    self.tp.rank, self.tp.world)})

    def extra_summary(self):
        return {"tensor_parallel": {"size": self.tp.world, "rank": self.tp.rank,
                                    "sequence_parallel": self.sequence_parallel, "split_tensors": len(self.layout),
                                    "local_parameters": sum(local(p).numel() for p in self.params),
                                    "parameters": sum(p.numel() for p in self.params),
                                    "implementation": "torch.distributed.tensor.parallel (DTensor)"},
                "collectives_timed": False}
