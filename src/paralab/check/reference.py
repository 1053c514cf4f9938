"""The single-process reference, and the comparisons behind ``--check``.

The reference trains the plain model in one process on the *same global
batches* as the strategy, replaying the strategy's own batch split where it
matters:

- Without BatchNorm (``--norm none``) splitting cannot change the arithmetic
  beyond rounding, so the reference is the classic one: one forward and
  backward on the whole global batch. But two data-parallel shards of one
  microbatch each are replayed one by one (not over documents, whose loss
  over the whole batch is ``F.cross_entropy``'s own): every correct
  all-reduce of two gradients adds them bit for bit as the reference does,
  so below fp64 such a run is exact, not within a noise band.
- With BatchNorm, normalisation statistics depend on which samples share a
  forward pass. The reference therefore runs forward on each data-parallel
  shard (and each microbatch within it) separately and weights each loss by
  its share of the samples, exactly as the strategy does. Running statistics
  follow the strategy's declared ``bn_rule``:
    * ``first-replica`` (data parallelism, as PyTorch DDP: rank 0's buffers are
      authoritative): statistics come from shard 0's microbatches only;
    * ``sequential`` (model/pipeline parallelism): one module sees every
      microbatch in order, so statistics are updated once per microbatch.

What is compared, and how far apart it may be (``TOLERANCES``, absolute, ``rtol=0``): the weights and
buffers and every parameter's optimizer state after each checked step (fp64 ``1e-9``), the training loss of
every step as each rank reports it against its shard's loss in the reference (``1e-8``), under
``--clip-grad`` the whole model's gradient norm of every step (``1e-10``: torch's ``clip_grad_norm_`` on the
reference's gradient), and the next batch's logits at the end (``1e-8``). Without ``--precision`` a check runs
in fp64 and these decide. Below fp64 (``--precision fp32|bf16|fp16``) they say only "exact": each compared tensor
is judged against a noise band measured for the run (``check/band.py``). The fp32 row is the course
setting's fixed tolerance, which the grader's own comparison of a submission's weights still uses
(``grading/weights.py``).

Where a strategy performs the very same operations as the reference (e.g.
per-parameter all-reduce over 2 workers) the deviation is 0. With Adam and
BatchNorm, check with ``--norm none``.

Why these tolerances, and what a check cannot see: docs/correctness.md
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.documents import IGNORE
from ..data.loader import to_device
from ..training import step as steps
from ..training.loss_scale import scaler_state, set_scaler
from ..training.losses import cross_entropy
from ..training.lr_schedule import REFERENCE_BATCH, LRSchedule, set_lr

from ..models.moe import moe_layers
from ..strategies.base import has_batchnorm, take_history, training_loss
from ..strategies.portable import optimizer_by_name

#: what a check compares, and how far (absolute, ``rtol=0``) each may be from the reference to be exact:
#: ``weights`` (and buffers) and ``optimizer`` state after a checked step, each step's training ``loss``
#: as every rank reports it, and the next batch's ``outputs`` (logits) at the end. fp64's decide an fp64
#: check and say "exact" below it (where a band decides: check/band.py); fp32's are the course setting's,
#: which the grader's weights comparison uses. Why these values: docs/correctness.md
TOLERANCES = {"fp32": {"weights": 1e-5, "optimizer": 1e-4, "loss": 1e-4, "grad_norm": 1e-4, "outputs": 1e-4},
              "fp64": {"weights": 1e-9, "optimizer": 1e-9, "loss": 1e-8, "grad_norm": 1e-10, "outputs": 1e-8}}


class TorchSchedule:
    """A run's learning-rate schedule (:class:`~paralab.training.lr_schedule.LRSchedule`'s options) rebuilt from
    torch's own schedulers (``torch.optim.lr_scheduler``), stepped on an optimizer of its own: what the
    reference trains with, so the run's schedule code is checked rather than shared (an off-by-one in its
    warm-up moves the run's weights and not the reference's). ``schedule(step)`` is step ``step``'s rate.

    - constant: the target is ``lr x global batch / 256`` under ``--lr-scaling linear``, else ``lr``; a warm-up
      of W steps is ``LinearLR`` from ``lr`` to the target over W steps, then ``ConstantLR`` at the target from
      step ceil(W) (both as factors of the larger of ``lr`` and the target: torch's factors lie in [0, 1]);
    - cosine: ``LinearLR`` from target / W to the target over steps 0 .. W-1, then ``CosineAnnealingLR`` down to
      ``min_lr`` over the T - W steps left (W = 0: the cosine alone).

    :func:`expressible` says whether torch's schedulers can express a schedule at all: a cosine warm-up of a
    fractional number of steps they cannot (the reference then uses the run's, and the check says so)."""

    def __init__(self, schedule: LRSchedule):
        from torch.optim import lr_scheduler as S
        self.rates: list[float] = []
        w = schedule.warmup_steps
        target = schedule.lr * schedule.global_batch / REFERENCE_BATCH if schedule.scaling == "linear" else schedule.lr
        top = max(schedule.lr, target) if schedule.kind == "constant" and w > 0 else target  # the factors' 1
        self.optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=top)
        with warnings.catch_warnings():  # SequentialLR steps the next scheduler with an epoch, which torch deprecates
            warnings.simplefilter("ignore")
            if schedule.kind == "cosine":
                cosine = S.CosineAnnealingLR(self.optimizer, T_max=schedule.total_steps - int(w),
                                             eta_min=schedule.min_lr)
                self.scheduler = cosine if w == 0 else S.SequentialLR(self.optimizer, [
                    S.LinearLR(self.optimizer, start_factor=1 / w, end_factor=1.0, total_iters=int(w) - 1), cosine],
                    milestones=[int(w)])
            elif w > 0:
                ramp = S.LinearLR(self.optimizer, start_factor=schedule.lr / top, end_factor=target / top,
                                  total_iters=w)
                held = S.ConstantLR(self.optimizer, factor=target / top, total_iters=2 ** 62)
                self.scheduler = S.SequentialLR(self.optimizer, [ramp, held], milestones=[math.ceil(w)])
            else:
                self.scheduler = None  # the target throughout

    @staticmethod
    def expressible(schedule: LRSchedule) -> bool:
        return schedule.kind != "cosine" or float(schedule.warmup_steps).is_integer()

    def __call__(self, step: int) -> float:
        while len(self.rates) <= step:  # stepped as far as asked, once
            self.rates.append(self.optimizer.param_groups[0]["lr"])
            if self.scheduler is not None:
                self.optimizer.step()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.scheduler.step()
        return self.rates[step]


@dataclass
class Replay:
    """How the reference replays a run's steps (``Reference`` fills it from the strategy and the run).

    - ``replicas`` x ``microbatches``: the strategy's data-parallel shards and the microbatches inside each;
      ``bn_rule``: its BatchNorm rule (the module's docstring);
    - ``compression`` (``compression.reference_for``): each shard's gradient is kept apart (its share of the
      loss, as a rank's bucket holds it) and ``compression.combine(per_shard, scale)`` gives the gradient the
      optimizer uses, as the compressed exchange leaves it on every rank (``scale``: fp16's loss scale, which
      the shards' gradients carry); a skipped step leaves what it carries as it was (``state``/``restore``), as
      the run's ddp does;
    - ``seed``: the run's, from which the gpt's dropout masks are drawn (``models/dropout.py``: each forward says
      where its samples sit in the global batch, so the masks are the run's whatever the split);
    - ``clip`` (``--clip-grad``): the gradient clipped to that norm by torch's ``clip_grad_norm_`` before each
      step;
    - ``packing``: documents (``data/documents.py``), packed (True) or padded (False); None: not documents. The
      loss is then the step's sum over valid targets over their global count, and packed rows attend within
      their documents (``training/step.py``), as every layout does;
    - ``autocast``: the forwards run under ``torch.autocast`` to that dtype (``--precision bf16|fp16``), as the
      run's; ``scaler`` (fp16): torch's own ``GradScaler`` scales each backward's loss, unscales the gradient
      before clipping and skips a step whose gradient overflowed, as the run's loss scale must
      (``training/loss_scale.py``), each step's (scale, skipped) written into ``scales``; without a scaler,
      ``scales`` given (the noise band's references under fp16): that scale and that skip followed, so that
      the band measures rounding, not one reference skipping a step another took; ``run`` (fp16, the
      reference the run is compared with): per step, whether the run skipped it and its loss scale after it
      (``Check.saw``). Where the scaler decides otherwise than the run (an overflow is a threshold that
      rounding can cross) it follows the run, skipping where the run skipped, its state set to the run's,
      and says so in ``scales`` (a third element: what it followed);
    - ``perturb``: one change a correct layout may make to the arithmetic, for the noise band
      (``check/band.py``): ``"reordered"``, each step's gradient added up in another order (the global batch cut
      into more pieces, added last first; the shards' gradients added last first and weighted after);
      ``"rounded"``, each gradient rounded once more (by up to ``unit`` of its size, element by element, from a
      generator seeded per step; or each shard's gradient and their sum through ``wire``, a strategy's narrower
      gradient dtype, where it has one).
    """
    replicas: int = 1
    microbatches: int = 1
    bn_rule: str = "first-replica"
    compression: object | None = None
    seed: int = 0
    clip: float | None = None
    packing: bool | None = None
    autocast: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    scales: dict | None = None
    run: dict | None = None
    perturb: str | None = None
    unit: float = 0.0
    wire: torch.dtype | None = None

    @property
    def wired(self) -> bool:
        """Each shard's gradient rounded through a strategy's own lossy wire before they are added."""
        return self.perturb == "rounded" and self.wire is not None


def reference_train(model, optimizer, source_batch, until: int, how: Replay, lr_for=None, first_step: int = 0,
                    norms: dict | None = None) -> list[list[float]]:
    """Train ``model`` on steps ``first_step .. until - 1`` as ``how`` says; ``source_batch(step, rank)`` gives
    shard ``rank`` (images cast to the model's dtype here, tokens kept integer); ``lr_for(step)`` is the
    learning-rate schedule (None: keep the optimizer's); under ``--clip-grad`` each step's norm before clipping
    goes into ``norms`` (step -> norm). Returns, per step, each shard's training loss: the mean over its
    samples, what the rank holding that shard reports."""
    losses = []
    # BatchNorm's statistics depend on which samples share a forward, a mixture of experts routes, drops and
    # balances over the tokens of one forward, and compression (or a lossy wire) acts on each shard's gradient:
    # the shards must be replayed one by one. So are two shards of one microbatch each, for the rounding: their
    # sum is the one split any correct all-reduce adds bit for bit (a + b = b + a, halved exactly), so a
    # 2-worker data-parallel run below fp64 is exact, not within a band. Any other split adds in the layout's
    # own order, which the band measures (the reference replaying it would round nearer the run in some
    # places and not others). Not over documents: their loss over the whole batch is torch's own (the module
    # docstring), which is what catches a run's piece of it counting wrong. The noise band's reordered
    # reference cuts the batch otherwise, on purpose.
    batchnorm = has_batchnorm(model)
    # fp16: a backward's float16 weight gradients sum over the rows it holds, and a sum over twice the rows can
    # overflow where the run's microbatch or shard does not: the reference backs the same rows (not over
    # documents, above; nor the band's reordered reference, whose smaller pieces are its perturbation)
    fp16 = (how.scaler is not None or how.scales is not None) and how.packing is None and how.perturb != "reordered"
    must = batchnorm or how.compression is not None or bool(moe_layers(model)) or how.wired or fp16
    pair = how.replicas == 2 and how.microbatches == 1 and how.packing is None
    split = must or (pair and how.perturb != "reordered")
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device

    def forward(x):  # the logits; under autocast in float32, as autocast hands them to the run's cross-entropy
        with torch.autocast(device.type, dtype=how.autocast, enabled=how.autocast is not None):
            logits = model(x)
        return logits.float() if how.autocast is not None else logits

    for step in range(first_step, until):
        if lr_for is not None:
            set_lr([optimizer], lr_for(step))
        carried = how.compression.state() if how.compression is not None and how.scales is not None else None
        shards = [(to_device(x, x.device, dtype), y) for x, y in (source_batch(step, r) for r in range(how.replicas))]
        targets = None if how.packing is None else [y for _, y in shards]  # documents: the loss's global count
        model.train()
        if split:
            losses.append(_shards_step(model, optimizer, params, forward, shards, step, targets, how, batchnorm))
        elif how.perturb == "reordered":
            losses.append(_reordered_step(forward, shards, step, how.seed, targets, how.packing, _scale(how, step)))
        else:
            losses.append(_whole_step(forward, shards, step, how.seed, targets, how.packing, _scale(how, step)))
        if how.scaler is not None:  # fp16: the gradient unscaled (overflows found here)
            how.scaler.unscale_(optimizer)
        elif how.scales is not None:  # following another reference's scale
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / how.scales[step][0])
        if how.perturb == "rounded" and not how.wired:  # each gradient rounded once more, by up to unit of its size
            generator = torch.Generator().manual_seed(how.seed * 1_000_003 + step)
            for p in params:
                if p.grad is not None:
                    noise = torch.rand(p.grad.shape, generator=generator, dtype=p.grad.dtype)
                    p.grad.mul_(1 + how.unit * (2 * noise.to(p.grad.device) - 1))
        if how.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], how.clip)
            if norms is not None:
                norms[step] = norm.item()
        if how.scaler is not None:
            how.scales[step] = _scaler_step(how, optimizer, params, step)
        elif how.scales is not None and not how.scales[step][1] and not _finite(params):
            pass  # a band reference that overflowed where the reference did not cannot step (its band widens)
        elif how.scales is None or not how.scales[step][1]:
            optimizer.step()
        if how.scales is not None and how.scales[step][1] and norms is not None:
            norms.pop(step, None)  # fp16: a skipped step has no gradient norm (the run reports none either)
        if carried is not None and how.scales[step][1]:
            how.compression.restore(carried)  # a skipped step's compression undone, as the run's ddp does
        optimizer.zero_grad(set_to_none=True)
        take_history(model)  # the reference keeps no routing records
    return losses


def _scaler_step(how: Replay, optimizer, params, step: int) -> tuple:
    """fp16: the optimizer stepped by torch's GradScaler (its gradients unscaled already), or, where the run
    decided this step's overflow otherwise, as the run did. Returns (the scale of this step's loss, whether the
    step was skipped, what was followed or "")."""
    scale = how.scaler.get_scale()
    overflow = not _finite(params)  # as the scaler finds it
    run = (how.run or {}).get(step)
    if run is None or run[0] == overflow:
        how.scaler.step(optimizer)  # skipped where a gradient overflowed
        how.scaler.update()
        torch_state = scaler_state(how.scaler)
        if run is not None and list(map(float, run[1])) != torch_state:  # the run's scale is torch's, every step
            set_scaler(how.scaler, run[1])
            return scale, overflow, (f"step {step + 1}: the run's loss scale after it is {run[1][0]:g} "
                                     f"({int(run[1][1])} steps since it changed), torch's GradScaler's "
                                     f"{torch_state[0]:g} ({int(torch_state[1])}): {SCALE_DIFFERS}")
        return scale, overflow, ""
    how.scaler.update()  # the step closed for the scaler; its state is the run's from here
    set_scaler(how.scaler, run[1])
    if run[0]:  # the run's gradient overflowed, this one's did not: skipped, as the run did
        return scale, True, (f"step {step + 1}: the run's gradient overflowed at fp16 loss scale {scale:g} and the "
                             "reference's did not: an overflow is a threshold rounding can cross, so the reference "
                             "skipped that step too")
    return scale, True, (f"step {step + 1}: the reference's gradient overflowed at fp16 loss scale {scale:g} and the "
                         "run's did not: the reference cannot take an update it has no finite gradient for, so the "
                         "two differ by that step's update from here")


def _finite(params) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)


#: what a step's note says where the run's loss scale is not torch's GradScaler's after an agreed step: a bug
SCALE_DIFFERS = "the run scales its loss otherwise than torch"


def _scale_now(how: Replay, step: int) -> float:
    """The loss scale this step's gradients carry: fp16's (torch's GradScaler's, or the one followed), else 1."""
    if how.scaler is not None:
        return float(how.scaler.get_scale())
    return float(how.scales[step][0]) if how.scales is not None else 1.0


def _scale(how: Replay, step: int):
    """What a backward's loss is multiplied by: fp16's loss scale (torch's GradScaler.scale, or the scale another
    reference used at ``step``), else nothing."""
    if how.scaler is not None:
        return how.scaler.scale
    if how.scales is not None:
        return lambda loss: loss * how.scales[step][0]
    return lambda loss: loss


def _whole_step(forward, shards, step: int, seed: int, targets, packing, scale) -> list[float]:
    """One forward and backward over the global batch; each shard's loss read from its rows."""
    x = torch.cat([s[0] for s in shards])
    y = torch.cat([s[1] for s in shards])
    with steps.entered(steps.of_rows(step, seed, x, y, rows=len(y), first=0, targets=targets,
                                     packing=bool(packing))):
        logits = forward(x)
    # the loss straight from torch, not from the run's training/losses.py: the mean over the global batch's
    # targets, under documents over its valid ones (ignore_index), which is what every layout's pieces must add
    # up to
    flat, labels = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    valid = (labels != IGNORE).sum().item()
    scale(F.cross_entropy(flat, labels, ignore_index=IGNORE) if valid else flat.sum() * 0.0).backward()
    with torch.no_grad():  # each shard's loss as its rank reports it (losses.py's module docstring)
        per_target = F.cross_entropy(flat, labels, ignore_index=IGNORE, reduction="none").view(len(y), -1)
    return _shard_losses(per_target, shards, valid, packing)


def _shard_losses(per_target: torch.Tensor, shards, valid: int, packing) -> list[float]:
    """Each shard's loss from the global batch's per-target losses (rows in shard order), as its rank reports
    it: the mean over its targets, under documents its valid sum scaled to the global count."""
    n = len(per_target)
    rows = torch.cumsum(torch.tensor([0] + [len(s[1]) for s in shards]), 0).tolist()
    return [(per_target[a:b].sum() * n / ((b - a) * valid) if packing is not None and valid
             else per_target[a:b].mean()).item() for a, b in zip(rows, rows[1:])]


def _shards_step(model, optimizer, params, forward, shards, step: int, targets, how: Replay,
                 batchnorm: bool) -> list[float]:
    """One step replayed shard by shard and, inside each, microbatch by microbatch (each loss weighted by its
    share of the samples); BatchNorm's running statistics as ``how.bn_rule`` says. Leaves the step's gradient
    in ``params``; returns each shard's loss."""
    total = sum(len(s[1]) for s in shards)
    # each shard's gradient weighted after the sum: reordered; and under fp16, where a shard's backward at its
    # share of the loss would carry other activation gradients than its rank's at its whole (a factor of 2 moves
    # a value across float16's subnormal range, which the loss scale leaves near the smallest gradients)
    after = how.perturb == "reordered" or how.scales is not None
    apart = how.compression is not None or after or how.wired  # each shard's gradient kept apart
    kept_buffers, shard_losses, per_shard = None, [], []
    first = 0  # the shard's first row in the global batch
    for r, (x, y) in enumerate(shards):
        shard_loss = 0.0
        with steps.entered(steps.of_rows(step, how.seed, x, y, rows=total, first=first, targets=targets,
                                         packing=bool(how.packing))):
            # the microbatches and their weights (each one's share of the shard's samples) the reference's own,
            # not the run's split_microbatches: a wrong weight there is a bug it must see
            chunks = [(xs, ys, len(ys) / len(y)) for xs, ys in zip(torch.tensor_split(x, how.microbatches),
                                                                  torch.tensor_split(y, how.microbatches)) if len(ys)]
            steps.split([len(c[1]) for c in chunks])
            for i, (xs, ys, w) in enumerate(chunks):
                with steps.microbatch(i):
                    loss, reported = training_loss(cross_entropy, model, forward(xs), ys)
                # after: the shard's own mean (a rank's gradient), weighted once the shards are added
                _scale(how, step)(loss * (w if after else w * len(y) / total)).backward()
                shard_loss += reported.item() * w
        first += len(y)
        shard_losses.append(shard_loss)
        if r == 0 and how.bn_rule == "first-replica" and batchnorm:  # the only buffers a forward changes
            kept_buffers = [b.detach().clone() for b in model.buffers()]
        if apart:
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            if after and how.compression is not None:  # compressed as a rank's bucket holds it: its share
                grads = [g * (len(y) / total) for g in grads]
            per_shard.append(grads)
            optimizer.zero_grad(set_to_none=True)
    if apart:
        for p, g in zip(params, _combined(per_shard, [len(s[1]) for s in shards], how, _scale_now(how, step))):
            p.grad = g
    if kept_buffers is not None:
        with torch.no_grad():
            for b, kept in zip(model.buffers(), kept_buffers):
                b.copy_(kept)
    return shard_losses


def _combined(per_shard: list[list[torch.Tensor]], sizes: list[int], how: Replay, scale: float = 1.0
              ) -> list[torch.Tensor]:
    """The step's gradient from each shard's (``per_shard``, shards of ``sizes`` samples): compressed as the run
    compresses, or added as ``how.perturb`` says."""
    if how.compression is not None:  # compression; reordered: its shards handed to it last first
        return how.compression.combine(per_shard[::-1] if how.perturb == "reordered" else per_shard, scale)
    if how.wired:  # a lossy all-reduce: each shard's share rounded to the wire, added, the sum rounded again
        rounded = [[g.to(how.wire).to(g.dtype) for g in grads] for grads in per_shard]
        return [g.to(how.wire).to(g.dtype) for g in _added(rounded)]
    # the shards' own gradients (reordered: last first) added, then weighted, as data-parallel ranks do
    turn = (lambda shards: shards[::-1]) if how.perturb == "reordered" else (lambda shards: shards)
    if len(set(sizes)) == 1:
        return [g / len(sizes) for g in _added(turn(per_shard))]
    total = sum(sizes)
    return _added(turn([[g * (n / total) for g in grads] for n, grads in zip(sizes, per_shard)]))


def _added(per_shard: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each parameter's gradients of the shards, added in the list's order."""
    out = [g.clone() for g in per_shard[0]]
    for grads in per_shard[1:]:
        for o, g in zip(out, grads):
            o.add_(g)
    return out


def _reordered_step(forward, shards, step: int, seed: int, targets, packing, scale) -> list[float]:
    """One step's forwards and backwards over the global batch cut into two more pieces than it has shards,
    the last piece first, each piece's summed loss over the global count of targets: the same gradient as one
    forward over the whole batch, added up in another order. Returns each shard's loss (as ``reference_train``)."""
    x = torch.cat([s[0] for s in shards])
    y = torch.cat([s[1] for s in shards])
    count = max(1, int((y != IGNORE).sum()))
    bounds = torch.linspace(0, len(y), len(shards) + 3).round().long().tolist()
    per_target = [None] * (len(bounds) - 1)
    for i in reversed(range(len(bounds) - 1)):
        a, b = bounds[i], bounds[i + 1]
        if a == b:
            continue
        with steps.entered(steps.of_rows(step, seed, x[a:b], y[a:b], rows=len(y), first=a, targets=targets,
                                         packing=bool(packing))):
            logits = forward(x[a:b])
        flat, labels = logits.reshape(-1, logits.shape[-1]), y[a:b].reshape(-1)
        each = F.cross_entropy(flat, labels, ignore_index=IGNORE, reduction="none")
        scale(each.sum() / count).backward()
        per_target[i] = each.detach().view(b - a, -1)
    return _shard_losses(torch.cat([t for t in per_target if t is not None]), shards, int((y != IGNORE).sum()),
                         packing)


#: the optimizers that keep two moments and a step count per parameter (torch's Adam and AdamW)
ADAMS = ("adam", "adamw")


def banded(precision: str, wire: torch.dtype | None = None) -> bool:
    """Whether a check's comparisons beyond exact are judged by a noise band (``check/band.py``): below fp64, and
    in fp64 for a strategy that declares a lossy ``wire`` (its ``gradient_wire``)."""
    return precision != "fp64" or wire is not None


def reference_bytes(cfg, parameters: int, wire: torch.dtype | None = None) -> int:
    """The bytes the reference of a model of ``parameters`` holds at least: its weights, their gradients and
    the optimizer's state per parameter (momentum: one more copy; Adam: two), in the check's precision; its
    activations come on top. Below fp64 the noise band's three references (``check/band.py``) come with it: two
    more in float32 (bf16 and fp16 autocast keep float32 weights) and one in float64; in fp64 too where the strategy
    declares a lossy ``wire`` (its ``gradient_wire``), all four in float64."""
    states = 2 if cfg.optimizer in ADAMS else int(cfg.momentum > 0)
    per_copy = parameters * (2 + states)
    if cfg.precision == "fp64":
        return per_copy * 8 * (4 if banded(cfg.precision, wire) else 1)
    return per_copy * (4 + 2 * 4 + 8)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, copy: bool = True) -> dict[str, dict]:
    """The optimizer's state by parameter name (the model's own names; ``copy``: cloned): what a strategy's
    saved state becomes in no layout (``Portable.optimizer``)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {name: {k: (v.detach().clone() if copy else v.detach()) if torch.is_tensor(v) else v
                   for k, v in state.items()}
            for name, state in optimizer_by_name(optimizer.state_dict(), names).items()}


@dataclass
class Comparison:
    """One kind of comparison on one rank: its largest deviation, where, and what it is judged against.

    In fp64 (``band`` None) the deviation is judged against ``atol`` alone: ``exact`` within it, else ``bug``.
    Below fp64 each tensor (loss, norm) also has a noise band measured for this run (``check/band.py``):
    ``worst`` then names the one whose deviation is the largest multiple of its band (``ratio``; ``band`` is
    that tensor's), and a deviation beyond ``atol`` (fp64's tolerance) but within every band is ``within
    rounding``."""
    what: str           # "weights" | "optimizer" | "loss" | "outputs" | "replicas" | "grad_norm"
    max_abs: float      # largest absolute deviation
    worst: str          # name of the tensor where it occurred (below fp64: where the ratio to the band is largest)
    atol: float
    step: int | None = None  # after which step (None: not tied to one)
    band: float | None = None   # below fp64: the band of the tensor ``worst`` names
    ratio: float | None = None  # below fp64: the largest deviation / band over the tensors compared

    @property
    def word(self) -> str:
        """``exact`` (within fp64's tolerance), ``within rounding`` (inside the band) or ``bug``."""
        if self.max_abs <= self.atol:
            return "exact"
        return "within rounding" if self.ratio is not None and self.ratio <= 1 else "bug"

    @property
    def ok(self) -> bool:
        return self.word != "bug"

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        when = f", step {self.step}" if self.step is not None else ""
        if self.ratio is None:
            return f"{self.what}: {verdict} max |diff| {self.max_abs:.3e} at {self.worst}{when} (atol {self.atol:g})"
        if self.word == "exact":
            return f"{self.what}: {verdict} (exact) max |diff| {self.max_abs:.3e}{when} (atol {self.atol:g})"
        return (f"{self.what}: {verdict} ({self.word}) worst {self.ratio:.3g} of the band at {self.worst}{when} "
                f"(|diff| {self.ratio * self.band if self.band else self.max_abs:.3e}, band {self.band:.3e}; "
                f"largest |diff| {self.max_abs:.3e})")


def ratio_of(dev: float, band: float) -> float:
    """A deviation as a multiple of its band (0 / 0 = 0: nothing moved where nothing may)."""
    if dev == 0.0:
        return 0.0
    return dev / band if band > 0 else float("inf")


def worst(comparisons: list[Comparison]) -> Comparison:
    """The comparison that decides a verdict: the first that fails by the most, else the largest."""
    return max(comparisons, key=lambda c: (not c.ok, c.ratio if c.ratio is not None
                                           else c.max_abs / c.atol if c.atol else c.max_abs))


#: elements compared at a time: whole-tensor float64 temporaries (four of a tensor's size each comparison) are
#: fresh pages the kernel must zero every time; chunks this size are reused from the heap
CHUNK = 1 << 20


def max_abs_diff(m: torch.Tensor, r: torch.Tensor) -> float:
    """max |m - r| over two tensors of one shape, exactly (as float64 has it: exact for float32 and float64
    values), a chunk at a time; NaN where either holds one.

    Two tensors of one narrower floating dtype are subtracted in that dtype first, which is six times faster
    than in float64 on a CPU: each |m - r| so computed is the exact one within a relative half unit, so every
    element that can hold the exact maximum lies within a few units of the rounded maximum, and only those are
    subtracted again in float64."""
    m, r = m.reshape(-1), r.reshape(-1)
    narrow = m.dtype == r.dtype and m.dtype in (torch.float32, torch.float16, torch.bfloat16)
    u = torch.finfo(m.dtype).eps / 2 if narrow else 0.0  # the dtype's unit roundoff
    worst = 0.0
    for i in range(0, r.numel(), CHUNK):
        a, b = m[i:i + CHUNK], r[i:i + CHUNK]
        if narrow:
            rounded = (a - b).abs()
            top = float(rounded.max())
            if top != top:
                return top
            if top == 0.0 or top * (1 - 4 * u) <= worst:  # equal, or below a chunk already seen
                continue
            near = rounded >= top * (1 - 4 * u)  # where the exact maximum can be (an overflow's inf included)
            a, b = a[near], b[near]
        dev = float((a.double() - b.double()).abs().max())
        if dev != dev:
            return dev
        worst = max(worst, dev)
    return worst


def bits_deviation(mine: list[torch.Tensor], theirs: torch.Tensor) -> float:
    """How far ``mine`` (flat tensors) lie from ``theirs``, their bytes laid end to end (another rank's copy):
    0.0 where every bit agrees, else the largest |difference| as numbers (inf where a NaN differs)."""
    dev, at = 0.0, 0
    for t in mine:
        size = t.numel() * t.element_size()
        other, at = theirs[at:at + size], at + size
        if torch.equal(t.view(torch.uint8), other):  # this tensor's bits agree (a NaN in both places too)
            continue
        d = max_abs_diff(t, other.clone().view(t.dtype))  # a fresh storage: aligned for the dtype
        if d != d:  # NaN
            return float("inf")
        dev = max(dev, d)
    return dev


def compare_tensors(what: str, mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                    atol: float, step: int | None = None, bands: dict[str, float] | None = None) -> Comparison:
    """``mine`` against ``ref``, tensor by tensor; ``bands`` (below fp64): each tensor's noise band."""
    missing = set(ref) ^ set(mine)
    if missing:
        return Comparison(what, float("inf"), f"keys differ: {sorted(missing)[:4]}", atol, step,
                          *((0.0, float("inf")) if bands is not None else ()))
    largest, worst_name, worst_ratio = 0.0, "-", -1.0
    for name, r in ref.items():
        m, r = mine[name].detach().cpu(), r.detach().cpu()
        if m.shape != r.shape:
            return Comparison(what, float("inf"), f"{name} shape {tuple(m.shape)} vs {tuple(r.shape)}", atol, step,
                              *((0.0, float("inf")) if bands is not None else ()))
        if not r.is_floating_point():
            dev = float((m.long() - r.long()).abs().max()) if r.numel() else 0.0
        else:
            dev = max_abs_diff(m, r)
        if dev != dev:  # NaN
            dev = float("inf")
        largest = max(largest, dev)
        rank_by = ratio_of(dev, bands.get(name, 0.0)) if bands is not None else dev
        if rank_by > worst_ratio:
            worst_ratio, worst_name = rank_by, name
    if bands is None:
        return Comparison(what, largest, worst_name, atol, step)
    return Comparison(what, largest, worst_name, atol, step, bands.get(worst_name, 0.0), max(worst_ratio, 0.0))


def _deviation(m, r) -> float:
    """|m - r| at most, for two tensors (or numbers, or Nones) of one optimizer state entry."""
    if m is None or r is None:
        return 0.0 if m is None and r is None else float("inf")
    m, r = (torch.as_tensor(v).detach().cpu() for v in (m, r))
    if m.shape != r.shape:
        return float("inf")
    dev = max_abs_diff(m, r)
    return float("inf") if dev != dev else dev


def compare_optimizer(mine: dict[str, dict], ref: dict[str, dict], atol: float, step: int | None = None,
                      bands: dict[str, float] | None = None) -> Comparison:
    """Every parameter's optimizer state (momentum, Adam's moments and step count), whole, by name;
    ``bands`` (below fp64): each entry's noise band, by ``"name key"``."""
    far = (0.0, float("inf")) if bands is not None else ()
    if set(mine) != set(ref):
        differ = sorted(set(mine) ^ set(ref))
        return Comparison("optimizer", float("inf"), f"state of {differ[:3]} only on "
                          f"{'the run' if differ[0] in mine else 'the reference'}", atol, step, *far)
    largest, worst_name, worst_ratio = 0.0, "-", -1.0
    for name, state in ref.items():
        if set(mine[name]) != set(state):
            return Comparison("optimizer", float("inf"), f"{name}: keys {sorted(mine[name])} vs "
                              f"{sorted(state)}", atol, step, *far)
        for key, value in state.items():
            dev = _deviation(mine[name][key], value)
            largest = max(largest, dev)
            rank_by = ratio_of(dev, bands.get(f"{name} {key}", 0.0)) if bands is not None else dev
            if rank_by > worst_ratio:
                worst_ratio, worst_name = rank_by, f"{name} {key}"
    if bands is None:
        return Comparison("optimizer", largest, worst_name, atol, step)
    return Comparison("optimizer", largest, worst_name, atol, step, bands.get(worst_name, 0.0), max(worst_ratio, 0.0))
