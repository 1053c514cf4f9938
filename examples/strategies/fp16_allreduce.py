"""Data parallelism by an all-reduce in fp16: half the bytes on the wire, a correct but lossy strategy.

As ``allreduce.py``, but each gradient crosses the wire as float16, so the mean every worker ends with is
rounded to fp16's 11 bits, which no single process does. ``--check`` cannot replay that rounding (it is the
student's own), so the class declares it: ``gradient_wire``. The check then judges the run by a noise band
(docs/correctness.md, "Bug or rounding"), one of whose references rounds each gradient through float16, at
every precision, fp64's too: the rounding is said to be rounding, and a bug beside it is still a bug.

    paralab train examples/strategies/fp16_allreduce.py --workers 2 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --check
"""
import torch

from paralab.strategies.replicas import Replicas


class HalfAllReduce(Replicas):
    gradient_wire = torch.float16  # what the gradients are rounded to on the wire (the check's band replays it)

    @torch.no_grad()
    def finish(self):
        for p in self.params:
            if p.grad is None:  # a parameter this step did not use: every rank still sends something
                p.grad = torch.zeros_like(p)
            half = (p.grad / self.comm.world).to(torch.float16)  # divided first: fp16 overflows at 65504
            self.comm.all_reduce(half)
            p.grad.copy_(half)
