"""``--check``: run the reference on this rank and compare, then agree on a verdict.

Every rank trains the single-process reference itself (it is deterministic and
identical everywhere, so nothing large crosses the network), then compares
its own view of the strategy: the full weights, the logits it produces for
the next batch, and (for replicated strategies) its parameters against rank
0's, which must be bit-identical.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..data.loader import to_device
from ..strategies.compression import reference_for
from . import kept
from .reference import TOLERANCES, Comparison, compare_tensors, reference_train


def cancelled_by_batchnorm(model: nn.Module) -> set[str]:
    """Names of the biases that feed a BatchNorm directly (in training it subtracts them right back)."""
    names = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (name, a), (_, b) in zip(children, children[1:]):
            if isinstance(b, nn.modules.batchnorm._BatchNorm) and getattr(a, "bias", None) is not None:
                names.add(f"{prefix}.{name}.bias" if prefix else f"{name}.bias")
    return names


class Reference:
    """The single-process reference, trained on the run's own batches, as far as it is asked.

    It replays the strategy's split (its data-parallel shards, the
    microbatches inside each, its BatchNorm rule) and learning-rate schedule.
    ``--check-every K`` advances it alongside the run and compares every K
    steps; otherwise it is trained once, at the end.
    """

    def __init__(self, strategy, source, model_fn, optim_fn, lr_for):
        self.model = model_fn()
        self.optimizer = optim_fn(list(self.model.parameters()))
        self.replicas, _ = strategy.replicas()
        self.microbatches, self.bn_rule = strategy.microbatches, strategy.bn_rule
        self.source, self.lr_for = source, lr_for
        self.step = 0
        # gradient compression: the reference applies the same to each shard's gradient (or None)
        self.compression = reference_for(strategy.ctx.options, self.replicas)

    def describe(self) -> str:
        return (f"{self.replicas} shard(s) x {self.microbatches} microbatch(es), BN rule {self.bn_rule}, "
                f"{str(next(self.model.parameters()).dtype).replace('torch.', '')}"
                + (f"; {self.compression.describe()}" if self.compression else ""))

    def advance_to(self, step: int) -> None:
        reference_train(self.model, self.optimizer, lambda s, r: self.source.batch(s, rank=r), step,
                        self.replicas, self.microbatches, self.bn_rule, self.lr_for, first_step=self.step,
                        combine=self.compression.combine if self.compression else None)
        self.step = step


def weight_deviation(strategy, ref: Reference, precision: str) -> Comparison:
    """This rank's view of the strategy's full weights against the reference's, now (a collective)."""
    return compare_tensors("weights", strategy.full_state_dict(), ref.model.state_dict(),
                           TOLERANCES[precision]["weights"])


def bring_to(cfg, ref: Reference, steps: int, comm, say) -> None:
    """Train the reference to ``steps``, or with ``--check-cache`` load it where an earlier run with the
    same reference kept it (``kept.py``: named by a digest of its weights, batches and settings)."""
    key = None
    if kept.usable(cfg, ref):
        key = kept.digest(cfg, ref, steps)
        why = kept.load(cfg.check_cache, key, ref.model)
        if why is None:
            ref.step = steps
            say(f"check: the single-process reference to step {steps} ({ref.describe()}) is the one an earlier "
                f"run trained on the same weights and batches ({kept.path_for(cfg.check_cache, key).name})")
            return
    say(f"check: training the single-process reference to step {steps} ({ref.describe()})")
    ref.advance_to(steps)
    if key is not None and comm.rank == 0:
        why = kept.keep(cfg.check_cache, key, ref.model)
        if why:
            say(f"check: --check-cache: the reference is {why}")


def run_check(cfg, strategy, ref: Reference, steps: int, comm, say, history: list | None = None) -> dict:
    """Bring the reference to ``steps``, compare, agree on a verdict over the ranks.

    ``history``: this rank's ``(step, max weight deviation)`` from ``--check-every``; the verdict
    carries the deviation at each of those steps, the largest over the ranks.
    """
    tol = TOLERANCES[cfg.precision]
    if ref.compression:
        say(f"check: {ref.compression.caveat()}")
    bring_to(cfg, ref, steps, comm, say)

    results: list[Comparison] = []
    mine = strategy.full_state_dict()
    results.append(compare_tensors("weights", mine, ref.model.state_dict(), tol["weights"]))

    x, _ = ref.source.batch(steps)
    out = strategy.predict(to_device(x, strategy.ctx.device, strategy.ctx.dtype))
    if out is not None:
        ref.model.eval()
        with torch.no_grad():
            expected = ref.model(to_device(x, x.device, strategy.ctx.dtype))
        results.append(compare_tensors("outputs", {"logits": out.cpu()}, {"logits": expected}, tol["outputs"]))

    if strategy.replicated and comm.world > 1:
        names = [k for k, v in mine.items() if v.is_floating_point()]
        flat = torch.cat([mine[k].flatten().double() for k in names])
        root = flat.clone()
        comm.broadcast(root, 0, name="check_replicas")
        dev = float((flat - root).abs().max()) if flat.numel() else 0.0
        results.append(Comparison("replicas", dev, "bit-identical to rank 0", 0.0))

    lines = [c.line() for c in results]
    verdicts = comm.all_gather_objects({"rank": comm.rank, "passed": all(c.ok for c in results),
                                        "lines": lines, "failed": [c.what for c in results if not c.ok],
                                        "worst_weight": results[0].worst,
                                        "max_weight_dev": results[0].max_abs,
                                        "max_output_dev": next((c.max_abs for c in results if c.what == "outputs"),
                                                               None),
                                        "history": list(history or []) + [(steps, results[0].max_abs)]})
    for v in verdicts:
        say(f"check rank {v['rank']}: {'PASS' if v['passed'] else 'FAIL'}  " + "; ".join(v["lines"]))
    passed = all(v["passed"] for v in verdicts)
    say(f"check: {'PASS' if passed else 'FAIL'}")
    # Adam + BatchNorm: explain a failure only when the weights alone failed, on every rank that failed,
    # at a bias that BatchNorm cancels (a wrong output or replica is a real bug, never explained away)
    failing = [v for v in verdicts if not v["passed"]]
    cancelled = cancelled_by_batchnorm(ref.model) if cfg.optimizer == "adam" and failing else set()
    if failing and all(v["failed"] == ["weights"] and v["worst_weight"] in cancelled for v in failing):
        worst = failing[0]["worst_weight"]
        say(f"check: hint: {worst} feeds a BatchNorm, which subtracts it again, so its gradient is zero but for "
            "rounding noise, and Adam scales that noise up to steps of about --lr; the two runs' noise differs. "
            "Check Adam runs with --norm none (the outputs comparison above is the meaningful one here)")
    outputs = [v["max_output_dev"] for v in verdicts if v["max_output_dev"] is not None]
    by_step: dict[int, float] = {}
    for v in verdicts:
        for step, dev in v["history"]:
            by_step[step] = max(by_step.get(step, 0.0), dev)
    return {"passed": passed, "result": "PASS" if passed else "FAIL", "precision": cfg.precision,
            "tolerances": tol,
            "max_weight_dev": max(v["max_weight_dev"] for v in verdicts),
            "max_output_dev": max(outputs) if outputs else None,
            "history": [{"step": s, "max_weight_dev": d} for s, d in sorted(by_step.items())],
            "ranks": verdicts}
