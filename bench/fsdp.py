"""Sharded data-parallel benchmark: ddp, fsdp at ZeRO stages 1-3, torch-fsdp; throughput and memory.

``python bench/fsdp.py [--width 1.0] [--batch-size 256] [--steps 5] [--repeats 2]``

Every variant trains VGG-11 on the same global batch through the ordinary
command line (``paralab train``), 2 workers x 1 core (``--cores-per-worker
1``), synthetic data. Variants: ``ddp`` (``allreduce`` if ``ddp`` is not
registered: the same memory), ``fsdp`` at ``--zero-stage`` 1, 2 and 3
(stages 2-3 step each unit's shard in backward, the default),
``fsdp3-step-at-end`` (stage 3 with ``--no-step-in-backward``: one optimizer
step after backward, so every gradient shard is held at once), ``fsdp`` stage
3 with prefetch off (``--no-prefetch``: what the prefetch buys) and
``torch-fsdp``.

Throughput: global batch / the median step time (slowest rank per step, from
steps.jsonl, after warm-up), so a spike from another process on the machine
does not count; with ``--repeats R`` the variants run R times, interleaved,
and each variant's best run counts.

Memory per rank: parameter + gradient + optimizer-state bytes.
- ``fsdp``/``torch-fsdp``: what the strategy counted (summary.json
  ``strategy_details.<rank>.memory``): the peak of the three held at the
  same moment, and each category's own peak; beside the cost model's
  prediction (analysis/memory.py) for the same stage.
- ``ddp``: counted here from the model: a full replica's parameters, its
  gradients and the optimizer's state after one step (every rank of a
  replicated strategy holds exactly these).

Targets: fsdp stage 3 >= 0.9 x torch-fsdp samples/s; fsdp stage 3's resident
parameter + gradient + optimizer bytes per rank <= ddp's / N + one unit's
full parameters (the largest unit). Writes ``bench/results/fsdp.json``.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from common import SRC, interleaved, parse_runs, selected, step_seconds, train, training_options, write_result

VARIANTS = ("ddp", "fsdp1", "fsdp2", "fsdp3", "fsdp3-step-at-end", "fsdp3-noprefetch", "torch-fsdp")


def parse(argv):
    p = training_options("bench/fsdp.py", __doc__, each="variant", warmup_help="steps left out of the timing")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9) | adam")
    return parse_runs(p, argv, "fsdp", repeats=2, repeats_help="run every variant R times, interleaved; keep the best",
                      select="--variants", choices=VARIANTS)


def registered(name: str) -> bool:
    sys.path.insert(0, str(SRC))
    from paralab.strategies import strategy_names
    return name in strategy_names()


def command(variant: str, ddp_name: str) -> list[str]:
    if variant == "ddp":
        return [ddp_name]
    if variant.startswith("fsdp"):
        at_end = ["--no-step-in-backward"] if variant.endswith("step-at-end") else []
        no_prefetch = ["--no-prefetch"] if variant.endswith("noprefetch") else []
        return ["fsdp", "--zero-stage", variant[4], *at_end, *no_prefetch]
    return [variant]


def run_one(variant: str, args, workdir: Path, tag: str, ddp_name: str) -> dict:
    out = workdir / f"{variant}-{tag}"
    strategy = command(variant, ddp_name)
    s, rows = train(variant, strategy, args, out, options=["--optimizer", args.optimizer])
    step_s = step_seconds(rows, args.warmup)
    ranks = list(s["split"].values())
    details = s.get("strategy_details") or {}
    # measured: each rank's held record (its ledger over the first step); predicted: the cost model's, beside it
    memory = [(d["held"]["ledger"], d["memory"], d.get("allocator") or {}) for d in details.values()
              if isinstance(d, dict) and "memory" in d and "ledger" in (d.get("held") or {})]
    result = {
        "variant": variant, "strategy": " ".join(strategy), "samples_per_s": s["global_batch"] / statistics.median(step_s),
        "samples_per_s_mean": s["samples_per_s"], "median_step_s": statistics.median(step_s),
        "compute_s": max(r["compute"] for r in ranks), "comm_exposed_s": max(r["comm"] for r in ranks),
        "comm_in_flight_s": max(r["comm_async"] for r in ranks),
        "comm_bytes_per_step": max(s["comm_bytes"].values()) if s["comm_bytes"] else 0,
        "parameters": s["parameters"], "global_batch": s["global_batch"], "run": str(out),
    }
    if memory:
        measured, model, allocator = max(memory, key=lambda m: m[0]["resident_peak_bytes"])
        result["memory"] = {"resident_peak_bytes": measured["resident_peak_bytes"],
                            "resident_peak_split": measured["resident_peak_split"],
                            "resident_peak_at": measured["resident_peak_at"],
                            "peak_bytes": measured["peak_bytes"],
                            "predicted_bytes": model["predicted"]["bytes"],
                            "predicted_formula": model["predicted"]["formulas"]["total"]["substituted"]}
        if "peak_bytes" in allocator:  # CUDA: the allocator's peak over the run (recorder.allocator_peaks)
            result["memory"]["cuda_max_memory_allocated_bytes"] = allocator["peak_bytes"]
        d0 = details.get("0", {})
        for key in ("reduce_scatter", "largest_unit", "padding_elements"):
            if key in d0:
                result[key] = d0[key]
    return result


def replica_bytes(args) -> dict:
    """Parameters, gradients and optimizer state of one full replica, counted after one step."""
    sys.path.insert(0, str(SRC))
    import torch
    import torch.nn.functional as F
    from paralab.models import build_model
    torch.manual_seed(0)
    model = build_model(args.model, width=args.width)
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
    opt.step()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters())
    state = sum(size(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    units = [sum(size(p) for p in u.parameters()) for u in model]
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state,
            "largest_unit_bytes": max(units)}


def main(argv: list[str]) -> int:
    args = parse(argv)
    names = selected(args.variants, VARIANTS, "variants")
    if names is None:
        return 2
    ddp_name = "ddp" if registered("ddp") else "allreduce"
    if ddp_name != "ddp":
        print("bench fsdp: strategy 'ddp' is not registered; using 'allreduce' (same memory)", flush=True)
    ddp_memory = replica_bytes(args)
    load_before = os.getloadavg()
    started = time.time()
    runs = interleaved("fsdp", names, args.repeats,
                       lambda name, workdir, tag: run_one(name, args, workdir, tag, ddp_name))
    if runs is None:
        return 1
    best = {n: max(r, key=lambda x: x["samples_per_s"]) for n, r in runs.items()}
    if "ddp" in best:
        best["ddp"]["memory"] = {"resident_peak_bytes": ddp_memory["total"], "peak_bytes": {
            k: ddp_memory[k] for k in ("params", "grads", "optimizer")}, "counted": "from the model (full replica)"}

    ratios, checks = {}, {}
    if "fsdp3" in best and "torch-fsdp" in best:
        ratios["fsdp3_over_torch_fsdp"] = best["fsdp3"]["samples_per_s"] / best["torch-fsdp"]["samples_per_s"]
        checks["fsdp3_over_torch_fsdp"] = {"value": ratios["fsdp3_over_torch_fsdp"], "target": ">= 0.9",
                                           "met": ratios["fsdp3_over_torch_fsdp"] >= 0.9}
    if "fsdp3" in best and "fsdp3-noprefetch" in best:
        ratios["prefetch_speedup"] = best["fsdp3"]["samples_per_s"] / best["fsdp3-noprefetch"]["samples_per_s"]
    if "fsdp3" in best and "fsdp3-step-at-end" in best:
        ratios["step_in_backward_speedup"] = (best["fsdp3"]["samples_per_s"]
                                              / best["fsdp3-step-at-end"]["samples_per_s"])
    limit = ddp_memory["total"] / args.workers + ddp_memory["largest_unit_bytes"]
    contrast = {}
    for n, where in (("fsdp3", checks), ("fsdp3-step-at-end", contrast)):  # the target is the default's
        if n in best:
            measured = best[n]["memory"]["resident_peak_bytes"]
            where[f"{n}_resident_bytes"] = {
                "value": measured, "limit": limit, "met": measured <= limit, "over_by_bytes": max(0, measured - limit),
                "limit_formula": f"ddp {ddp_memory['total']} B / {args.workers} + "
                                 f"largest unit {ddp_memory['largest_unit_bytes']} B"}
    result = {"benchmark": "fsdp", "model": args.model, "width": args.width, "global_batch": args.batch_size,
              "steps": args.steps, "warmup": args.warmup, "workers": args.workers,
              "cores_per_worker": args.cores_per_worker, "optimizer": args.optimizer, "repeats": args.repeats,
              "ddp_strategy": ddp_name, "cpu_count": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "wall_s": time.time() - started,
              "ddp_replica_bytes": ddp_memory, "best": best, "all_runs": runs, "ratios": ratios,
              "targets": checks, "contrast": contrast}
    out = write_result(args.out, result)

    mb = lambda b: f"{b / 1e6:.2f}" if b is not None else "-"  # noqa: E731
    print(f"\n{args.model} width {args.width}, global batch {args.batch_size}, {args.workers} workers x "
          f"{args.cores_per_worker} core, {args.optimizer}; best of {args.repeats} (median step); load average "
          f"before {load_before[0]:.1f}, after {result['load_average_after'][0]:.1f} on {os.cpu_count()} cores")
    print(f"{'variant':<18}{'samples/s':>10}{'step s':>8}{'comm exp s':>11}{'in flight s':>12}"
          f"{'resident MB':>12}{'params MB':>10}{'grads MB':>9}{'optim MB':>9}{'model MB':>9}{'peak MB':>9}")
    for n in names:
        b = best[n]
        m = b.get("memory", {})
        peaks = m.get("resident_peak_split") or m.get("peak_bytes") or {}
        predicted = (m.get("predicted_bytes") or {}).get("total")
        predicted_peak = (m.get("predicted_bytes") or {}).get("peak")
        if n == "ddp":
            predicted = predicted_peak = ddp_memory["total"]
        print(f"{n:<18}{b['samples_per_s']:>10.1f}{b['median_step_s']:>8.3f}{b['comm_exposed_s']:>11.3f}"
              f"{b['comm_in_flight_s']:>12.3f}{mb(m.get('resident_peak_bytes')):>12}{mb(peaks.get('params')):>10}"
              f"{mb(peaks.get('grads')):>9}{mb(peaks.get('optimizer')):>9}{mb(predicted):>9}"
              f"{mb(predicted_peak):>9}")
    print("(resident = peak of parameters + gradients + optimizer state held at the same moment, split at "
          "that moment; model = the cost model's model states, peak = those + the working set of the "
          "largest unit; torch-fsdp is observed at unit boundaries)")
    if "prefetch_speedup" in ratios:
        print(f"prefetch: fsdp3 / fsdp3-noprefetch throughput = {ratios['prefetch_speedup']:.3f}")
    if "step_in_backward_speedup" in ratios:
        print(f"step in backward: fsdp3 / fsdp3-step-at-end throughput = {ratios['step_in_backward_speedup']:.3f}")
    for key, c in contrast.items():
        print(f"(for contrast, not a target) {key} = {mb(c['value'])} MB  (<= {mb(c['limit'])} MB: "
              f"{'yes' if c['met'] else 'no'})")
    for key, c in checks.items():
        if "limit" in c:
            print(f"{key} = {mb(c['value'])} MB  (target <= {mb(c['limit'])} MB = {c['limit_formula']}: "
                  f"{'met' if c['met'] else 'NOT met'})")
        else:
            print(f"{key} = {c['value']:.3f}  (target {c['target']}: {'met' if c['met'] else 'NOT met'})")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
