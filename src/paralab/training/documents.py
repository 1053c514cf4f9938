"""Before a step over documents: what its loss divides by, and which document each token is in.

Two things every driver of forwards over documents (the training loop, the
reference, the first-divergence replay, evaluation) states first, from the
data it holds, with no communication:

- the global batch's valid targets (``training/losses.py``: the loss is the
  sum over them divided by their count over every data-parallel shard; each
  rank reads the other shards' targets from the data, as the reference does);
- under ``--packing``, the document ids of the rows its forwards take
  (``models/documents.py``: the attention mask).
"""
from __future__ import annotations

import torch

from ..data.documents import doc_ids, valid_targets
from ..models import documents
from . import losses


def at_step(targets: list[torch.Tensor] | None, x: torch.Tensor | None, packing: bool) -> None:
    """``targets``: every data-parallel shard's targets this step (None: not documents); ``x``: the rows this
    process's forwards take (its shard, or the whole batch)."""
    if targets is None:
        losses.at_step(0, 0)
        documents.at_step(None)
        return
    losses.at_step(sum(valid_targets(y) for y in targets), sum(y.numel() for y in targets))
    documents.at_step(doc_ids(x.cpu()) if packing else None)


def given(x: torch.Tensor, packing: bool):
    """Forwards inside take the rows ``x`` whole (evaluation, a check's predictions)."""
    return documents.given(doc_ids(x.cpu()) if packing else None)


def at_source_step(source, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """:func:`at_step` for a rank holding ``source``'s shard ``(x, y)`` of ``step``; the other shards' targets
    read from the same data (``source.batch(step, rank)``)."""
    if not source.documents:
        at_step(None, None, False)
        return
    targets = [y if r == source.rank else source.batch(step, r)[1] for r in range(source.replicas)]
    at_step(targets, x, source.packing)
