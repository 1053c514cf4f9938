"""One executor for every schedule: it runs a rank's action list for one training step.

For each action of ``actions.Action``:

- ``recv_act`` / ``recv_grad``: wait for the tensor from the neighbouring stage.
  Receives are posted ahead (``irecv``, one per channel: when one arrives the
  next receive on the same channel is posted), so a transfer can land while
  this rank computes; the time blocked in the wait is an ``idle`` span.
- ``forward`` / ``backward``: run a stage on a microbatch (``compute`` spans
  named ``forward`` / ``backward`` with ``mb=i`` and ``stage=s``). The last
  stage computes the microbatch's loss in its forward and weights it by the
  microbatch's share of the batch.
- ``backward_input`` / ``backward_weight`` (zero-bubble ``I`` and ``W``): the
  backward in two parts, spans of those names; the input gradient is ready
  to send after ``I``, the weight gradients are complete after ``W``.
- ``send_act`` / ``send_grad``: post an ``isend`` and go on; every send is
  waited for at the end of the step (``comm`` spans ``wait:send_*``).

Under ``--recompute``, a forward whose backward is the rank's next compute
(``backward_next``) keeps everything: a recompute would free nothing.

A rank may hold several stages (``interleaved-1f1b``); a tensor passed
between two stages of the same rank is handed over in memory. Each stage's
last action that completes its weight gradients runs inside
``last_backward(stage)``, the stage's data-parallel flavour's context
(``replicas.py``). Peers are pipeline ranks, mapped to global ranks by the
pipeline's Comm; receives are posted in the order the peer sends
(checked by ``simulate.simulate``).

Shapes are known ahead: a microbatch of ``n`` samples crosses the boundary in
front of stage ``s`` as ``(n, *stages[s].in_shape)`` and behind it as
``(n, *stages[s].out_shape)``, in the run's dtype.

Why receives are posted this way: docs/pipelines.md#the-executor
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch

from ...training import recompute
from .actions import Action, Kind, message_of


def backward_next(actions: list[Action]) -> set[int]:
    """The forwards (positions in ``actions``) whose next compute on this rank is the same microbatch's
    backward (B or I) on the same stage: every microbatch of the last stage under 1F1B or ZB-H1 (GPipe
    runs backward in microbatch order, so none). Recomputing them would free nothing
    (``training/recompute.py``)."""
    compute = [(n, a) for n, a in enumerate(actions) if a.kind is Kind.FORWARD or a.kind in BACKWARDS]
    return {n for (n, a), (_, b) in zip(compute, compute[1:]) if a.kind is Kind.FORWARD
            and b.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and (b.stage, b.microbatch) == (a.stage, a.microbatch)}


BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class Executor:
    def __init__(self, comm, recorder, device: torch.device, autocast, dtype: torch.dtype = torch.float32):
        self.comm, self.rec, self.device, self.autocast = comm, recorder, device, autocast
        self.dtype = dtype  # what crosses between stages: the parameters' dtype (bf16 autocast: fp32)

    def run(self, stages: dict, actions: list[Action], chunks: list[tuple[torch.Tensor, torch.Tensor, float]],
            last_backward=lambda stage: nullcontext()) -> float | None:
        """Run ``actions`` on this rank's ``stages`` ({stage index: Stage}) for the microbatches
        ``chunks`` ((x, y, weight) each).

        ``last_backward(s)``: a context manager entered around the action that
        completes stage ``s``'s gradients for the step. Returns the batch's mean
        loss on the rank holding the last stage (weighted sum of the microbatch
        losses), None elsewhere.
        """
        sizes = [len(ys) for _, ys, _ in chunks]
        last_stage = next((s for s, st in stages.items() if st.last), None)
        completes = {a.stage: n for n, a in enumerate(actions) if a.kind.completes_weights}
        finals = {n: s for s, n in completes.items()}
        split = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.BACKWARD_INPUT}  # I and W, not B
        straight = backward_next(actions)  # --recompute: a forward whose backward comes next keeps everything
        received: dict[tuple, torch.Tensor] = {}   # messages in, by (channel, consuming stage, mb)
        held: dict[tuple, torch.Tensor] = {}       # produced here: to send, or for a stage of this rank
        losses: dict[int, torch.Tensor] = {}       # weighted microbatch losses (last stage)
        loss_sum = torch.zeros((), device=self.device, dtype=self.dtype) if last_stage is not None else None
        sends = []

        upcoming: dict[int, deque] = {}
        for a in actions:
            if a.kind.is_recv:
                upcoming.setdefault(a.peer, deque()).append(a)
        posted = {}

        def post_next(peer: int) -> None:
            if upcoming[peer]:
                a = upcoming[peer].popleft()
                st = stages[a.stage]
                per_sample = st.in_shape if a.kind is Kind.RECV_ACT else st.out_shape
                buf = torch.empty((sizes[a.microbatch],) + per_sample, device=self.device, dtype=self.dtype)
                posted[peer] = (a, self.comm.irecv(buf, a.peer, name=a.kind.value), buf)

        for peer in upcoming:
            post_next(peer)

        def incoming(channel: str, s: int, i: int) -> torch.Tensor:
            """What stage ``s`` needs for microbatch ``i``: from a stage of this rank, or received."""
            key = (channel, s, i)
            return held.pop(key) if key in held else received.pop(key)

        def produced(channel: str, to_stage: int, i: int, t: torch.Tensor) -> None:
            held[(channel, to_stage, i)] = t.detach().to(self.dtype) if channel == "act" else t.to(self.dtype)

        for n, a in enumerate(actions):
            i, s = a.microbatch, a.stage
            if a.kind.is_recv:
                expected, pending, buf = posted.pop(a.peer)
                if expected != a:
                    raise RuntimeError(f"receives out of order from rank {a.peer}: {a.label()} vs {expected.label()}")
                pending.wait(category="idle", mb=i)
                post_next(a.peer)
                received[message_of(a)] = buf
            elif a.kind is Kind.FORWARD:
                st = stages[s]
                xs, ys, weight = chunks[i]
                inp = xs if st.first else incoming("act", s, i)
                with self.rec.span("compute", "forward", mb=i, stage=s), \
                        recompute.suspended() if n in straight else nullcontext():
                    out = st.forward(i, inp, split=(s, i) in split, weight=weight)
                    if st.last:
                        with self.autocast():
                            losses[i] = st.ctx.loss(out, ys) * weight  # tensor parallelism's loss where it applies
                        loss_sum += losses[i].detach().to(self.dtype)  # fp64 runs report it unrounded
                if not st.last:
                    produced("act", s + 1, i, out)
            elif a.kind.is_send:
                t = held.pop(message_of(a)).contiguous()
                sends.append((self.comm.isend(t, a.peer, name=a.kind.value), t))
            elif a.kind in BACKWARDS:
                st = stages[s]
                with last_backward(s) if n in finals else nullcontext():
                    with self.rec.span("compute", a.kind.value, mb=i, stage=s):
                        if a.kind is Kind.BACKWARD_WEIGHT:
                            st.backward_weight(i)
                            continue
                        run = st.backward if a.kind is Kind.BACKWARD else st.backward_input
                        if st.last:
                            g = run(i, loss=losses.pop(i))
                        else:
                            g = run(i, grad_output=incoming("grad", s, i))
                if not st.first:
                    produced("grad", s - 1, i, g)
            else:
                raise ValueError(f"unknown action {a}")

        for pending, _ in sends:  # keep each tensor alive until its send is done
            pending.wait()
        leftover = [k for k, v in (("received", received), ("held", held), ("losses", losses),
                                   ("posted", posted)) if v]
        if leftover or any(st.alive() for st in stages.values()):
            raise RuntimeError(f"schedule left work undone on this rank: {leftover or 'activations'}")
        return float(loss_sum) if loss_sum is not None else None
