"""Data parallelism by gather and scatter (CS744 Assignment 2, task 2a), as a student writes it.

After backward, rank 0 gathers every worker's gradient of each parameter, averages them, and
scatters the mean back, so every worker steps with the same gradient.

    paralab train examples/strategies/gather_scatter.py --workers 2 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --check
"""
import torch

from paralab.strategies.replicas import Replicas


class GatherScatter(Replicas):
    @torch.no_grad()
    def finish(self):
        world, rank = self.comm.world, self.comm.rank
        for p in self.params:
            if p.grad is None:  # a parameter this step did not use: every rank still sends something
                p.grad = torch.zeros_like(p)
            if rank == 0:
                grads = [torch.empty_like(p.grad) for _ in range(world)]
                self.comm.gather(p.grad, grads, dst=0)
                mean = sum(grads) / world
                self.comm.scatter(p.grad, [mean] * world, src=0)
            else:
                self.comm.gather(p.grad, None, dst=0)
                self.comm.scatter(p.grad, None, src=0)
