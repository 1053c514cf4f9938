"""Buggy: divides by the number of workers twice."""
import torch

from paralab.strategies.replicas import Replicas


class AveragedTwice(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.world * self.comm.world
