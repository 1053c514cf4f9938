"""The training loss, one function for every model.

Image classifiers give logits ``[B, C]`` for labels ``[B]``; a language model
gives ``[B, T, V]`` for next tokens ``[B, T]``. Both are the cross-entropy of
every prediction, averaged: for a language model over all ``B x T`` tokens,
which with a fixed context ``T`` equals the mean over samples of each
sample's mean token loss, so a microbatch's weight stays its share of the
samples (``base.split_microbatches``) whatever the model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every prediction: ``logits [..., C]`` against ``target [...]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction)
