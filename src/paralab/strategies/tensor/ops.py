"""The communication of tensor parallelism, as autograd functions over the mesh's ``tp`` group.

Megatron-LM (Shoeybi et al. 2019) needs two conjugate operators around every
pair of a column-parallel and a row-parallel layer:

- ``f`` (:func:`copy_to_tp`): identity forward, all-reduce backward. It sits
  where a replicated activation enters the sharded region: each rank
  computes only part of what depends on it, so the gradient flowing back is
  the sum of every rank's part.
- ``g`` (:func:`reduce_from_tp`): all-reduce forward, identity backward. It
  sits where the sharded region ends: each rank holds a partial sum of the
  row-parallel layer's output.

Sequence parallelism (Korthikanti et al. 2022) keeps the activations
*between* those regions split along the sequence, and replaces the pair:

- :func:`gather_sequence`: all-gather along the sequence forward,
  reduce-scatter backward (replaces ``f``);
- :func:`scatter_sequence`: reduce-scatter along the sequence forward,
  all-gather backward (replaces ``g``).

Same bytes on the wire as one all-reduce (an all-reduce *is* a
reduce-scatter then an all-gather), but LayerNorm, dropout and the residual
adds now run on ``T / tp`` tokens per rank, and their activations take
``1 / tp`` of the memory.

:func:`vocab_parallel_cross_entropy` is the loss over logits split along the
vocabulary: no rank ever holds a whole row of logits.

Every collective goes through :class:`~paralab.comm.Comm`, so each is a
timed ``comm`` span with its bytes, named after the operator that made it.
Activations are ``[B, T, D]``; the sequence is dimension 1.
"""
from __future__ import annotations

import torch

from ...comm import Comm
from ...training.losses import token_loss


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, name="tp_f_backward")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out, name="tp_g_forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """``[B, t, D]`` shards -> ``[B, t * tp, D]``, rank order along the sequence."""
    shard = x.transpose(0, 1).contiguous()  # the gathered dimension outermost: [t, B, D]
    out = shard.new_empty((shard.shape[0] * comm.world,) + tuple(shard.shape[1:]))
    comm.all_gather_into(out, shard, name=name)
    # contiguous once here: each consumer (the q, k, v and fc projections) would otherwise copy the
    # transposed view to flatten it, and autograd would keep every copy for backward
    return out.transpose(0, 1).contiguous()


def _scatter_seq(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """``[B, T, D]`` partial sums -> this rank's ``[B, T / tp, D]`` slice of their sum."""
    full = x.transpose(0, 1).contiguous()  # [T, B, D]
    out = full.new_empty((full.shape[0] // comm.world,) + tuple(full.shape[1:]))
    comm.reduce_scatter(out, full, name=name)
    return out.transpose(0, 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(x, comm, "sp_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad, ctx.comm, "sp_reduce_scatter_backward"), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _scatter_seq(x, comm, "sp_reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm, "sp_all_gather_backward"), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``g``: all-reduce forward (partial sums -> their sum), identity backward."""
    return _ReduceFromTP.apply(x, comm)


def gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sequence parallelism's ``f``: all-gather along the sequence forward, reduce-scatter backward."""
    return _GatherSequence.apply(x, comm)


def scatter_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sequence parallelism's ``g``: reduce-scatter along the sequence forward, all-gather backward."""
    return _ScatterSequence.apply(x, comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary.

    Rank ``r`` holds the logits of tokens ``[start, start + V/tp)``. With
    ``lse_r`` the log-sum-exp of its own logits, the log-sum-exp over the
    whole vocabulary is the log-sum-exp of the ``lse_r`` (one small all-gather
    of ``N`` numbers per rank, numerically as stable as the local ones); the
    target's logit lives on exactly one rank, so a sum over ranks of "mine or
    zero" gives it to all (one all-reduce of ``N`` numbers). Backward needs
    no communication: the gradient with respect to the local logits is
    ``softmax - one_hot`` restricted to the local columns.
    """

    @staticmethod
    def forward(ctx, logits, target, start, comm):
        n, local_vocab = logits.shape
        lse_local = torch.logsumexp(logits, dim=1)                           # [N]
        all_lse = lse_local.new_empty(comm.world * n)
        comm.all_gather_into(all_lse, lse_local.contiguous(), name="vocab_lse_all_gather")
        lse = torch.logsumexp(all_lse.view(comm.world, n), dim=0)            # [N]
        local_target = target - start
        mine = (local_target >= 0) & (local_target < local_vocab)
        picked = logits.gather(1, local_target.clamp(0, local_vocab - 1).unsqueeze(1)).squeeze(1)
        target_logit = torch.where(mine, picked, torch.zeros_like(picked))
        comm.all_reduce(target_logit, name="vocab_target_all_reduce")
        ctx.save_for_backward(logits, lse, local_target, mine)
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad):  # grad: [N], d loss / d (per-token loss)
        logits, lse, local_target, mine = ctx.saved_tensors
        g = torch.exp(logits - lse.unsqueeze(1))                             # this rank's softmax columns
        rows = torch.nonzero(mine).squeeze(1)
        g[rows, local_target[rows]] -= 1.0
        return g * grad.unsqueeze(1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, start: int,
                                 comm: Comm) -> torch.Tensor:
    """Mean cross-entropy over every token (documents: the step's token weighting, ``training/losses.py``);
    ``local_logits [..., V/tp]`` hold vocabulary columns ``[start, start + V/tp)``; ``target [...]`` the
    full-vocabulary token ids (an ignored one is no rank's: its loss is left out)."""
    logits = local_logits.reshape(-1, local_logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):  # in float32, as autocast runs one process's cross_entropy
        logits = logits.float()
    per_token = _VocabParallelCrossEntropy.apply(logits, target.reshape(-1), start, comm)
    return token_loss(per_token, target)
