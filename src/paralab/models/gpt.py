"""A small decoder-only transformer (GPT), flat like every paralab model.

Units, in order (``nn.Sequential``)::

    Embedding   token embedding + learned position embedding   [B, T] ints -> [B, T, D]
    Block x L   x + attention(LayerNorm(x)); x + MLP(LayerNorm(x))
    Head        final LayerNorm, then the output projection       [B, T, D] -> [B, T, V]

A block is one unit, so pipeline stages and FSDP units cut between blocks,
exactly as they cut between a VGG's conv blocks. Attention is causal and
multi-head, with separate query, key and value projections (a fused QKV
matrix would interleave heads inside one weight; separate ones make the
head split of tensor parallelism a plain slice of each). The MLP is
``Linear(D, 4D) -> GELU -> Linear(4D, D)``. ``--dropout P`` (default 0, as
CS1390 trains) drops each block's two residual branches, attention's output
and the MLP's, before they are added (GPT-2's residual dropout; no dropout on
the embedding or on the attention probabilities), with masks every layout
draws alike (``dropout.py``). No weight tying between the embedding and the
output projection (they live on the first and last pipeline stages).

Initialisation follows GPT-2: every weight normal(0, 0.02), biases zero,
the projections that write into the residual stream scaled by
``1 / sqrt(2 L)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..options import option
from . import documents
from .dropout import Dropout, enter_unit
from .moe import MoE

VOCAB = 256  # byte-level tokens: every text is its UTF-8 bytes


@dataclass
class GPTOptions:
    """model shape (--model gpt): a decoder-only transformer over byte tokens"""
    layers: int = option(4, "transformer blocks", minimum=1, identity=True)
    heads: int = option(4, "attention heads per block (tensor parallelism splits them)", minimum=1,
                        identity=True)
    embed: int = option(128, "model width: embedding size, divisible by --heads", minimum=1, identity=True)
    context: int = option(64, "tokens per sample (the context length)", minimum=1, identity=True)
    dropout: float = option(0.0, "probability of dropping each block's attention and MLP outputs (residual "
                                 "dropout; masks drawn alike by every layout: --check stays exact)", minimum=0,
                            maximum=0.99, identity=True)


class Embedding(nn.Module):
    #: the global position of each token this module is given (context parallelism: a rank's chunks); None: 0..T-1
    position_ids: torch.Tensor | None = None

    def __init__(self, vocab: int, embed: int, context: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, embed)
        self.positions = nn.Embedding(context, embed)

    def example_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random token ids ``[batch, context]``: what partitioning and shape inference feed the model."""
        return torch.randint(0, self.tokens.num_embeddings, (batch, self.positions.num_embeddings),
                             generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        where = torch.arange(t) if self.position_ids is None else self.position_ids
        return self.tokens(idx) + self.positions(where.to(idx.device))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, heads, T, d]`` queries, keys, values -> causal attention's output, same shape (with packed
    documents, each token attends within its own document only: ``documents.py``)."""
    return documents.attention(q, k, v)


class Attention(nn.Module):
    """Causal multi-head self-attention; ``heads`` heads of ``embed / heads`` features each."""
    #: the attention itself, which :meth:`core` calls (context parallelism puts its ring or all-to-all
    #: here, per instance: strategies/context/)
    attend = staticmethod(causal_attention)

    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(embed, embed) for _ in range(3))
        self.proj = nn.Linear(embed, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def split(h):  # [B, T, heads * d] -> [B, heads, T, d]
            return h.view(b, t, self.heads, -1).transpose(1, 2)

        out = self.core(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core (QK^T, softmax, times V): what ``--recompute selective`` recomputes."""
        return self.attend(q, k, v)


class MLP(nn.Module):
    def __init__(self, embed: int):
        super().__init__()
        self.fc = nn.Linear(embed, 4 * embed)
        self.proj = nn.Linear(4 * embed, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    #: the block's unit index in the whole model (its dropout masks are drawn from it: dropout.py)
    index = 0

    def __init__(self, embed: int, heads: int, moe: dict | None = None, dropout: float = 0.0, context: int = 0):
        """``moe``: MoE's arguments (a mixture of experts in place of the MLP, ``moe.py``), or None;
        ``dropout``: the residual branches' dropout probability (``context``: the model's tokens per sample)."""
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(embed), Attention(embed, heads)
        self.ln2, self.mlp = nn.LayerNorm(embed), (MoE(embed, **moe) if moe else MLP(embed))
        self.drop = Dropout(dropout, context)

    def __call__(self, *args, **kwargs):
        if self.training and self.drop.p:  # seed the generator for this block and step, before its forward
            enter_unit(self.index)          # (outside it: a recomputed forward must restore the state itself)
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, embed: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(embed)
        self.out = nn.Linear(embed, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def init_weights(model: nn.Sequential, layers: int) -> None:
    """GPT-2's initialisation (see the module docstring)."""
    for name, p in model.named_parameters():
        if p.dim() == 1:  # biases to zero; LayerNorm weights keep their ones
            if name.endswith("bias"):
                nn.init.zeros_(p)
            continue
        std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
        nn.init.normal_(p, 0.0, std)


def parameter_counts(layers: int, embed: int, context: int, vocab: int = VOCAB) -> dict[str, int]:
    """The gpt's parameters by part, counted from its shape without building it (the tests hold this to
    ``count_parameters(gpt(...))``): the token and position tables, the blocks (four ``D x D``
    attention projections and the ``D x 4D``, ``4D x D`` MLP, with biases, and two LayerNorms:
    ``12 D^2 + 13 D`` each), and the head (a LayerNorm and the untied ``D x V`` output projection).
    The heads split the width without adding parameters."""
    blocks = layers * (12 * embed * embed + 13 * embed)
    counts = {"tokens": vocab * embed, "positions": context * embed, "blocks": blocks,
              "head": 2 * embed + embed * vocab}
    counts["total"] = sum(counts.values())
    return counts


def moe_parameter_counts(layers: int, embed: int, experts: int, top_k: int, expert_hidden: int) -> dict[str, int]:
    """What a mixture of experts changes in :func:`parameter_counts`: per block the MLP (``8 D^2 + 5 D``) is
    replaced by a router (``D E``) and ``E`` experts of ``2 D H + H + D`` each, of which a token uses
    ``K``: ``expert_total`` and ``expert_active`` over all blocks, and ``router``."""
    hidden = expert_hidden or 4 * embed
    one = 2 * embed * hidden + hidden + embed
    return {"dense_mlp": layers * (8 * embed * embed + 5 * embed), "router": layers * embed * experts,
            "expert_total": layers * experts * one, "expert_active": layers * top_k * one}


def gpt(layers: int = 4, heads: int = 4, embed: int = 128, context: int = 64, vocab: int = VOCAB, *,
        experts: int = 0, top_k: int = 1, expert_hidden: int = 0, capacity_factor: float | None = None,
        aux_loss_coef: float = 0.01, router_skew: float = 0.0, gating: str = "softmax",
        dropout: float = 0.0) -> nn.Sequential:
    """The gpt; with ``experts > 0`` every block's MLP is a mixture of experts (``moe.py``); ``dropout``: the
    blocks' residual dropout."""
    if embed % heads:
        raise ValueError(f"--embed {embed} must be divisible by --heads {heads}")
    if experts and top_k > experts:
        raise ValueError(f"--top-k {top_k} must be at most --experts {experts}")
    moe = dict(experts=experts, top_k=top_k, hidden=expert_hidden or 4 * embed, capacity_factor=capacity_factor,
               aux_loss_coef=aux_loss_coef, router_skew=router_skew, gating=gating) if experts else None
    model = nn.Sequential(Embedding(vocab, embed, context),
                          *(Block(embed, heads, moe, dropout, context) for _ in range(layers)), Head(embed, vocab))
    init_weights(model, layers)
    for i, block in enumerate(model[1:-1]):
        block.index = i + 1
        if moe:
            block.mlp.layer = i  # the MoE layer's block index, in its routing records (moe.py)
    return model
