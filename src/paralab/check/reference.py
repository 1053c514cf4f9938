"""The single-process reference, and the comparisons behind ``--check``.

The reference trains the plain model in one process on the *same global
batches* as the strategy, replaying the strategy's own batch split:

- Without BatchNorm (``--norm none``) splitting cannot change the arithmetic
  beyond rounding, so the reference is the classic one: one forward and
  backward on the whole global batch.
- With BatchNorm, normalisation statistics depend on which samples share a
  forward pass. The reference therefore runs forward on each data-parallel
  shard (and each microbatch within it) separately and weights each loss by
  its share of the samples, exactly as the strategy does. Running statistics
  follow the strategy's declared ``bn_rule``:
    * ``first-replica`` (data parallelism, as PyTorch DDP: rank 0's buffers are
      authoritative): statistics come from shard 0's microbatches only;
    * ``sequential`` (model/pipeline parallelism): one module sees every
      microbatch in order, so statistics are updated once per microbatch.

Tolerances (``TOLERANCES``, absolute, ``rtol=0``), by ``--precision``:

- fp32: weights ``1e-5``, outputs ``1e-4``: for the course setting (a few
  steps at a small learning rate, e.g. ``--num-batches 2 --lr 1e-3``);
- fp64 (model, collectives, optimizer state and reference all in float64):
  weights ``1e-9``, outputs ``1e-8``.

Where a strategy performs the very same operations as the reference (e.g.
per-parameter all-reduce over 2 workers) the deviation is 0. With Adam and
BatchNorm, check with ``--norm none``.

Why these tolerances, and what fp32 cannot verify: docs/correctness.md#fp64-real-settings
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.loader import to_device
from ..training.losses import cross_entropy
from ..training.lr_schedule import set_lr
from ..models.moe import moe_layers
from ..strategies.base import has_batchnorm, split_microbatches, take_history, training_loss

TOLERANCES = {"fp32": {"weights": 1e-5, "outputs": 1e-4},
              "fp64": {"weights": 1e-9, "outputs": 1e-8}}


def reference_train(model, optimizer, source_batch, steps: int, replicas: int, microbatches: int,
                    bn_rule: str, lr_for=None, first_step: int = 0, combine=None) -> list[float]:
    """Train ``model`` on steps ``first_step .. steps - 1``; ``source_batch(step, rank)`` gives shard
    ``rank`` (images cast to the model's dtype here, tokens kept integer); ``lr_for(step)`` is the learning-rate schedule (None:
    keep the optimizer's).

    ``combine`` (gradient compression: ``compression.reference_for``): each shard's gradient is kept
    apart (its share of the loss, as a rank's bucket holds it) and ``combine(per_shard)`` gives the
    gradient the optimizer uses, as the compressed exchange leaves it on every rank.
    """
    losses = []
    # a mixture of experts routes, drops and balances over the tokens of one forward: replay the split too
    split = has_batchnorm(model) or combine is not None or bool(moe_layers(model))
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = next(model.parameters()).dtype
    for step in range(first_step, steps):
        if lr_for is not None:
            set_lr([optimizer], lr_for(step))
        shards = [(to_device(x, x.device, dtype), y) for x, y in (source_batch(step, r) for r in range(replicas))]
        model.train()
        if not split:
            x = torch.cat([s[0] for s in shards])
            y = torch.cat([s[1] for s in shards])
            loss = training_loss(cross_entropy, model, model(x), y)
            loss.backward()
            losses.append(loss.item())
        else:
            total = sum(len(s[1]) for s in shards)
            kept_buffers = None
            step_loss = 0.0
            per_shard = []
            for r, (x, y) in enumerate(shards):
                for xs, ys, w in split_microbatches(x, y, microbatches):
                    weight = w * len(y) / total
                    loss = training_loss(cross_entropy, model, model(xs), ys)
                    (loss * weight).backward()
                    step_loss += loss.item() * weight
                if r == 0 and bn_rule == "first-replica":
                    kept_buffers = [b.detach().clone() for b in model.buffers()]
                if combine is not None:  # this shard's gradient, apart from the others'
                    per_shard.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                      for p in params])
                    optimizer.zero_grad(set_to_none=True)
            if combine is not None:
                for p, g in zip(params, combine(per_shard)):
                    p.grad = g
            if kept_buffers is not None:
                with torch.no_grad():
                    for b, kept in zip(model.buffers(), kept_buffers):
                        b.copy_(kept)
            losses.append(step_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        take_history(model)  # the reference keeps no routing records
    return losses


@dataclass
class Comparison:
    what: str           # "weights" | "outputs" | "replicas"
    max_abs: float      # largest absolute deviation
    worst: str          # name of the tensor where it occurred
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return f"{self.what}: {verdict} max |diff| {self.max_abs:.3e} at {self.worst} (atol {self.atol:g})"


def compare_tensors(what: str, mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                    atol: float) -> Comparison:
    missing = set(ref) ^ set(mine)
    if missing:
        return Comparison(what, float("inf"), f"keys differ: {sorted(missing)[:4]}", atol)
    worst, worst_name = 0.0, "-"
    for name, r in ref.items():
        m, r = mine[name].detach().cpu(), r.detach().cpu()
        if m.shape != r.shape:
            return Comparison(what, float("inf"), f"{name} shape {tuple(m.shape)} vs {tuple(r.shape)}", atol)
        if not r.is_floating_point():
            dev = float((m.long() - r.long()).abs().max()) if r.numel() else 0.0
        else:
            dev = float((m.double() - r.double()).abs().max()) if r.numel() else 0.0
        if dev != dev:  # NaN
            dev = float("inf")
        if dev > worst or worst_name == "-":
            worst, worst_name = dev, name
    return Comparison(what, worst, worst_name, atol)
