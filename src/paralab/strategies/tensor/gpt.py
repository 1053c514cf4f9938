"""Megatron-style tensor parallelism for the gpt model (``paralab.models.gpt``).

Each unit of the plain model is replaced by a sharded twin that keeps only
this rank's slice of every split weight (the full model was built from the
seed first, on every rank, so the slices are the single process's weights).
Parameter names are the plain model's, so checkpoints and ``--check`` line up
once the slices are gathered (``split`` says along which dimension).

Per block, with ``tp`` ranks (Shoeybi et al. 2019, Figure 3)::

    x ─ LayerNorm ─ enter ─┬─ q, k, v: column-parallel, heads / tp heads here ─ attention ─ proj: row-parallel ─ leave ─ + bias ─ (+ x)
                           (f, or all-gather of sequence shards)                   (g, or reduce-scatter)
    x ─ LayerNorm ─ enter ─ fc: column-parallel (4D / tp) ─ GELU ─ proj: row-parallel ─ leave ─ + bias ─ (+ x)

so a block costs two all-reduces forward and two backward (``f`` and ``g``
of attention and MLP). The embedding is split along the vocabulary: each
rank looks up the tokens it holds, zero for the others, and ``leave`` sums
them. The head's output projection is column-parallel along the vocabulary:
each rank produces logits for ``V / tp`` tokens and the loss is
:func:`~.ops.vocab_parallel_cross_entropy`; no rank ever holds a whole row.

Under sequence parallelism, ``enter``/``leave`` become all-gather/reduce-scatter
along the sequence; everything between regions (LayerNorm, residual adds,
the position embedding, the row-parallel biases) runs on ``T / tp`` tokens,
and those replicated parameters are wrapped by ``TPGroup.replicated`` so
their partial gradients are summed over the group.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models.gpt import MLP, Attention, Block, Embedding, Head
from ...models.moe import MoE
from .group import TPGroup


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding the given (already sliced) weight and bias."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight)
    if bias is not None:
        layer.bias = nn.Parameter(bias)
    return layer


def column(tp: TPGroup, layer: nn.Linear) -> nn.Linear:
    """Column-parallel: this rank's rows of the weight (its output features) and of the bias."""
    return _linear(tp.shard(layer.weight, 0), tp.shard(layer.bias, 0) if layer.bias is not None else None)


def row(tp: TPGroup, layer: nn.Linear) -> nn.Linear:
    """Row-parallel: this rank's columns of the weight (its input features); the bias stays whole
    and is added once, after the partial sums are reduced."""
    return _linear(tp.shard(layer.weight, 1), layer.bias.detach().clone() if layer.bias is not None else None)


class TPLayerNorm(nn.LayerNorm):
    """LayerNorm whose (replicated) weight and bias go through ``TPGroup.replicated``."""

    def __init__(self, tp: TPGroup, plain: nn.LayerNorm):
        super().__init__(plain.normalized_shape, eps=plain.eps, dtype=plain.weight.dtype)
        self.load_state_dict(plain.state_dict())
        self.tp = tp

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.tp.replicated(self.weight),
                            self.tp.replicated(self.bias), self.eps)


class TPEmbedding(nn.Module):
    split = {"tokens.weight": 0}

    def __init__(self, tp: TPGroup, plain: Embedding):
        super().__init__()
        self.tp = tp
        vocab = plain.tokens.num_embeddings
        if vocab % tp.size:
            raise ValueError(f"the vocabulary ({vocab}) must divide over tp {tp.size}")
        self.local_vocab = vocab // tp.size
        self.start = tp.rank * self.local_vocab
        self.tokens = nn.Embedding(self.local_vocab, plain.tokens.embedding_dim)
        self.tokens.weight = nn.Parameter(tp.shard(plain.tokens.weight, 0))
        self.positions = plain.positions
        self.position_ids = plain.position_ids  # context parallelism's global positions, if set

    def forward(self, idx):
        local = idx - self.start
        mine = (local >= 0) & (local < self.local_vocab)
        # the table read directly, not through self.tokens(...): its rows are a partial sum before tp's, which no
        # single process computes (the first divergence compares every module called; row-parallel layers alike)
        rows = F.embedding(local.clamp(0, self.local_vocab - 1), self.tokens.weight)
        partial = rows * mine.unsqueeze(-1).to(self.tokens.weight.dtype)
        h = self.tp.leave(partial)  # the sum over ranks: each token's row came from exactly one
        t = h.shape[1]
        if self.position_ids is not None:  # context parallelism (sequence parallelism is refused with it)
            return h + self.tp.replicated(self.positions.weight)[self.position_ids.to(idx.device)]
        first = self.tp.rank * t if self.tp.sequence_parallel else 0  # this rank's positions
        return h + self.tp.replicated(self.positions.weight)[first:first + t]


class TPAttention(nn.Module):
    split = {"q.weight": 0, "q.bias": 0, "k.weight": 0, "k.bias": 0, "v.weight": 0, "v.bias": 0,
             "proj.weight": 1}
    core = Attention.core  # on this rank's heads (what --recompute selective recomputes)

    def __init__(self, tp: TPGroup, plain: Attention):
        super().__init__()
        if plain.heads % tp.size:
            raise ValueError(f"{plain.heads} heads do not divide over tp {tp.size}")
        self.tp, self.heads = tp, plain.heads // tp.size  # this rank's heads
        self.attend = plain.attend  # the attention itself (context parallelism's, if set)
        self.q, self.k, self.v = column(tp, plain.q), column(tp, plain.k), column(tp, plain.v)
        self.proj = row(tp, plain.proj)

    def forward(self, x):
        h = self.tp.enter(x)
        b, t, _ = h.shape

        def split(z):  # [B, T, local heads * d] -> [B, local heads, T, d]
            return z.view(b, t, self.heads, -1).transpose(1, 2)

        out = self.core(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        partial = F.linear(out.transpose(1, 2).reshape(b, t, -1), self.proj.weight)
        return self.tp.leave(partial) + self.tp.replicated(self.proj.bias)


class TPMLP(nn.Module):
    split = {"fc.weight": 0, "fc.bias": 0, "proj.weight": 1}

    def __init__(self, tp: TPGroup, plain: MLP):
        super().__init__()
        self.tp = tp
        self.fc, self.proj = column(tp, plain.fc), row(tp, plain.proj)

    def forward(self, x):
        partial = F.linear(F.gelu(self.fc(self.tp.enter(x))), self.proj.weight)
        return self.tp.leave(partial) + self.tp.replicated(self.proj.bias)


class TPHead(nn.Module):
    split = {"out.weight": 0}

    def __init__(self, tp: TPGroup, plain: Head):
        super().__init__()
        self.tp = tp
        self.ln = TPLayerNorm(tp, plain.ln)
        self.out = column(tp, plain.out)

    def forward(self, x):
        return self.out(self.tp.enter(self.ln(x)))  # [B, T, V / tp]: this rank's vocabulary columns


def shard_unit(tp: TPGroup, unit: nn.Module) -> nn.Module:
    """The sharded twin of one gpt unit (a block is sharded in place: its forward is unchanged)."""
    if isinstance(unit, Embedding):
        return TPEmbedding(tp, unit)
    if isinstance(unit, Head):
        return TPHead(tp, unit)
    if isinstance(unit, Block):
        unit.ln1, unit.ln2 = TPLayerNorm(tp, unit.ln1), TPLayerNorm(tp, unit.ln2)
        # a mixture of experts stays whole on every tp rank (models/moe.py): its input, the residual stream
        # after attention's all-reduce, is the same on each, so its gradients are too; no collective
        unit.attn = TPAttention(tp, unit.attn)
        unit.mlp = unit.mlp if isinstance(unit.mlp, MoE) else TPMLP(tp, unit.mlp)
        if tp.sequence_parallel:  # the residual stream holds this rank's sequence shard: its dropout's positions
            unit.drop.position_ids = sequence_shard(tp.rank, tp.size, unit.drop.context)
        return unit
    raise TypeError(f"no tensor-parallel form for {type(unit).__name__}")


def sequence_shard(rank: int, size: int, context: int) -> torch.Tensor:
    """The positions of sequence parallelism's shard ``rank`` of ``size`` (contiguous, ``context / size``)."""
    return torch.arange(rank * context // size, (rank + 1) * context // size)


def activation_shape(tp: TPGroup, index: int, units: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample shape entering unit ``index`` (``units``: the output) once sharded: sequence
    shards between the embedding and the head under sequence parallelism; the head's output holds
    ``V / tp`` logits."""
    if index == units:
        return shape[:-1] + (shape[-1] // tp.size,)
    if tp.sequence_parallel and index > 0:
        return (shape[0] // tp.size,) + shape[1:]
    return shape
