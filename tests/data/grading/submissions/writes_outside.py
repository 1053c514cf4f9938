"""Hostile: writes beside the submissions, into the grader's output folder and into the home folder, then
averages correctly. The sandbox lets it write its own run folder and /tmp only."""
import os
from pathlib import Path

import torch

from paralab.strategies.replicas import Replicas

for target in (Path(__file__).parent / "planted.py", Path(os.getcwd()).parent / "planted.txt",
               Path.home().parent / "planted.txt", Path("/tmp") / "planted-by-a-submission.txt"):
    try:
        target.write_text("planted")
    except OSError:
        pass


class WritesOutside(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.world
