"""Ulysses (Jacobs et al. 2023): all-to-all from sequence shards to head shards and back.

Before attention each rank holds all ``H`` heads of its ``T / C`` tokens.
One all-to-all each for q, k and v gives it ``H / C`` heads of all ``T``
tokens; it runs ordinary causal attention on them (no ring, no merge), and a
fourth all-to-all gives the output back as all heads of its own tokens. Each
all-to-all's backward is the reverse all-to-all, so an attention layer costs
four all-to-alls forward and four backward, each moving ``B H t d`` numbers
per rank (``t = T / C``; ``(C-1)/C`` of them leave the rank). Needs the
(local) heads divisible by C.

The gathered sequence comes in rank order (each rank's chunks, ``layout.py``),
so it is put in position order before the causal attention and back after
(packed documents: the whole sequence's document-causal mask, ``models/documents.py``);
load balancing does not matter here (every rank computes whole causal
attention for its heads), but the model's layout is shared with the ring.
"""
from __future__ import annotations

import torch

from ...models import documents
from .layout import Layout


def _seq_to_heads(x: torch.Tensor, comm, name: str) -> torch.Tensor:
    """``[B, H, t, d]`` (all heads, this rank's tokens) -> ``[B, H/C, C t, d]`` (its heads, every rank's
    tokens in rank order)."""
    b, h, t, d = x.shape
    c = comm.world
    send = x.reshape(b, c, h // c, t, d).transpose(0, 1).contiguous()  # [C (to rank), B, H/C, t, d]
    recv = torch.empty_like(send)                                        # [C (from rank), B, H/C, t, d]
    comm.all_to_all_single(recv, send, name=name)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)


def _heads_to_seq(x: torch.Tensor, comm, name: str) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    b, hc, ct, d = x.shape
    c = comm.world
    send = x.reshape(b, hc, c, ct // c, d).permute(2, 0, 1, 3, 4).contiguous()  # [C (to rank), B, H/C, t, d]
    recv = torch.empty_like(send)                                                # [C (from rank), ...]
    comm.all_to_all_single(recv, send, name=name)
    return recv.transpose(0, 1).reshape(b, hc * c, ct // c, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        return _seq_to_heads(x, comm, name)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.comm, f"{ctx.name}_backward"), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        return _heads_to_seq(x, comm, name)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.comm, f"{ctx.name}_backward"), None, None


def ulysses_attention(q, k, v, comm, layout: Layout, recorder) -> torch.Tensor:
    """``[B, H, t, d]`` queries, keys, values of this rank's tokens -> its attention output, same shape."""
    order = layout.inverse().to(q.device)      # rank order -> position order
    back = layout.order().to(q.device)         # position order -> rank order
    q, k, v = (SeqToHeads.apply(z, comm, f"cp_a2a_{n}").index_select(2, order) for z, n in zip((q, k, v), "qkv"))
    with recorder.span("compute", "attention"):
        out = documents.attention(q, k, v)  # causal; with packed documents, within each document
    return HeadsToSeq.apply(out.index_select(2, back).contiguous(), comm, "cp_a2a_out")
