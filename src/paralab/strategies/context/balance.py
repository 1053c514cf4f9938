"""Which chunks each cp rank takes when the rows are packed documents: the ring's work, rotation by rotation.

Under plain causal attention the work of query chunk ``a`` is ``a + 1``
blocks (its own triangle and every chunk before it), whatever the data: so
``layout.py`` pairs the ``r``-th chunk from the start with the ``r``-th from
the end, once and for all. Packed documents change that (``--packing``):
ring attention computes a block only in the rows where some query may see
some key (``ring.py``), and that depends on where this step's documents end.
Block ``(a, b)``, ``b < a``, is needed in a row only if a document runs from
key chunk ``b`` into query chunk ``a``; since a row's document ids never
decrease, that is exactly when the last token of chunk ``b`` and the first
of chunk ``a`` share a document (one comparison per row, no mask built).

The ring does not wait once per step but once per rotation: at rotation
``i`` rank ``r`` computes its query chunks against the key chunks of rank
``r - i``, and the next K/V block arrives only when the slowest rank has
sent. So what an assignment costs is the sum over rotations of the busiest
rank's blocks (:func:`ring_time`), not the busiest rank's total.

Per step, from the document ids of the rows the step trains on (every rank
of a cp group holds the same rows, so every rank computes the same
assignment, with no communication):

- :func:`block_work`: for each (query chunk, key chunk) pair, the rows that
  need that block;
- :func:`deal`: starting from the head + tail pairing, swap two chunks of
  different ranks while that shortens :func:`ring_time` (each rank keeps the
  same number of chunks, so its activations keep their shape); so the chunks
  are never dealt worse than the pairing, by this count.

How even the dealt chunks and the pairing leave the ranks is measured in
docs/context.md (``bench/documents.py``).
"""
from __future__ import annotations

import torch

Assignment = tuple[tuple[int, ...], ...]


def block_work(ids: torch.Tensor, chunks: int) -> list[list[int]]:
    """``ids [rows, T]`` (document ids, non-decreasing along each row) -> ``work[a][b]``, for ``b <= a``: the
    rows in which query chunk ``a`` needs key chunk ``b`` (every row for ``b == a``; 0 above the diagonal)."""
    c = ids.shape[1] // chunks
    first = ids[:, ::c][:, :chunks]        # each chunk's first token's document
    last = ids[:, c - 1::c][:, :chunks]    # each chunk's last token's document
    rows = ids.shape[0]
    return [[rows if b == a else int((last[:, b] == first[:, a]).sum()) if b < a else 0 for b in range(chunks)]
            for a in range(chunks)]


def ring_time(work: list[list[int]], assignment: Assignment) -> int:
    """The blocks the ring waits for: over its rotations, the busiest rank's blocks in each."""
    ranks = len(assignment)
    return sum(max(sum(work[a][b] for a in assignment[r] for b in assignment[(r - i) % ranks])
                   for r in range(ranks)) for i in range(ranks))


def even_time(work: list[list[int]], ranks: int) -> float:
    """The ring's time were every rotation's blocks shared evenly: the total over the ranks."""
    return sum(map(sum, work)) / ranks


def deal(work: list[list[int]], fixed: Assignment) -> Assignment:
    """From ``fixed`` (the head + tail pairing), swap two chunks of different ranks whenever that shortens
    :func:`ring_time`, until no swap does; each rank's chunks in position order."""
    best, best_time = [list(chunks) for chunks in fixed], ring_time(work, fixed)
    improved = True
    while improved:
        improved = False
        for r in range(len(best)):
            for q in range(r + 1, len(best)):
                for i in range(len(best[r])):
                    for j in range(len(best[q])):
                        trial = [list(chunks) for chunks in best]
                        trial[r][i], trial[q][j] = best[q][j], best[r][i]
                        t = ring_time(work, _sorted(trial))
                        if t < best_time:
                            best, best_time, improved = trial, t, True
    return _sorted(best)


def _sorted(held: list[list[int]]) -> Assignment:
    return tuple(tuple(sorted(chunks)) for chunks in held)
