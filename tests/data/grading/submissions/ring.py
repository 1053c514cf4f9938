"""Correct: a ring all-reduce written with send and recv (reduce-scatter, then all-gather, N-1 hops each)."""
import torch

from paralab.strategies.replicas import Replicas


class Ring(Replicas):
    @torch.no_grad()
    def finish(self):
        world, rank = self.comm.world, self.comm.rank
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        chunks = list(flat.tensor_split(world))
        right, left = (rank + 1) % world, (rank - 1) % world
        for hop in range(world - 1):  # reduce-scatter: chunk (rank - hop) travels right, summed on the way
            send, recv = (rank - hop) % world, (rank - hop - 1) % world
            incoming = torch.empty_like(chunks[recv])
            pending = self.comm.isend(chunks[send].clone(), right)
            self.comm.recv(incoming, left)
            pending.wait()
            chunks[recv] += incoming
        for hop in range(world - 1):  # all-gather: the summed chunks go round once more
            send, recv = (rank + 1 - hop) % world, (rank - hop) % world
            pending = self.comm.isend(chunks[send].clone(), right)
            self.comm.recv(chunks[recv], left)
            pending.wait()
        mean = torch.cat(chunks) / world
        for p, g in zip(self.params, mean.split([p.numel() for p in self.params])):
            p.grad = g.view_as(p).clone()
