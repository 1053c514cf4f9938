"""``--check`` of a compressed run: the same compression in one process, every replica's gradient
kept apart and combined in rank order, so the reference rounds as the ranks do.
"""
from __future__ import annotations

import torch

from .lowrank import compressible, initial_q, matrix_shape, orthonormalize_
from .methods import WIRE_DTYPES


def reference_for(options, replicas: int) -> ReferenceCompression | None:
    """The reference's compression for a run's ``options`` over ``replicas`` shards; None where the
    run sends its gradients as they are (the reference then averages exactly)."""
    if getattr(options, "compress", "none") == "none":
        return None
    return ReferenceCompression(options, replicas)


class ReferenceCompression:
    """The same compression, applied in one process to every replica's gradients (``--check``).

    ``combine(per_replica)``: ``per_replica[r][i]`` is replica r's gradient of parameter i divided by
    N (its share of the loss); returns, per parameter, what every rank's bucket holds after the
    compressed exchange. State (PowerSGD's Q and each replica's error) is kept between steps.

    Its sums run in rank order instead of gloo's, which for 2 replicas is the same arithmetic
    exactly (a sum of two numbers does not depend on the order) and for PowerSGD differs from it
    by rounding only. An fp16/bf16 sum of more than 2 values depends on gloo's order in the narrow
    type, which is not replayed: :func:`validate_buckets` refuses that ``--check``.
    """

    def __init__(self, options, replicas: int):
        self.options, self.n = options, replicas
        self.steps = 0
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[tuple[int, int], torch.Tensor] = {}

    def describe(self) -> str:
        o = self.options
        if o.compress in WIRE_DTYPES:
            return (f"--compress {o.compress}: each replica's gradient share rounded to {o.compress}, summed, "
                    f"the sum rounded to {o.compress}")
        return (f"--compress powersgd: rank {o.powersgd_rank} with error feedback and warm start after "
                f"{o.powersgd_start_iter} uncompressed step(s), the same low-rank arithmetic per tensor")

    def caveat(self) -> str:
        """What ``--check`` says before it compares: this is not plain training's arithmetic."""
        return (f"--compress {self.options.compress} changes the arithmetic (the gradients are not averaged "
                "exactly), so this is not a comparison with plain training: the reference applies the same "
                "compression")

    def state(self) -> tuple:
        """What it carries from step to step (a copy): the steps, Q and the errors."""
        return (self.steps, {k: v.clone() for k, v in self.q.items()}, {k: v.clone() for k, v in self.error.items()})

    def restore(self, state: tuple) -> None:
        self.steps, self.q, self.error = state[0], dict(state[1]), dict(state[2])

    @torch.no_grad()
    def combine(self, per_replica: list[list[torch.Tensor]], scale: float = 1.0) -> list[torch.Tensor]:
        """``scale``: the loss scale the gradients carry (fp16); PowerSGD's error is kept without it."""
        o, n = self.options, self.n
        out = []
        for i in range(len(per_replica[0])):
            grads = [per_replica[r][i] for r in range(n)]
            dtype = grads[0].dtype
            if o.compress in WIRE_DTYPES:
                wire = WIRE_DTYPES[o.compress]
                total = grads[0].to(wire).float()
                for g in grads[1:]:
                    total = total + g.to(wire).float()
                out.append(total.to(wire).to(dtype))
            elif o.compress == "powersgd" and self.steps >= o.powersgd_start_iter \
                    and compressible(grads[0].shape, o.powersgd_rank):
                out.append(self._powersgd(i, grads, scale))
            else:
                total = grads[0].clone()
                for g in grads[1:]:
                    total += g
                out.append(total)
        self.steps += 1
        return out

    def _powersgd(self, i: int, grads: list[torch.Tensor], scale: float) -> torch.Tensor:
        rank, shape = self.options.powersgd_rank, grads[0].shape
        if i not in self.q:
            self.q[i] = initial_q(shape, rank, grads[0].dtype).to(grads[0].device)
        ms = []
        for r, g in enumerate(grads):
            e = self.error.setdefault((r, i), torch.zeros_like(g))
            ms.append(g.add(e, alpha=scale).view(matrix_shape(shape)))
        p = ms[0] @ self.q[i]
        for m in ms[1:]:
            p = p + m @ self.q[i]
        orthonormalize_(p)
        q = ms[0].t() @ p
        for m in ms[1:]:
            q = q + m.t() @ p
        approx = p @ q.t()
        for r, m in enumerate(ms):
            self.error[(r, i)] = (m - approx / self.n).view(shape) / scale
        self.q[i] = q
        return approx.view(shape)
