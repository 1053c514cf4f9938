"""How a MoE layer's tokens reach the ranks holding their experts under ``--ep``, and come back:
the all-to-all dispatcher and the all-gather one kept for comparison, over differentiable collectives."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ...models.moe import Routing, combine
from ...options import option


DISPATCHERS = ("all-to-all", "all-gather")


@dataclass
class ExpertOptions:
    """expert parallelism (--ep, a mixture-of-experts gpt)"""
    dispatcher: str = option("all-to-all", "how tokens reach their expert's rank under --ep: all-to-all (counts, "
                                           "then the token rows, and back) or all-gather (every token to every "
                                           "rank, outputs back by reduce-scatter; for comparison)",
                             choices=DISPATCHERS)


# ---------------------------------------------------------------- the collectives, differentiable
class AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` to rank r, ``out_splits[r]`` from it; backward: the gradients back, reversed."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits, name):
        ctx.comm, ctx.splits, ctx.name = comm, (out_splits, in_splits), name
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, name=f"{ctx.name}_backward")
        return back, None, None, None, None


class AllGather(torch.autograd.Function):
    """Every rank's rows, in rank order; backward: each rank's slice of the summed gradient."""

    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        out = x.new_empty((x.shape[0] * comm.world,) + tuple(x.shape[1:]))
        comm.all_gather_into(out, x.contiguous(), name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.comm, f"{ctx.name}_backward"), None, None


class ReduceScatter(torch.autograd.Function):
    """The sum over ranks, this rank's slice of rows; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        return reduce_scatter(x, comm, name)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] * ctx.comm.world,) + tuple(grad.shape[1:]))
        ctx.comm.all_gather_into(out, grad.contiguous(), name=f"{ctx.name}_backward")
        return out, None, None


def reduce_scatter(x: torch.Tensor, comm, name: str) -> torch.Tensor:
    full = x.contiguous().clone()  # gloo's fallback all-reduces in place
    out = x.new_empty((x.shape[0] // comm.world,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, full, name=name)
    return out


# ---------------------------------------------------------------- the two dispatchers
class AllToAllDispatch:
    """A MoE layer's ``dispatch`` under --ep: counts, then tokens, out and back by all-to-all."""

    def __init__(self, comm, experts: int):
        self.comm, self.local = comm, experts // comm.world

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleList) -> torch.Tensor:
        ep, local = self.comm.world, self.local
        index, gates, counts = routing.assignments()  # kept choices sorted by expert, so by destination rank
        # 1. the counts: from every source, how many rows for each of this rank's experts
        received = torch.empty_like(counts)
        self.comm.all_to_all_single(received, counts, name="moe_counts")
        received = received.view(ep, local)
        in_splits, out_splits = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        # 2. the rows (source-major, expert within), regrouped expert-major for the experts
        rows = AllToAll.apply(tokens[index], self.comm, out_splits, in_splits, "moe_dispatch")
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(ep), received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        per_expert = received.sum(0)
        routing.stats["received"] = per_expert.tolist()
        out = torch.cat([e(part) for e, part in zip(experts, rows[order].split(per_expert.tolist()))])
        # 3. back to source-major order, and home by the reverse all-to-all
        unorder = torch.empty_like(order)
        unorder[order] = torch.arange(len(order))
        back = AllToAll.apply(out[unorder], self.comm, in_splits, out_splits, "moe_combine")
        return combine(tokens, index, gates, back)


class AllGatherDispatch:
    """The comparison: every rank's tokens, gates and choices to every rank; each computes its experts'
    share of all of them; the sum comes back by reduce-scatter."""

    def __init__(self, comm, experts: int):
        self.comm, self.local = comm, experts // comm.world
        self.first = comm.rank * self.local

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleList) -> torch.Tensor:
        k = routing.expert.shape[1]
        everyone = AllGather.apply(tokens, self.comm, "moe_gather_tokens")
        gates = AllGather.apply(routing.gate, self.comm, "moe_gather_gates")
        choice = torch.where(routing.kept, routing.expert, routing.expert.new_full((), -1)).contiguous()
        choices = choice.new_empty((choice.shape[0] * self.comm.world, k))
        self.comm.all_gather_into(choices, choice, name="moe_gather_choices")
        mine = choices.reshape(-1) - self.first
        mine = torch.where((mine >= 0) & (mine < self.local), mine, mine.new_full((), self.local))
        order = torch.argsort(mine, stable=True)
        per_expert = torch.bincount(mine, minlength=self.local + 1)[:self.local]
        order = order[:int(per_expert.sum())]
        routing.stats["received"] = per_expert.tolist()
        index = order // k
        out = torch.cat([e(part) for e, part in zip(experts, everyone[index].split(per_expert.tolist()))])
        partial = combine(everyone, index, gates.reshape(-1)[order], out)
        return ReduceScatter.apply(partial, self.comm, "moe_scatter_outputs")
