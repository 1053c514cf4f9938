"""Hostile (or just wrong): never returns from finish(). The run is stopped at the assignment's time limit."""
import torch

from paralab.strategies.replicas import Replicas


class LoopsForever(Replicas):
    @torch.no_grad()
    def finish(self):
        while True:
            pass
