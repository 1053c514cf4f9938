"""Bucketed, overlapped data parallelism (what DistributedDataParallel does), as a student writes it.

Gradients are grouped into buckets of about 1 MB in the order backward produces them (the
last layer first). As soon as every gradient of a bucket has arrived, the bucket is flattened
and its all-reduce launched without waiting: communication overlaps the rest of backward.
finish() waits for the buckets and copies the means back.

    paralab train examples/strategies/bucketed_ddp.py --workers 2 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --check
"""
from contextlib import contextmanager

import torch

from paralab.strategies.replicas import Replicas

BUCKET_BYTES = 1 << 20


class BucketedDDP(Replicas):
    def __init__(self, *args):
        super().__init__(*args)
        self.buckets, size = [[]], 0
        for p in reversed(self.params):  # backward reaches the last layers first
            if size > BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.syncing = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.arrived)

    @contextmanager
    def last_backward(self):  # only the step's last backward exchanges (earlier ones accumulate)
        self.syncing, self.waiting, self.flat = True, [len(b) for b in self.buckets], {}
        yield
        self.syncing = False

    def arrived(self, p):
        if not self.syncing:
            return
        b = self.bucket_of[p]
        self.waiting[b] -= 1
        if self.waiting[b] == 0:  # the whole bucket is here: send it while backward goes on
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[b]])
            self.flat[b] = (flat, self.comm.all_reduce(flat, async_op=True))

    @torch.no_grad()
    def finish(self):
        for b, bucket in enumerate(self.buckets):
            flat, pending = self.flat[b]
            pending.wait()
            for q, mean in zip(bucket, (flat / self.comm.world).split([q.numel() for q in bucket])):
                q.grad.copy_(mean.view_as(q))
