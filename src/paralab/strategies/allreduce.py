"""``allreduce`` (CS744 Task 2b): after backward, one all-reduce per parameter.

Each rank sums every gradient with ``all_reduce(SUM)`` and divides by the
number of workers: the simplest correct data parallelism. There is no
overlap: all communication happens after backward has finished, one
(small or large) message per parameter tensor.
"""
from __future__ import annotations

import torch

from .base import ReplicatedStrategy


class AllReduce(ReplicatedStrategy):
    name = "allreduce"

    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.broadcast_parameters()

    @torch.no_grad()
    def synchronize(self):
        for name, p in self.model.named_parameters():
            if p.grad is None:  # unused this step: contribute zeros so every rank calls the same collectives
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, name="all_reduce")
            p.grad.div_(self.ctx.world)
