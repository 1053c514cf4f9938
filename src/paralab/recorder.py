"""Where time goes: every measured interval is a *span* on one rank.

A span is (rank, step, category, name, t0, t1, bytes, args); its categories
and the names and args the analysis reads are declared in ``paralab.kinds``.
Per-step splits, timelines, bubble fractions and bandwidths are all derived
from these spans (``paralab.analysis``); nothing is timed twice.

Times are ``time.perf_counter()`` seconds relative to the recorder's start.
On CUDA the device is synchronised before each clock read so a span covers
the kernels it launched.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .kinds import CATEGORIES  # noqa: F401  (re-exported: the span categories)


@dataclass
class Span:
    rank: int
    step: int
    category: str
    name: str
    t0: float
    t1: float
    bytes: int = 0
    args: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class Recorder:
    def __init__(self, rank: int = 0, device: torch.device | None = None, enabled: bool = True):
        self.rank = rank
        self.cuda = device is not None and device.type == "cuda"
        self.enabled = enabled
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.by_step: dict[int, list[Span]] = {}  # the same spans, indexed for the per-step split
        self.step = -1  # set by the training loop; -1 = outside training

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self.origin

    def add(self, category: str, name: str, t0: float, t1: float, nbytes: int = 0, *, step: int | None = None,
            **args) -> Span:
        """Record a span in ``step`` (default: the current one). Safe to call from a
        backend's completion thread: list appends are atomic in CPython."""
        span = Span(self.rank, self.step if step is None else step, category, name, t0, t1, int(nbytes), args)
        if self.enabled:
            self.spans.append(span)
            self.by_step.setdefault(span.step, []).append(span)
        return span

    @contextmanager
    def span(self, category: str, name: str, nbytes: int = 0, **args):
        assert category in CATEGORIES, category
        t0 = self.now()
        try:
            yield
        finally:
            self.add(category, name, t0, self.now(), nbytes, **args)

    def step_spans(self, step: int) -> list[Span]:
        return list(self.by_step.get(step, ()))

    def split(self, step: int) -> dict[str, float]:
        """Seconds by category in one step.

        Asynchronous communication (``args['async']``) overlaps other spans, so it
        is reported apart as ``comm_async`` (the time during which at least one
        operation was in flight: the union of their intervals) and never added to
        the step total. ``forward`` and ``backward`` break ``compute`` down.
        """
        out = {c: 0.0 for c in CATEGORIES} | {"forward": 0.0, "backward": 0.0, "comm_async": 0.0}
        spans = self.step_spans(step)
        for s, seconds in exclusive_seconds([s for s in spans if not s.args.get("async")]):
            out[s.category] += seconds
            if s.category == "compute" and s.name in ("forward", "backward"):
                out[s.name] += seconds
        out["comm_async"] = union_length([(s.t0, s.t1) for s in spans if s.args.get("async")])
        return out

    def dump(self) -> list[dict]:
        return [asdict(s) for s in self.spans]


def exclusive_seconds(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each span with its own time: its length less that of the spans nested directly inside it.

    Spans of one thread either follow each other or nest (a collective that a
    library issues inside a ``compute`` span, such as FSDP2's all-gathers, is a
    ``comm`` span within it); counting each moment once, in the innermost span,
    keeps the categories adding up to the step.
    """
    own = {}
    stack: list[Span] = []
    # outer before inner; for equal intervals the one recorded later is the outer (spans are recorded at exit)
    order = sorted(range(len(spans)), key=lambda i: (spans[i].t0, -spans[i].t1, -i))
    for s in (spans[i] for i in order):
        while stack and stack[-1].t1 <= s.t0:
            stack.pop()
        own[id(s)] = s.seconds
        if stack and s.t1 <= stack[-1].t1:
            own[id(stack[-1])] -= s.seconds
        stack.append(s)
    return [(s, max(0.0, own[id(s)])) for s in spans]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
