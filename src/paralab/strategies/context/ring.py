"""Ring attention: causal attention over a sequence split across the ``cp`` group.

Each rank holds the queries, keys and values of its own tokens
(``layout.py``: two chunks, or one). Attention of its queries over the whole
sequence is computed one source rank at a time: the keys and values travel
around the ring (rank ``r`` sends to ``r+1`` and receives from ``r-1``), so
after ``C-1`` rotations every rank has seen every other rank's K/V, one
block at a time, and never holds more than two blocks.

Each block gives a partial result: for query chunk ``a`` and key chunk ``b``
(global chunk indices) ``o_ab = softmax(q_a k_b^T / sqrt(d)) v_b`` and the
rows' log-sum-exp ``l_ab``. Partial results merge exactly: with
``l = log(e^l1 + e^l2)``, ``o = o1 e^(l1-l) + o2 e^(l2-l)``. Causality works
on chunks: ``b < a`` is a whole block, ``b == a`` the causal triangle,
``b > a`` is skipped (no work, no wasted time). With the balanced layout
every rank has the same number of whole blocks, which is the point.

Backward (:class:`RingAttention`, a custom autograd function, Liu et al.
2023's scheme): the saved final log-sum-exp gives each block's
probabilities again, ``p = exp(s - l)``; ``dq`` stays home, ``dk``/``dv`` of
a source's block are accumulated in a buffer that travels with its K/V.
K/V go around ``C-1`` times again; the dK/dV buffer ``C`` times (the last
hop brings each one home). Every message is one packed tensor (K and V, or
dK and dV): per attention layer, forward ``C-1`` sends of ``2 B H t d``
numbers per rank, backward ``C-1`` of K/V and ``C`` of dK/dV, the same
size (``t = T / C``; ``paralab calc`` predicts them). The next message is
in flight while the current block is computed.

Packed documents (``--packing``): a block's mask is also "same document"
(``models/documents.py``, from the global positions of its query and key
chunks), and a block is computed only for the rows (samples) in which some
query may see some key: a document boundary between two chunks saves that
row's block, so the work done is the blocks the documents need
(``balance.py`` deals the chunks by it). A query with nothing to see in a
block adds nothing to the merge.
"""
from __future__ import annotations

import math

import torch

from ...models import documents
from .layout import Layout

NEG_INF = float("-inf")


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``q k^T / sqrt(d)`` of one query chunk and one key chunk; the upper triangle masked when causal, or
    what ``mask`` (packed documents: same document and not later) does not allow."""
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        return s.masked_fill(~mask, NEG_INF)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), NEG_INF)
    return s


def _pairs(layout: Layout, rank: int, source: int, q: torch.Tensor):
    """(local query slice, source key slice, causal, mask, rows) for every block rank ``rank`` computes with
    ``source``'s keys: key chunk before the query chunk, or the same chunk (causal). With packed documents,
    the block's mask and the rows that need it (an index; None: all), the mask on those rows only; a block
    no row needs is not computed."""
    c = layout.chunk
    q_pos, k_pos = layout.positions(rank), layout.positions(source)
    for i, a in enumerate(layout.chunks_of(rank)):
        for j, b in enumerate(layout.chunks_of(source)):
            if b <= a:
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                mask = documents.allowed(q.shape[0], q_pos[qs], k_pos[ks], q.device)
                rows = None
                if mask is not None:
                    needed = mask.flatten(1).any(1)
                    if not bool(needed.any()):
                        continue
                    if not bool(needed.all()):
                        rows = needed.nonzero().squeeze(1)
                        mask = mask.index_select(0, rows)
                yield qs, ks, b == a, mask, rows


def _at(rows, seq: slice) -> tuple:
    """The index of a block's rows (all when None) and its sequence slice in a ``[B, H, t(, d)]`` tensor."""
    return (slice(None) if rows is None else rows, slice(None), seq)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that saw no key yet (``-inf``) at 0, so ``exp(s - lse)`` gives them 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a block's arithmetic runs in: float32 for 16-bit inputs, else their own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _rotate(comm, t: torch.Tensor, name: str):
    """Send ``t`` to the next rank, receive the previous rank's into a new buffer: (buffer, pending ops)."""
    buf = torch.empty_like(t)
    nxt, prev = (comm.rank + 1) % comm.world, (comm.rank - 1) % comm.world
    return buf, [comm.isend(t, nxt, name=name), comm.irecv(buf, prev, name=name)]


def _finish(ops) -> None:
    for op in ops:
        op.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys and values (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, layout: Layout, recorder):
        rank, world = comm.rank, comm.world
        # the blocks' scores, the running output and its log-sum-exp in float32 under bf16 autocast, as a flash
        # attention kernel keeps them (one process's attention does); K and V travel in their own dtype
        wide = _wide(q.dtype)
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=wide, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        blocks = {}  # source -> the blocks computed with its keys (and their masks): what backward walks again
        for step in range(world):
            source = (rank - step) % world
            ops = []
            if step < world - 1:  # the next block on its way while this one is computed
                nxt, ops = _rotate(comm, kv, "cp_ring_kv")
            with recorder.span("compute", "attention", cp_source=source), \
                    torch.autocast(q.device.type, enabled=False):
                blocks[source] = list(_pairs(layout, rank, source, q))
                for qs, ks, causal, mask, rows in blocks[source]:
                    qi, ki = _at(rows, qs), _at(rows, ks)
                    s = _scores(q[qi].to(wide), kv[0][ki].to(wide), causal, mask)
                    l_blk = torch.logsumexp(s, dim=-1)
                    o_blk = torch.exp(s - _finite(l_blk).unsqueeze(-1)) @ kv[1][ki].to(wide)
                    l_old = lse[qi]
                    l_new = torch.logaddexp(l_old, l_blk)
                    base = _finite(l_new)
                    out[qi] = (out[qi] * torch.exp(l_old - base).unsqueeze(-1)
                               + o_blk * torch.exp(l_blk - base).unsqueeze(-1))
                    lse[qi] = l_new
            if ops:
                _finish(ops)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.recorder, ctx.blocks = comm, recorder, blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, recorder = ctx.comm, ctx.recorder
        rank, world = comm.rank, comm.world
        scale = 1.0 / math.sqrt(q.shape[-1])
        wide = out.dtype  # float32 under bf16 autocast (forward), else the inputs' dtype
        grad_out = grad_out.to(wide).contiguous()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O): the softmax's backward term
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=wide, device=kv.device)  # the source's dK, dV, travelling with its K, V
        for step in range(world):
            source = (rank - step) % world
            kv_ops = []
            if step < world - 1:
                kv_next, kv_ops = _rotate(comm, kv, "cp_ring_kv_backward")
            with recorder.span("compute", "attention_backward", cp_source=source):
                for qs, ks, causal, mask, rows in ctx.blocks[source]:
                    qi, ki = _at(rows, qs), _at(rows, ks)
                    qb, kb, vb, do = q[qi].to(wide), kv[0][ki].to(wide), kv[1][ki].to(wide), grad_out[qi]
                    p = torch.exp(_scores(qb, kb, causal, mask) - lse[qi].unsqueeze(-1))
                    dkv[1][ki] += p.transpose(-2, -1) @ do
                    ds = p * (do @ vb.transpose(-2, -1) - delta[qi].unsqueeze(-1))
                    dq[qi] += ds @ kb * scale
                    dkv[0][ki] += ds.transpose(-2, -1) @ qb * scale
            dkv_next, dkv_ops = _rotate(comm, dkv, "cp_ring_dkv_backward")  # C hops: the last one brings it home
            _finish(kv_ops + dkv_ops)
            dkv = dkv_next
            if kv_ops:
                kv = kv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, comm, layout: Layout, recorder) -> torch.Tensor:
    """``[B, H, t, d]`` queries, keys, values of this rank's tokens -> its attention output, same shape."""
    return RingAttention.apply(q, k, v, comm, layout, recorder)
