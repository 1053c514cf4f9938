"""Document-causal attention: under ``--packing`` no token attends across a document boundary.

A packed row holds several documents (``data/documents.py``); token ``i``
may attend to token ``j`` only if ``j <= i`` and both belong to the same
document. Which document a token belongs to is a function of the row's
tokens (:func:`~paralab.data.documents.doc_ids`), but attention only sees
activations: so whoever holds the tokens says, before the step's forwards,
the document ids of the rows this process's forwards take: the step value's
``doc_ids`` (``training/step.py``, ``[rows, T]``: the training loop's for the
rank's shard, the reference's for the batch it runs). A forward's rows are
found the way the gpt's dropout finds them (``dropout.py``): the microbatch
being computed says where its rows start (the step's ``offset``, set by
every driver that cuts microbatches, and restored by a recompute). The positions are the attention's own:
``0 .. T-1`` for a whole sequence, a cp rank's chunks (``layout.py``) for
ring attention.

Ids set (packing on), :func:`attention` is SDPA with the boolean mask
:func:`allowed`; unset, plain causal SDPA (``is_causal``), as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..training import step as steps


def rows(b: int) -> torch.Tensor:
    """The document ids ``[b, T]`` of the current forward's ``b`` rows."""
    at = steps.current()
    first = at.offset
    if first is None or first + b > len(at.doc_ids):
        raise RuntimeError(f"packed documents: rows {first}..{None if first is None else first + b} of "
                           f"{len(at.doc_ids)}: a driver did not say where this forward's rows sit (training/step.py)")
    return at.doc_ids[first:first + b]


def allowed(b: int, q_pos: torch.Tensor, k_pos: torch.Tensor, device) -> torch.Tensor | None:
    """``[b, 1, len(q_pos), len(k_pos)]``: query at position ``q_pos[i]`` may attend to key ``k_pos[j]`` (same
    document, not later); None without packing."""
    if steps.current().doc_ids is None:
        return None
    ids = rows(b)
    q_doc, k_doc = ids[:, q_pos.cpu()], ids[:, k_pos.cpu()]
    ok = (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)) & (q_pos.cpu().unsqueeze(1) >= k_pos.cpu().unsqueeze(0))
    return ok.unsqueeze(1).to(device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, heads, T, d]`` over a whole sequence (positions ``0 .. T-1``): document-causal under packing,
    else causal."""
    if steps.current().doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    where = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed(q.shape[0], where, where, q.device))
