"""One rank's place in the tensor-parallel group, and the few things every sharded layer asks of it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm import Comm
from .ops import copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence


@dataclass
class TPGroup:
    """The mesh's ``tp`` group and whether activations outside the sharded regions are split along the
    sequence (``--sequence-parallel``)."""
    comm: Comm
    sequence_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.world

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of a full tensor along ``dim`` (a copy: the full one is dropped)."""
        return t.detach().chunk(self.size, dim)[self.rank].clone()

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Where a replicated activation enters a sharded region (before column-parallel layers):
        ``f``, or under sequence parallelism the all-gather of the sequence shards."""
        return gather_sequence(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Where a sharded region ends (after a row-parallel layer's partial sums): ``g``, or under
        sequence parallelism the reduce-scatter onto sequence shards."""
        return scatter_sequence(partial, self.comm) if self.sequence_parallel else reduce_from_tp(partial, self.comm)

    def replicated(self, p: torch.Tensor) -> torch.Tensor:
        """A parameter every rank holds whole, as one layer uses it. Outside the sharded regions
        under sequence parallelism each rank applies it to its own tokens only, so its gradient is
        a partial sum: ``f`` sums it over the group (forgetting this is the classic sequence-parallel
        bug: LayerNorm weights drift apart across tp ranks). Otherwise every rank computes the same
        full gradient and nothing is needed."""
        return copy_to_tp(p, self.comm) if self.sequence_parallel else p
