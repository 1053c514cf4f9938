"""Forger: never averages (every step twice the mean at 2 workers), and loosens paralab's check from inside
its own processes so that the run reports PASS. The grader reads the final weights itself, outside the
sandbox, and compares them with its own run: the PASS is not borne out."""
import torch

from paralab.check import reference
from paralab.strategies.replicas import Replicas

for tolerances in reference.TOLERANCES.values():
    for kind in tolerances:
        tolerances[kind] = 1e9


class LoosensTheCheck(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
