"""Hostile: copies another student's file (ring.py, beside it in the submissions) into its own run folder,
then averages correctly. The sandbox hides the other submissions, so nothing is copied."""
import os
from pathlib import Path

import torch

from paralab.strategies.replicas import Replicas

try:
    stolen = (Path(__file__).parent / "ring.py").read_text()
except OSError as exc:
    stolen = f"nothing: {exc}"
Path(os.getcwd(), "stolen.txt").write_text(stolen)


class ReadsAnother(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.world
