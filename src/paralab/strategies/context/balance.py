"""Which chunks each cp rank takes when the rows are packed documents: equal attention work, chunk by chunk.

Under plain causal attention the work of query chunk ``a`` is ``a + 1``
blocks (its own triangle and every chunk before it), whatever the data: so
``layout.py`` pairs the ``r``-th chunk from the start with the ``r``-th from
the end, once and for all. Packed documents change that (``--packing``):
ring attention skips a block in which no query may see any key
(``ring.py``), and whether a block is empty depends on where this step's
documents end. Block ``(a, b)``, ``b < a``, holds an allowed pair only if a
document runs from key chunk ``b`` into query chunk ``a`` in some row; since
a row's document ids never decrease, that is exactly when the last token of
chunk ``b`` and the first of chunk ``a`` share a document in some row (one
comparison per row, no mask built).

So, per step, from the document ids of the rows the step trains on (every
rank of a cp group holds the same rows, so every rank computes the same
assignment, with no communication):

- :func:`chunk_work`: the blocks each query chunk's attention will compute,
  row by row (the ring computes a block only in the rows that need it);
- :func:`assign`: the chunks dealt to the ranks, each rank taking the same
  number (its activations keep their shape), largest work first, each to the
  rank with the least work so far (the longest-processing-time rule, which
  is within 4/3 of the best split); :func:`deal` keeps the head + tail
  pairing where that is as even, so the chunks are never dealt worse.

Documents shorter than a chunk leave most earlier blocks empty, so the work
no longer grows with the chunk's index as the head + tail pairing assumes;
how uneven that pairing leaves the ranks, and the dealt chunks, is measured
in docs/context.md (``bench/context.py``).
"""
from __future__ import annotations

import torch


def chunk_work(ids: torch.Tensor, chunks: int) -> list[int]:
    """``ids [rows, T]`` (document ids, non-decreasing along each row) -> for each of ``chunks`` equal query
    chunks, the (row, key chunk) blocks ring attention computes for it: its own in every row, and each
    earlier chunk in the rows where a document runs from that chunk into this one."""
    c = ids.shape[1] // chunks
    first = ids[:, ::c][:, :chunks]        # each chunk's first token's document
    last = ids[:, c - 1::c][:, :chunks]    # each chunk's last token's document
    rows = ids.shape[0]
    return [rows + sum(int((last[:, b] == first[:, a]).sum()) for b in range(a)) for a in range(chunks)]


def assign(work: list[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Chunks dealt to ``ranks`` ranks, ``len(work) / ranks`` each, balancing their summed ``work``: the
    largest first, each to the least loaded rank that has room; each rank's chunks in position order."""
    per_rank = len(work) // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for chunk in sorted(range(len(work)), key=lambda a: (-work[a], a)):
        r = min((r for r in range(ranks) if len(held[r]) < per_rank), key=lambda r: (load[r], r))
        held[r].append(chunk)
        load[r] += work[chunk]
    return tuple(tuple(sorted(h)) for h in held)


def deal(work: list[int], fixed: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """:func:`assign`'s chunks, or the ``fixed`` pairing where that is at least as even (the rule is a
    heuristic: the fixed pairing is kept whenever the dealt chunks would not improve on it)."""
    dealt = assign(work, len(fixed))
    return dealt if spread(work, dealt) < spread(work, fixed) else fixed


def spread(work: list[int], assignment: tuple[tuple[int, ...], ...]) -> float:
    """The most loaded rank's work over the mean (1: perfectly even)."""
    loads = [sum(work[a] for a in chunks) for chunks in assignment]
    return max(loads) / (sum(loads) / len(loads))
