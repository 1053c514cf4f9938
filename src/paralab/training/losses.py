"""The training loss, one function for every model.

Image classifiers give logits ``[B, C]`` for labels ``[B]``; a language model
gives ``[B, T, V]`` for next tokens ``[B, T]``. Both are the cross-entropy of
every prediction, averaged: for a language model over all ``B x T`` tokens,
which with a fixed context ``T`` equals the mean over samples of each
sample's mean token loss, so a microbatch's weight stays its share of the
samples (``base.split_microbatches``) whatever the model.

Documents (``data/documents.py``) leave some targets out (:data:`IGNORE`:
padding, and the byte after a document's end), and how many a row keeps
varies. Then the step's loss is the sum over its valid targets divided by
their count over the **whole global batch** (the entered step value's
``valid``: ``training/step.py``),
not the mean of per-shard or per-microbatch means, which would weigh a
short document's tokens more than a long one's. Every layout still combines
its pieces (a rank's shard, a microbatch, a cp rank's tokens) by their share
of the batch's elements (``b t / (B T)``); so each piece's loss is its sum
over valid targets times ``(B T) / (b t N)``, and any such combination gives
exactly ``sum / N`` with no extra communication (every rank counts ``N`` from
the data, as the reference does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import step as steps
from ..data.documents import IGNORE  # F.cross_entropy's ignore_index: a target no loss counts


def piece_scale(targets: int) -> float:
    """What a piece of ``targets`` elements multiplies its sum over valid targets by (module docstring; a global
    batch with no valid target has a zero sum, scaled by anything finite)."""
    at = steps.current()
    return at.elements / (targets * at.valid) if at.valid else 1.0 / targets


def documents() -> bool:
    """Whether the entered step is over documents."""
    return steps.current().documents


def token_loss(per_token: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A piece's loss from its per-target losses (any reduction of ``F.cross_entropy``'s ``none``, or a
    vocabulary-parallel one): under documents their valid sum scaled (module docstring), else their mean."""
    if not documents():
        return per_token.mean()
    kept = per_token.masked_fill(target.reshape(per_token.shape) == IGNORE, 0.0)
    return kept.sum() * piece_scale(target.numel())


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every prediction: ``logits [..., C]`` against ``target [...]`` (``mean``: this
    step's weighting under documents, :func:`token_loss`)."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if reduction == "mean" and documents():
        return F.cross_entropy(flat, labels, reduction="sum", ignore_index=IGNORE) * piece_scale(labels.numel())
    return F.cross_entropy(flat, labels, reduction=reduction, ignore_index=IGNORE)
