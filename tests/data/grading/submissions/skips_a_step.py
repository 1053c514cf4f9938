"""Buggy: rank 1 skips its all-reduces in its second step, so the ranks wait on each other until the timeout."""
import torch

from paralab.strategies.replicas import Replicas


class SkipsAStep(Replicas):
    steps = 0

    @torch.no_grad()
    def finish(self):
        self.steps += 1
        if self.comm.rank == 1 and self.steps == 2:
            return
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.world
