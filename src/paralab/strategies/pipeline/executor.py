"""One executor for every schedule: it runs a rank's action list for one training step.

For each action of ``schedules.Action``:

- ``recv_act`` / ``recv_grad``: wait for the tensor from the neighbouring stage.
  Receives are posted ahead (``irecv``, one per channel: when one arrives the
  next receive on the same channel is posted), so a transfer can land while
  this rank computes; the time spent blocked in the wait is an ``idle`` span
  (the rank has nothing else to do; it includes the transfer when that was
  not hidden).
- ``forward`` / ``backward``: run the stage on a microbatch (``compute`` spans
  named ``forward`` / ``backward`` with ``mb=i``). The last stage computes the
  microbatch's loss in its forward and weights it by the microbatch's share of
  the batch, so the gradients add up to those of the batch's mean loss.
- ``send_act`` / ``send_grad``: post an ``isend`` and go on; every send is
  waited for at the end of the step (``comm`` spans ``wait:send_*``).

The stage's last backward of the step (the one that completes its
gradients) runs inside ``last_backward()``, the data-parallel flavour's
context (``replicas.py``): there a flavour that overlaps its all-reduce with
backward (``ddp``, ``torch-ddp``) launches it; the earlier microbatches only
accumulate. Peers are pipeline ranks (stage indices); the pipeline's Comm
maps them to global ranks.

Shapes are known ahead: a microbatch of ``n`` samples crosses the boundary in
front of the stage as ``(n, *stage.in_shape)`` and behind it as
``(n, *stage.out_shape)``, in fp32.
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch

from ...losses import cross_entropy
from .schedules import Action, Kind


class Executor:
    def __init__(self, comm, recorder, device: torch.device, autocast, dtype: torch.dtype = torch.float32):
        self.comm, self.rec, self.device, self.autocast = comm, recorder, device, autocast
        self.dtype = dtype  # what crosses between stages: the parameters' dtype (bf16 autocast: fp32)

    def run(self, stage, actions: list[Action], chunks: list[tuple[torch.Tensor, torch.Tensor, float]],
            last_backward=nullcontext) -> float | None:
        """Run ``actions`` on ``stage`` for the microbatches ``chunks`` ((x, y, weight) each).

        ``last_backward``: a context-manager factory entered around the final
        backward action. Returns the batch's mean loss on the last stage
        (weighted sum of the microbatch losses), None elsewhere.
        """
        sizes = [len(ys) for _, ys, _ in chunks]
        final_backward = max(n for n, a in enumerate(actions) if a.kind is Kind.BACKWARD)
        received: dict[tuple[Kind, int], torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}       # forward results waiting to be sent
        grad_inputs: dict[int, torch.Tensor] = {}   # input gradients waiting to be sent
        losses: dict[int, torch.Tensor] = {}        # weighted microbatch losses (last stage)
        loss_sum = torch.zeros((), device=self.device) if stage.last else None
        sends = []

        upcoming = {kind: deque(a for a in actions if a.kind is kind) for kind in (Kind.RECV_ACT, Kind.RECV_GRAD)}
        posted = {}

        def post_next(kind: Kind) -> None:
            if upcoming[kind]:
                a = upcoming[kind].popleft()
                per_sample = stage.in_shape if kind is Kind.RECV_ACT else stage.out_shape
                buf = torch.empty((sizes[a.microbatch],) + per_sample, device=self.device, dtype=self.dtype)
                posted[(kind, a.microbatch)] = (self.comm.irecv(buf, a.peer, name=kind.value), buf)

        for kind in upcoming:
            post_next(kind)

        for n, a in enumerate(actions):
            i = a.microbatch
            if a.kind.is_recv:
                pending, buf = posted.pop((a.kind, i))
                pending.wait(category="idle", mb=i)
                post_next(a.kind)
                received[(a.kind, i)] = buf
            elif a.kind is Kind.FORWARD:
                xs, ys, weight = chunks[i]
                inp = xs if stage.first else received.pop((Kind.RECV_ACT, i))
                with self.rec.span("compute", "forward", mb=i):
                    out = stage.forward(i, inp)
                    if stage.last:
                        with self.autocast():
                            losses[i] = cross_entropy(out, ys) * weight
                        loss_sum += losses[i].detach().float()
                if not stage.last:
                    outputs[i] = out
            elif a.kind is Kind.SEND_ACT:
                t = outputs.pop(i).detach().to(self.dtype).contiguous()
                sends.append((self.comm.isend(t, a.peer, name="send_act"), t))
            elif a.kind is Kind.BACKWARD:
                with last_backward() if n == final_backward else nullcontext():
                    with self.rec.span("compute", "backward", mb=i):
                        if stage.last:
                            g = stage.backward(i, loss=losses.pop(i))
                        else:
                            g = stage.backward(i, grad_output=received.pop((Kind.RECV_GRAD, i)))
                if not stage.first:
                    grad_inputs[i] = g
            elif a.kind is Kind.SEND_GRAD:
                t = grad_inputs.pop(i).to(self.dtype).contiguous()
                sends.append((self.comm.isend(t, a.peer, name="send_grad"), t))
            else:
                raise ValueError(f"unknown action {a}")

        for pending, _ in sends:  # keep each tensor alive until its send is done
            pending.wait()
        leftover = [k for k, v in (("received", received), ("outputs", outputs), ("gradients", grad_inputs),
                                   ("losses", losses), ("posted", posted)) if v]
        if leftover or stage.alive():
            raise RuntimeError(f"schedule left work undone on this stage: {leftover or 'activations'}")
        return float(loss_sum) if loss_sum is not None else None
