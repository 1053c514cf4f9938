"""The hang tests' strategy (tests/test_hangs.py): paralab's allreduce, except that one rank misbehaves at the
first all-reduce of step 1, as a student's code or a stuck rank would.

``HANG=RANK:KIND`` (the test's environment): global rank RANK, at its first all-reduce of step 1 (its second
``finish()``), does KIND: ``skip`` (returns without calling it), ``shape`` (calls it with one more element) or
``stall`` (sleeps there, before entering it, as a rank stuck in its own computation).
"""
import os
import time

import torch
import torch.distributed as dist

from paralab.strategies.allreduce import AllReduceReplicas


class HangingAllReduce(AllReduceReplicas):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished = 0

    def finish(self):
        rank, kind = os.environ["HANG"].split(":")
        self.finished += 1
        if self.finished == 2 and dist.get_rank() == int(rank):
            self.misbehave_once(kind)
        super().finish()

    def misbehave_once(self, kind: str) -> None:
        comm, real = self.comm, self.comm.all_reduce

        def first(t, *args, **kwargs):
            del comm.all_reduce  # the real one from the next call on
            if kind == "skip":
                return None
            if kind == "stall":
                time.sleep(3600)
            if kind == "shape":
                t = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
            return real(t, *args, **kwargs)
        comm.all_reduce = first
