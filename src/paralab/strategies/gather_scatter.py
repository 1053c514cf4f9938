"""``gather-scatter`` (CS744 Task 2a): rank 0 averages every gradient, one parameter at a time.

After backward, for each parameter in turn:

1. every rank sends its gradient to rank 0 (``gather``);
2. rank 0 adds the N gradients and divides by N;
3. rank 0 sends that mean back to every rank (``scatter`` of N copies), and
   each rank overwrites its gradient with it.

Every replica then takes the same optimizer step from the same mean gradient,
so the parameters stay bit-identical. It is correct but slow by design: rank
0's link carries N-1 gradients in and N-1 out (a bottleneck that grows with
N, where a ring all-reduce moves about 2x the model per rank whatever N), rank
0 does all the arithmetic while the others wait, and nothing overlaps
backward. BatchNorm buffers follow the rule of every replicated strategy:
rank 0's are broadcast after each step. (Rank 0 here is the first replica of
the ``dp`` group: under ``--pp`` each stage's replicas have their own.)
"""
from __future__ import annotations

import torch

from .data_parallel import DataParallel
from .replicas import Replicas


class GatherScatterReplicas(Replicas):
    flavour = "gather-scatter"

    @torch.no_grad()
    def finish(self):
        world, root = self.comm.world, 0
        if world == 1:
            return
        for p in self.params:
            if p.grad is None:  # unused this step: contribute zeros so every rank calls the same collectives
                p.grad = torch.zeros_like(p)
            grad = p.grad
            if self.comm.rank == root:
                received = [torch.empty_like(grad) for _ in range(world)]
                self.comm.gather(grad, received, dst=root, name="gather")
                mean = received[0].clone()
                for g in received[1:]:
                    mean += g
                mean /= world
                # scatter sends element r to rank r: every rank gets the same mean,
                # and the root's own element lands in its gradient too
                self.comm.scatter(grad, [mean] * world, src=root, name="scatter")
            else:
                self.comm.gather(grad, None, dst=root, name="gather")
                self.comm.scatter(grad, None, src=root, name="scatter")


class GatherScatter(DataParallel):
    name = "gather-scatter"
    replayed = True  # by the check's reference, op for op at 2 shards (Strategy.replayed)
    replicas_cls = GatherScatterReplicas
