"""The classic bug: all-reduce sums the gradients and nobody divides by the number of workers.

Every worker then steps with N times the mean gradient: as if the learning rate were N times
larger. The loss may still go down, which is why the bug survives; --check FAILs it at once.

    paralab train examples/strategies/forgot_to_average.py --workers 2 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --check  # FAILs
"""
import torch

from paralab.strategies.replicas import Replicas


class ForgotToAverage(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad)  # the sum; the mean needs "/ self.comm.world"
