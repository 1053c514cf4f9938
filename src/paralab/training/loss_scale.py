"""fp16's dynamic loss scaling (``--precision fp16``), under every layout that clips.

Under fp16 autocast the matmuls and convolutions run in float16, whose 5-bit
exponent flushes values below about 6e-8 to zero: a small loss's activation
gradients underflow and their weights learn nothing. So the loss's gradient
is multiplied by a scale ``S`` before backward (every gradient is then ``S``
times larger, far from the underflow), and every gradient is divided by ``S``
again once the step's gradients are synchronised, before the norm, clipping
and the optimizer see them. ``S`` is a power of two, so both are exact. A
scale too large overflows instead: some gradient is ``inf``. Then the step's
update is skipped on every rank and ``S`` halves; after ``INTERVAL`` steps in
a row without an overflow it doubles. This is ``torch.amp.GradScaler``'s rule
with its default constants; the check's reference uses torch's own
``GradScaler`` (``check/reference.py``), so the two are compared.

Where it sits in a layout: :meth:`LossScale.scaled` is applied by
``Context.loss`` (the loss a step minimises: identity in forward, ``x S`` in
backward, so the loss a rank reports is unscaled), and
``Strategy.clip_gradients`` unscales what each rank holds (``held_gradients``,
one division per tensor per rank), learns from its one all-reduce whether any
rank's gradient is not finite, and skips and updates the scale alike on
every rank. A mixture of experts' load-balancing losses join the gradients
through the same scale (``Context.scaled``). A checkpoint keeps the scale and
the count, so a resumed run continues the same sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: torch.amp.GradScaler's defaults: the first scale, and how it grows and backs off
INIT = 2.0 ** 16
GROWTH = 2.0
BACKOFF = 0.5
INTERVAL = 2000


class _ScaleGrad(torch.autograd.Function):
    """The identity in forward; the incoming gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@dataclass
class LossScale:
    """The scale now and the overflow-free steps since it last changed (the same on every rank)."""
    scale: float = INIT
    good_steps: int = 0

    def scaled(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``loss``, whose gradient in backward is ``scale`` (x ``share``) times what it would be."""
        return _ScaleGrad.apply(loss, self.scale * share)

    @torch.no_grad()
    def unscale_(self, grads) -> None:
        """Divide each gradient by the scale, in place (a multiplication by its reciprocal, as torch's)."""
        inverse = 1.0 / self.scale  # a power of two: exact
        for g in grads:
            g.mul_(inverse)

    def update(self, overflowed: bool) -> str:
        """After a step: halve the scale where a gradient overflowed, double it after ``INTERVAL`` good steps
        in a row. Returns what changed, for the step's record ("" where nothing did)."""
        if overflowed:
            before, self.scale, self.good_steps = self.scale, self.scale * BACKOFF, 0
            return f"fp16 loss scale {before:g} -> {self.scale:g}"
        self.good_steps += 1
        if self.good_steps == INTERVAL:
            self.scale, self.good_steps = self.scale * GROWTH, 0
        return ""

    def state_dict(self) -> list[float]:
        return [self.scale, float(self.good_steps)]

    def load_state_dict(self, state) -> None:
        self.scale, self.good_steps = float(state[0]), int(state[1])


def torch_scaler(device: torch.device, state: list | None = None) -> torch.amp.GradScaler:
    """torch's own GradScaler with the same constants (the check's reference uses it), from ``state`` (a
    :meth:`LossScale.state_dict`: where a resumed run's scale stands) where given."""
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT, growth_factor=GROWTH, backoff_factor=BACKOFF,
                                  growth_interval=INTERVAL)
    if state is not None:
        set_scaler(scaler, state)
    return scaler


def scaler_state(scaler: torch.amp.GradScaler) -> list[float]:
    """A GradScaler's scale and count of good steps, as :meth:`LossScale.state_dict` holds them."""
    return [scaler.get_scale(), float(scaler.state_dict()["_growth_tracker"])]


def set_scaler(scaler: torch.amp.GradScaler, state) -> None:
    """A GradScaler's scale and count of good steps set to ``state`` (a :meth:`LossScale.state_dict`)."""
    scaler.load_state_dict({**scaler.state_dict(), "scale": float(state[0]), "_growth_tracker": int(state[1])})
