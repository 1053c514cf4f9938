"""Which tokens of a sequence each rank of the ``cp`` group holds, and how to put them back.

The sequence of ``T`` tokens is cut into equal chunks. Balanced (the
default): ``2C`` chunks, rank ``r`` holds chunk ``r`` and chunk ``2C-1-r``
(a head chunk and a tail chunk). Under causal attention a query attends to
the keys before it, so the work of a chunk grows with its index; pairing
the ``r``-th from the start with the ``r``-th from the end gives every rank
the same work. Contiguous (``--no-cp-balance``): ``C`` chunks, rank ``r``
holds chunk ``r``; the last rank then does about ``2C-1`` times the first's
attention work, which ``paralab calc``'s records and ``docs/context.md`` show.

Packed documents (``--packing``) make the work of a chunk depend on where
the documents end: then the chunks are dealt to the ranks afresh every step
(``balance.py``), an explicit :attr:`Layout.assignment` of the same ``2C``
chunks, two per rank.

A rank's tokens are its chunks concatenated in that order; every
position-dependent piece (the position embedding, the causal mask, the
targets) uses :attr:`Layout.positions`, the global position of each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    context: int     # T: tokens per sample
    size: int        # C: ranks in the cp group
    balanced: bool = True
    assignment: tuple[tuple[int, ...], ...] | None = None  # each rank's chunks (balance.py); None: the fixed rule

    @property
    def chunks(self) -> int:
        return 2 * self.size if self.balanced else self.size

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.context // self.chunks

    @property
    def local(self) -> int:
        """Tokens per rank: T / C."""
        return self.context // self.size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` holds, in its order."""
        if self.assignment is not None:
            return self.assignment[rank]
        return (rank, 2 * self.size - 1 - rank) if self.balanced else (rank,)

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions of rank ``rank``'s tokens, in its order."""
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks_of(rank)])

    def order(self) -> torch.Tensor:
        """Every rank's positions concatenated in rank order: what an all-gather along the sequence holds."""
        return torch.cat([self.positions(r) for r in range(self.size)])

    def inverse(self) -> torch.Tensor:
        """The permutation that puts the all-gathered order back into position order."""
        return torch.argsort(self.order())

    def take(self, t: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of a whole-sequence tensor (``dim``: the sequence)."""
        return t.index_select(dim, self.positions(rank).to(t.device))

    def problem(self) -> str | None:
        """Why this layout cannot cut the sequence, or None."""
        if self.context % self.chunks:
            return (f"--context {self.context} must be a multiple of {self.chunks} = "
                    f"{'2 x ' if self.balanced else ''}cp {self.size} (each rank holds "
                    f"{'two equal chunks' if self.balanced else 'one equal chunk'} of the sequence): change "
                    f"--context or --cp" + ("" if not self.balanced else ", or contiguous chunks (--no-cp-balance)"))
        return None
