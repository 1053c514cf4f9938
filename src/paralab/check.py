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

from .verify import OUTPUT_ATOL, WEIGHT_ATOL, Comparison, compare_tensors, reference_train


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


def run_check(cfg, strategy, source, model_fn, optim_fn, lr_for, steps: int, comm, say) -> dict:
    replicas, _ = strategy.replicas()
    say(f"check: training the single-process reference for {steps} steps "
        f"({replicas} shard(s) x {strategy.microbatches} microbatch(es), BN rule {strategy.bn_rule})")
    ref = model_fn()
    ref_opt = optim_fn(list(ref.parameters()))
    reference_train(ref, ref_opt, lambda step, r: source.batch(step, rank=r), steps, replicas,
                    strategy.microbatches, strategy.bn_rule, lr_for)

    results: list[Comparison] = []
    mine = strategy.full_state_dict()
    results.append(compare_tensors("weights", mine, ref.state_dict(), WEIGHT_ATOL))

    x, _ = source.batch(steps)
    out = strategy.predict(x.to(strategy.ctx.device))
    if out is not None:
        ref.eval()
        with torch.no_grad():
            expected = ref(x)
        results.append(compare_tensors("outputs", {"logits": out.cpu()}, {"logits": expected}, OUTPUT_ATOL))

    if strategy.replicated and comm.world > 1:
        names = [k for k, v in mine.items() if v.is_floating_point()]
        flat = torch.cat([mine[k].flatten().float() for k in names])
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
                                                               None)})
    for v in verdicts:
        say(f"check rank {v['rank']}: {'PASS' if v['passed'] else 'FAIL'}  " + "; ".join(v["lines"]))
    passed = all(v["passed"] for v in verdicts)
    say(f"check: {'PASS' if passed else 'FAIL'}")
    # Adam + BatchNorm: explain a failure only when the weights alone failed, on every rank that failed,
    # at a bias that BatchNorm cancels (a wrong output or replica is a real bug, never explained away)
    failing = [v for v in verdicts if not v["passed"]]
    cancelled = cancelled_by_batchnorm(ref) if cfg.optimizer == "adam" and failing else set()
    if failing and all(v["failed"] == ["weights"] and v["worst_weight"] in cancelled for v in failing):
        worst = failing[0]["worst_weight"]
        say(f"check: hint: {worst} feeds a BatchNorm, which subtracts it again, so its gradient is zero but for "
            "rounding noise, and Adam scales that noise up to steps of about --lr; the two runs' noise differs. "
            "Check Adam runs with --norm none (the outputs comparison above is the meaningful one here)")
    outputs = [v["max_output_dev"] for v in verdicts if v["max_output_dev"] is not None]
    return {"passed": passed, "result": "PASS" if passed else "FAIL",
            "max_weight_dev": max(v["max_weight_dev"] for v in verdicts),
            "max_output_dev": max(outputs) if outputs else None,
            "ranks": verdicts}
