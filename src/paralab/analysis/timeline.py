"""What the spans say, derived once, from the records only.

Every function here reads span and step records (dicts as in
``spans.jsonl`` / ``steps.jsonl``, see ``paralab.kinds``) and nothing else:
no strategy object, no live recorder. ``run/records.py`` calls them when it writes
a run's summary, and anything that reads a run directory can call them again.

- :func:`measured_steps`: the steps that count in averages (after warm-up);
- :func:`overlap`: asynchronous communication hidden under computation vs
  waited for (``ddp``'s buckets, any ``async`` collective);
- :func:`bubble`: the idle fraction of a pipeline stage's step;
- :func:`peak_in_flight`: microbatches whose activations were alive at once
  (forwarded, not yet backwarded) on a stage.
"""
from __future__ import annotations

from collections import defaultdict

from ..kinds import ASYNC, BACKWARD, BACKWARD_WEIGHT, COMPUTE, COMM, FORWARD, IDLE, UNSEEN, WAIT_PREFIX
from ..recorder import union_length


def measured_steps(steps, warmup: int) -> list[int]:
    """The training steps that count in averages: all after the first ``warmup``.

    All of them if that would leave none (fewer steps than warm-up: report them rather than nothing).
    """
    timed = sorted({int(s) for s in steps if int(s) >= 0})
    return [s for s in timed if s >= timed[0] + warmup] or timed if timed else []


def _mean(rows: list[dict], key: str):
    return sum(r[key] for r in rows) / len(rows) if rows else None


def _by_rank_step(spans: list[dict]) -> dict[tuple[int, int], list[dict]]:
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for s in spans:
        if s["step"] >= 0:
            out[(s["rank"], s["step"])].append(s)
    return out


def overlap(spans: list[dict], rank: int, warmup: int, op: str = "all_reduce") -> dict | None:
    """Per step, how much of this rank's asynchronous ``op`` traffic was hidden, and how much waited for.

    in flight: the union of the operations' launch-to-completion intervals;
    exposed: the time the rank blocked in ``wait:`` spans of that ``op``
    (a slower peer included: an all-reduce completes only when every rank
    has joined it); hidden: the in-flight time outside those waits, i.e.
    under computation. None if the rank launched no such operation, or
    never waited for one in a span of its own (PyTorch's DDP waits inside
    its backward, where the records cannot tell waiting from computing).
    """
    steps = []
    for (r, step), mine in sorted(_by_rank_step(spans).items()):
        if r != rank:
            continue
        flights = [(s["t0"], s["t1"]) for s in mine if s["category"] == COMM and s["args"].get(ASYNC)
                   and not s["args"].get(UNSEEN) and s["args"].get("op") == op]  # unseen: ends at its wait
        if not flights:
            continue
        waits = [(s["t0"], s["t1"]) for s in mine if s["category"] == COMM and s["name"].startswith(WAIT_PREFIX)
                 and s["args"].get("op") == op and not s["args"].get(ASYNC)]
        if not waits:
            return None
        in_flight = union_length(flights)
        under_waits = union_length([(max(a, c), min(b, d)) for a, b in flights for c, d in waits
                                    if min(b, d) > max(a, c)])
        steps.append({"step": step, "comm_in_flight_s": in_flight, "hidden_s": in_flight - under_waits,
                      "exposed_s": sum(b - a for a, b in waits)})
    if not steps:
        return None
    keep = set(measured_steps([s["step"] for s in steps], warmup))
    measured = [s for s in steps if s["step"] in keep]
    mean = {k: _mean(measured, k) for k in ("comm_in_flight_s", "hidden_s", "exposed_s")}
    total = (mean["hidden_s"] or 0.0) + (mean["exposed_s"] or 0.0)
    return {"op": op,
            "note": "per-step means over the steps after warm-up; hidden: in flight while the rank computed; "
                    "exposed: waited for (a slower peer included)",
            **{f"mean_{k}": v for k, v in mean.items()},
            "hidden_fraction": (mean["hidden_s"] / total) if total else None,
            "steps": steps}


def bubble(spans: list[dict], rank: int, warmup: int) -> dict:
    """This rank's measured bubble: idle time / step time, per step and averaged after warm-up.

    Step time is the span of the step's synchronous intervals on this rank
    (data loading to optimizer); asynchronous transfers are left out (they overlap).
    """
    by_step = {}
    for (r, step), mine in sorted(_by_rank_step(spans).items()):
        sync = [s for s in mine if r == rank and not s["args"].get(ASYNC)]
        if not sync:
            continue
        length = max(s["t1"] for s in sync) - min(s["t0"] for s in sync)
        idle = sum(s["t1"] - s["t0"] for s in sync if s["category"] == IDLE)
        by_step[step] = {"idle_s": idle, "step_s": length, "bubble": idle / length if length > 0 else 0.0}
    keep = measured_steps(by_step, warmup)
    rows = [by_step[s] for s in keep]
    return {"bubble": _mean(rows, "bubble"), "idle_s": _mean(rows, "idle_s"), "step_s": _mean(rows, "step_s"),
            "bubble_by_step": {str(s): round(v["bubble"], 6) for s, v in by_step.items()}}


def peak_in_flight(spans: list[dict], rank: int) -> int:
    """The most microbatches this rank had forwarded but not yet backwarded, in any step.

    Read from its ``compute`` spans named forward/backward with ``args.mb``:
    a microbatch is alive from the end of its forward to the end of its backward
    (of its ``backward_weight`` where the backward is split: the activations
    stay until the weight gradients are done). A rank holding several stages
    counts each (stage, microbatch) pair.
    """
    peak = 0
    for (r, _), mine in _by_rank_step(spans).items():
        if r != rank:
            continue
        events = sorted((s["t1"], 1 if s["name"] == FORWARD else -1) for s in mine
                        if s["category"] == COMPUTE and s["name"] in (FORWARD, BACKWARD, BACKWARD_WEIGHT)
                        and "mb" in s["args"])
        alive = 0
        for _, delta in events:
            alive += delta
            peak = max(peak, alive)
    return peak
