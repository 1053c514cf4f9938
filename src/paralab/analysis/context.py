"""Context parallelism's cost model: the messages of ring attention and Ulysses, and causal work per rank.

Symbols: b sequences per microbatch, s tokens per sequence, h model width, a
heads, L blocks (on this pipeline stage), C the cp size, t the tp size, e
bytes per element. A rank holds ``s / C`` tokens and, under tp, ``h / t`` of
the width (its heads).

- Ring (``strategies/context/ring.py``): one message = K and V of a rank's
  tokens, ``2 b (h/t) (s/C) e`` bytes. Per block: forward ``C-1`` sends (and
  as many receives); backward ``C-1`` sends of K/V and ``C`` of dK/dV (the
  last hop brings each rank's gradient home).
- Ulysses (``ulysses.py``): per block four all-to-alls forward (q, k, v, the
  output) and four backward, each of a rank's whole ``b (h/t) (s/C) e``-byte
  tensor (as recorded: the bytes a rank hands the all-to-all, its own part
  included; ``(C-1)/C`` of it leaves the rank).
- Every step: one all-reduce of the loss (one element) over cp.
- Causal work: the ring computes a (query chunk, key chunk) block where the
  key chunk is not after the query chunk (the diagonal block with its mask).
  Balanced, every rank computes ``2C + 1`` blocks of ``(s / 2C)^2`` scores;
  contiguous, rank r computes ``r + 1`` blocks of ``(s / C)^2``: the last
  rank ``C`` times the first's work, and every rank waits for it.
"""
from __future__ import annotations

from .cost import Formula, fmt_bytes


def cp_messages(b: int, s: int, h: int, layers: int, cp: int, method: str, tp: int = 1, e: int = 4,
                kv: int | None = None) -> dict:
    """Per microbatch (forward + backward) on one rank: ``{span name: (sends or calls, bytes)}`` as paralab
    records them (for the ring, the sends; each is matched by a receive of the same size). ``kv``: the key
    (and the value) projection's width, ``h`` unless grouped-query attention shares G key/value heads among
    the a query heads (``h G / a``: the planner's shapes; paralab's gpt has as many as heads)."""
    local = b * (h // tp) * (s // cp) * e  # one of q or the output, this rank's tokens and heads
    local_kv = b * ((h if kv is None else kv) // tp) * (s // cp) * e  # one of k or v
    if method == "ring":
        pair = 2 * local_kv
        return {"cp_ring_kv": ((cp - 1) * layers, (cp - 1) * layers * pair),
                "cp_ring_kv_backward": ((cp - 1) * layers, (cp - 1) * layers * pair),
                "cp_ring_dkv_backward": (cp * layers, cp * layers * pair)}
    sizes = {"cp_a2a_q": local, "cp_a2a_k": local_kv, "cp_a2a_v": local_kv, "cp_a2a_out": local}
    return {n + suffix: (layers, layers * size) for n, size in sizes.items() for suffix in ("", "_backward")}


def cp_communication(b: int, s: int, h: int, layers: int, cp: int, method: str, tp: int = 1, e: int = 4) -> Formula:
    msgs = cp_messages(b, s, h, layers, cp, method, tp, e)
    total = sum(size for _, size in msgs.values())
    local = b * (h // tp) * (s // cp) * e
    if method == "ring":
        formula = "per block: (C-1) K/V sends forward, (C-1) K/V + C dK/dV backward, each 2 b (h/t) (s/C) e bytes"
        wire = total
    else:
        formula = "per block: 4 all-to-alls forward + 4 backward, each of b (h/t) (s/C) e bytes"
        wire = total * (cp - 1) / cp
    return Formula(f"context-parallel communication per microbatch ({method})", formula,
                   f"b={b} s={s} h={h} t={tp} C={cp} e={e}: {local:,} B per q/k/v/output tensor, L={layers}",
                   total, "B", note=f"bytes leaving each rank: {fmt_bytes(wire)}; plus one loss all-reduce a step",
                   parts={"messages": msgs, "wire_bytes": wire})


def causal_work(s: int, cp: int, balanced: bool) -> list[int]:
    """Per cp rank: the attention scores the ring computes for its queries (whole blocks, see above)."""
    if balanced:
        return [(2 * cp + 1) * (s // (2 * cp)) ** 2] * cp
    return [(r + 1) * (s // cp) ** 2 for r in range(cp)]
