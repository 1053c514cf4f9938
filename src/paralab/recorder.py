"""Where time goes: every measured interval is a *span* on one rank.

A span is (rank, step, category, name, t0, t1, bytes, args); its categories
and the names and args the analysis reads are declared in ``paralab.kinds``.
Per-step splits, timelines, bubble fractions and bandwidths are all derived
from these spans (``paralab.analysis``); nothing is timed twice.

Times are seconds relative to the recorder's start (``time.perf_counter()``).

On CPU a span reads the clock at its start and end. On CUDA the work a span
covers runs later on the device, and synchronising at every reading would
serialise the overlap the spans are meant to show; so a span records a CUDA
event on the current stream at its start and end (:meth:`Recorder.mark`),
and the events are read only when the spans are asked for (:meth:`resolve`:
the split the loop takes after each step, :meth:`dump`), after one
synchronisation. An event's time is the last *anchor* (an event recorded
right after the synchronising :meth:`now` at a step's start, whose wall time
is known) plus the device's elapsed time between the two. An asynchronous
operation's completion is an event recorded in its completion callback,
which runs with the operation's stream current (``comm.py``). Events say
when the *stream* reached a point: a span around host-only work shows how
long the stream was held up, not the host's time.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .kinds import ASYNC, CATEGORIES, UNSEEN  # noqa: F401  (CATEGORIES re-exported: the span categories)


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


class CudaEvents:
    """Timing events on the current CUDA stream (the recorder's device clock)."""

    def record(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def seconds_between(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0


class CudaAllocator:
    """The caching allocator's peak of allocated bytes on the current device, and its reset."""

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()


@dataclass(frozen=True)
class Mark:
    """A point on the device's timeline, read later: an event and the anchor (event, wall seconds)
    it is measured from."""
    event: object
    anchor: tuple


class Recorder:
    def __init__(self, rank: int = 0, device: torch.device | None = None, enabled: bool = True, *,
                 events=None, clock=time.perf_counter, allocator=None):
        """``events`` (default: :class:`CudaEvents` on a CUDA device, None on CPU), ``clock`` and
        ``allocator`` (default: :class:`CudaAllocator` on CUDA, None on CPU) are seams for tests:
        anything with ``record()``, ``synchronize()`` and ``seconds_between(a, b)``; with ``peak()``
        and ``reset()``."""
        self.rank = rank
        self.cuda = device is not None and device.type == "cuda"
        self.events = events if events is not None else (CudaEvents() if self.cuda else None)
        self.enabled = enabled
        self.clock = clock
        self.origin = clock()
        self._spans: list[Span] = []
        self._by_step: dict[int, list[Span]] = {}  # the same spans, indexed for the per-step split
        self._pending: list[tuple[Span, object, object]] = []  # spans whose ends are device events
        self._anchor: tuple | None = None
        self._synced = False  # no event recorded since the last synchronisation
        self._lock = threading.Lock()  # completion callbacks add spans from the backend's thread
        self.allocator = allocator if allocator is not None else (CudaAllocator() if self.cuda else None)
        self._peaks: dict[int, int] = {}  # step -> the allocator's peak bytes (CUDA only)
        self.step = -1  # set by the training loop; -1 = outside training

    def now(self) -> float:
        """The clock, now; with device events, after a synchronisation, and a new anchor (the loop
        reads it at each step's start and end: the only synchronisations timing adds)."""
        if self.events is not None:
            with self._lock:  # a completion callback's mark is before the synchronisation or after this
                self.events.synchronize()
                t = self.clock() - self.origin
                self._anchor = (self.events.record(), t)
                self._synced = True  # the anchor is read relative to itself: nothing to wait for
            self._read_peak()
            return t
        self._read_peak()
        return self.clock() - self.origin

    def _read_peak(self) -> None:
        """At each step boundary: the allocator's peak since the previous one goes to the current step,
        then the peak is reset (so each step's is its own; what ran between two steps, the loop's
        logging, counts in the next)."""
        if self.allocator is None:
            return
        if self.step >= 0:
            self._peaks[self.step] = max(self._peaks.get(self.step, 0), int(self.allocator.peak()))
        self.allocator.reset()

    def allocator_peaks(self) -> dict | None:
        """The device allocator's peak bytes per training step (``max_memory_allocated``, reset at every
        step boundary) and their maximum; None where there is no device allocator (CPU): never estimated."""
        if self.allocator is None or not self._peaks:
            return None
        return {"source": "torch.cuda.max_memory_allocated, reset at each step boundary",
                "peak_bytes": max(self._peaks.values()),
                "by_step": {str(k): v for k, v in sorted(self._peaks.items())}}

    def mark(self):
        """A point in time to put in a span: the clock on CPU; on CUDA an event on the current
        stream, read at :meth:`resolve` (no synchronisation)."""
        if self.events is None:
            return self.clock() - self.origin
        if self._anchor is None:
            self.now()
        with self._lock:
            self._synced = False
            return Mark(self.events.record(), self._anchor)

    def add(self, category: str, name: str, t0, t1, nbytes: int = 0, *, step: int | None = None,
            **args) -> Span:
        """Record a span in ``step`` (default: the current one); ``t0``/``t1`` are seconds or
        :meth:`mark` results. Safe to call from a backend's completion thread."""
        marked = isinstance(t0, Mark) or isinstance(t1, Mark)
        span = Span(self.rank, self.step if step is None else step, category, name,
                    float("nan") if marked else t0, float("nan") if marked else t1, int(nbytes), args)
        if self.enabled:
            with self._lock:
                if marked:
                    self._pending.append((span, t0, t1))
                self._spans.append(span)
                self._by_step.setdefault(span.step, []).append(span)
        return span

    @contextmanager
    def span(self, category: str, name: str, nbytes: int = 0, **args):
        assert category in CATEGORIES, category
        t0 = self.mark()
        try:
            yield
        finally:
            self.add(category, name, t0, self.mark(), nbytes, **args)

    def resolve(self) -> None:
        """Give every span still waiting on device events its times: none after the loop's clock read at
        a step's end (which synchronised), else one synchronisation for all."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
            if not self._synced:
                self.events.synchronize()
                self._synced = True
        for span, t0, t1 in pending:
            span.t0, span.t1 = self._seconds(t0), self._seconds(t1)

    def _seconds(self, mark) -> float:
        if not isinstance(mark, Mark):
            return mark
        anchor_event, anchor_wall = mark.anchor
        return anchor_wall + self.events.seconds_between(anchor_event, mark.event)

    @property
    def spans(self) -> list[Span]:
        self.resolve()
        return self._spans

    @property
    def by_step(self) -> dict[int, list[Span]]:
        self.resolve()
        return self._by_step

    def step_spans(self, step: int) -> list[Span]:
        return list(self.by_step.get(step, ()))  # by_step resolves first

    def split(self, step: int) -> dict[str, float]:
        """Seconds by category in one step.

        Asynchronous communication (``args['async']``) overlaps other spans, so it
        is reported apart as ``comm_async`` (the time during which at least one
        operation was in flight: the union of their intervals) and never added to
        the step total. An operation whose completion the backend does not report
        (``args['unseen']``: gloo's send and recv) is not in it: its interval ends
        at its wait, so it says nothing about overlap; the time the rank blocked in
        that wait is ``comm`` as any wait is. ``forward`` and ``backward`` break
        ``compute`` down.
        """
        out = {c: 0.0 for c in CATEGORIES} | {"forward": 0.0, "backward": 0.0, "comm_async": 0.0}
        spans = self.step_spans(step)
        for s, seconds in exclusive_seconds([s for s in spans if not s.args.get(ASYNC)]):
            out[s.category] += seconds
            if s.category == "compute" and s.name in ("forward", "backward"):
                out[s.name] += seconds
        out["comm_async"] = union_length([(s.t0, s.t1) for s in spans
                                          if s.args.get(ASYNC) and not s.args.get(UNSEEN)])
        return out

    def dump(self, start: int = 0) -> list[dict]:
        """The spans recorded so far (from the ``start``-th), as dicts."""
        return [asdict(s) for s in self.spans[start:]]


def exclusive_seconds(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each span with its own time: its length less that of the spans nested directly inside it.

    Spans of one thread either follow each other or nest (a collective that a
    library issues inside a ``compute`` span, such as FSDP2's all-gathers, is a
    ``comm`` span within it); counting each moment once, in the innermost span,
    keeps the categories adding up to the step. On CUDA a collective on a side stream
    may start inside a span and end after it: the moments they share count once, in it.
    """
    own = {}
    stack: list[Span] = []
    # outer before inner; for equal intervals the one recorded later is the outer (spans are recorded at exit)
    order = sorted(range(len(spans)), key=lambda i: (spans[i].t0, -spans[i].t1, -i))
    for s in (spans[i] for i in order):
        while stack and stack[-1].t1 <= s.t0:
            stack.pop()
        own[id(s)] = s.seconds
        if stack:  # nested, or (a collective on another CUDA stream) overlapping the parent's end
            own[id(stack[-1])] -= min(s.t1, stack[-1].t1) - s.t0
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
