import pytest

from paralab.recorder import Recorder, union_length


def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == 3
    assert union_length([(0, 5), (1, 2)]) == 5


def test_split_by_category_keeps_async_apart():
    rec = Recorder()
    rec.step = 0
    rec.add("compute", "forward", 0.0, 1.0)
    rec.add("compute", "backward", 1.0, 3.0)
    rec.add("comm", "all_reduce", 3.0, 3.5, 100)
    rec.add("comm", "bucket0", 1.5, 2.5, 10, **{"async": True})
    rec.add("comm", "bucket1", 2.0, 3.2, 10, **{"async": True})
    rec.step = 1
    rec.add("optimizer", "step", 4.0, 9.0)  # another step: not counted
    split = rec.split(0)
    assert split["compute"] == 3.0 and split["forward"] == 1.0 and split["backward"] == 2.0
    assert split["comm"] == 0.5 and split["optimizer"] == 0.0
    assert abs(split["comm_async"] - 1.7) < 1e-12  # union of [1.5, 2.5] and [2.0, 3.2]


def test_an_operation_whose_completion_is_unseen_is_not_counted_as_overlap():
    """gloo's isend/irecv report no completion: the span ends at the wait, which says nothing of overlap."""
    rec = Recorder()
    rec.step = 0
    rec.add("compute", "forward", 0.0, 2.0)
    rec.add("comm", "send", 0.5, 2.5, 10, **{"async": True, "unseen": True})
    rec.add("comm", "wait:send", 2.0, 2.5, op="send")
    split = rec.split(0)
    assert split["comm_async"] == 0.0 and split["comm"] == 0.5 and split["compute"] == 2.0


def test_nested_spans_count_each_moment_once_in_the_innermost():
    rec = Recorder()
    rec.step = 0
    rec.add("compute", "forward", 0.0, 4.0)       # a library's all-gathers run inside the forward
    rec.add("comm", "all_gather", 0.5, 1.0, 10)
    rec.add("comm", "all_gather", 2.0, 3.0, 10)
    rec.add("compute", "backward", 4.0, 8.0)
    rec.add("comm", "reduce_scatter", 7.0, 8.0, 10)  # ends with its parent
    rec.add("optimizer", "step", 8.0, 9.0)
    split = rec.split(0)
    assert split["comm"] == 2.5 and split["compute"] == 5.5
    assert split["forward"] == 2.5 and split["backward"] == 3.0
    assert split["comm"] + split["compute"] + split["optimizer"] == 9.0  # the step, once


def test_equal_intervals_count_once_in_the_span_recorded_first():
    rec = Recorder()
    rec.step = 0
    rec.add("comm", "all_gather", 1.0, 2.0, 10)  # inner: recorded first (spans are recorded at exit)
    rec.add("compute", "forward", 1.0, 2.0)
    split = rec.split(0)
    assert split["comm"] == 1.0 and split["compute"] == 0.0


# ---------------------------------------------------------------- the CUDA event path, with a fake device clock
class FakeClock:
    """The host's clock (seconds), advanced by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeEvents:
    """Device events on a fake stream: each records the *device* time when the stream reaches it, which
    the test sets (``device``) independently of the host clock, as a GPU runs behind the host."""

    def __init__(self):
        self.device = 0.0
        self.syncs = 0
        self.recorded = 0

    def record(self):
        self.recorded += 1
        return {"device": self.device}

    def synchronize(self):
        self.syncs += 1

    def seconds_between(self, a, b):
        return b["device"] - a["device"]


def test_event_spans_are_read_after_the_step_with_one_synchronisation():
    clock, events = FakeClock(), FakeEvents()
    rec = Recorder(0, events=events, clock=clock)  # origin: host time 100
    rec.step = 0
    clock.t, events.device = 101.0, 50.0  # the step starts: host 1 s after the origin; device time 50
    t0 = rec.now()
    assert t0 == 1.0 and events.syncs == 1
    with rec.span("compute", "forward"):
        events.device = 50.5              # the stream reaches the span's end 0.5 s later (the host is ahead)
    launch = rec.mark()                   # an asynchronous operation launched on the stream
    with rec.span("compute", "backward"):
        events.device = 52.0
    events.device = 53.0
    rec.add("comm", "bucket0", launch, rec.mark(), 64, **{"async": True})  # its completion, 2.5 s after launch
    with rec.span("optimizer", "step"):
        events.device = 53.25
    assert events.syncs == 1  # nothing synchronised per span
    assert all(s.t0 != s.t0 for s in rec._spans)  # not read yet (NaN)
    clock.t = 104.0
    rec.now()                              # the step's end
    split = rec.split(0)                   # reads every event: the step's end already synchronised
    assert events.syncs == 2               # one per step boundary, none per span
    spans = {s.name: s for s in rec.step_spans(0)}
    assert (spans["forward"].t0, spans["forward"].t1) == (1.0, 1.5)
    assert (spans["backward"].t0, spans["backward"].t1) == (1.5, 3.0)
    assert (spans["bucket0"].t0, spans["bucket0"].t1) == (1.5, 4.0) and spans["bucket0"].step == 0
    assert (spans["step"].t0, spans["step"].t1) == (4.0, 4.25)
    assert split["forward"] == 0.5 and split["backward"] == 1.5 and split["optimizer"] == 0.25
    assert split["comm_async"] == 2.5  # overlapping backward: in flight, not serialised
    assert rec.split(0) == split and events.syncs == 2  # nothing left to read
    with rec.span("compute", "eval"):
        events.device = 54.0               # after the step: read with one synchronisation of its own
    rec.dump()
    assert events.syncs == 3


def test_event_spans_keep_their_step_and_anchor_across_steps():
    clock, events = FakeClock(), FakeEvents()
    rec = Recorder(0, events=events, clock=clock)
    rec.step = 0
    clock.t, events.device = 100.0, 0.0
    rec.now()
    launch = rec.mark()
    rec.step = 1
    clock.t, events.device = 110.0, 10.0  # the next step's anchor: host 10 s, device 10 s
    rec.now()
    with rec.span("compute", "forward"):
        events.device = 11.0
    # completion seen during step 1, for an operation launched in step 0 (measured from its own anchor)
    rec.add("comm", "late", launch, rec.mark(), step=0, **{"async": True})
    dumped = {d["name"]: d for d in rec.dump()}
    assert (dumped["forward"]["t0"], dumped["forward"]["t1"]) == (10.0, 11.0)
    assert dumped["late"]["step"] == 0 and (dumped["late"]["t0"], dumped["late"]["t1"]) == (0.0, 11.0)


def test_cpu_spans_read_the_clock_and_never_use_events():
    clock = FakeClock()
    rec = Recorder(0, clock=clock)
    rec.step = 0
    clock.t = 101.0
    with rec.span("compute", "forward"):
        clock.t = 102.5
    (s,) = rec.step_spans(0)
    assert (s.t0, s.t1) == (1.0, 2.5) and rec.events is None and isinstance(rec.mark(), float)


def test_a_span_overlapping_its_parents_end_counts_the_shared_moments_once():
    rec = Recorder()
    rec.step = 0
    rec.add("compute", "forward", 0.0, 4.0)
    rec.add("comm", "all_gather", 3.0, 5.0, 10)  # on a side stream: starts inside forward, ends after it
    rec.add("compute", "backward", 5.0, 6.0)
    split = rec.split(0)
    assert split["forward"] == 3.0 and split["comm"] == 2.0 and split["backward"] == 1.0
    assert split["compute"] + split["comm"] == 6.0  # the step, once


class FakeAllocator:
    def __init__(self):
        self.now = self.max = 0
        self.resets = 0

    def allocate(self, n):
        self.now += n
        self.max = max(self.max, self.now)

    def free(self, n):
        self.now -= n

    def peak(self):
        return self.max

    def reset(self):
        self.max = self.now
        self.resets += 1


def test_allocator_peak_per_step_reset_at_each_boundary():
    alloc = FakeAllocator()
    rec = Recorder(0, allocator=alloc)
    assert Recorder(0).allocator_peaks() is None  # CPU: nothing, never an estimate
    alloc.allocate(100)                 # before training (the model): resets start from it
    for step, transient in ((0, 50), (1, 20)):
        rec.step = step
        rec.now()
        alloc.allocate(transient)
        alloc.free(transient)
        rec.now()
        rec.step = -1
    peaks = rec.allocator_peaks()
    assert peaks["by_step"] == {"0": 150, "1": 120} and peaks["peak_bytes"] == 150


def test_a_reader_puts_the_allocator_peak_beside_the_prediction():
    """The run records the ledger's model and the allocator's peak; the prediction beside them is added where
    the run is read (analysis/beside.py), not by the run (derive_details adds none)."""
    from paralab.analysis.beside import add_predictions
    from paralab.run.config import RunConfig
    from paralab.kinds import ALLOCATOR, MEMORY, MemoryModel
    from paralab.run.records import derive_details
    model = MemoryModel(parameters=1000, workers=2, zero_stage=3, optimizer="sgd", precision="fp32",
                        unit_parameters=100).to_dict()
    details = [{MEMORY: {"model": model}, ALLOCATOR: {"peak_bytes": 4000, "by_step": {"0": 4000}}},
               {MEMORY: {"model": model}}]  # a rank without a device allocator: nothing added
    derive_details(RunConfig(), [], details)
    assert "predicted" not in details[0][MEMORY]
    add_predictions({}, {"strategy_details": {str(r): d for r, d in enumerate(details)}})
    beside = details[0][MEMORY]["allocator"]
    predicted = details[0][MEMORY]["predicted"]["bytes"]["peak"]  # (4 + 4) x 1000 / 2 + (4 + 4) x 100
    assert predicted == 4800 and beside["predicted_peak_bytes"] == 4800 and beside["peak_bytes"] == 4000
    assert beside["measured_over_predicted"] == 4000 / 4800
    assert "allocator" not in details[1][MEMORY]


def test_summary_gives_the_mean_and_the_median_step_of_the_slowest_rank():
    from types import SimpleNamespace

    from paralab.run.records import summarize
    cfg = SimpleNamespace(strategy="toy", model="mlp", width=1.0, norm="none", dataset="synthetic",
                          precision="fp32", warmup=1)
    # step 0 is warm-up; then the slowest rank takes 1, 1, 1 and (one disturbed step) 5 seconds
    seconds = {0: (9.0, 8.0), 1: (1.0, 0.5), 2: (0.9, 1.0), 3: (1.0, 1.0), 4: (5.0, 0.2)}
    steps = [{"step": s, "rank": r, "seconds": t[r], "split": {}, "samples": 8, "loss": 1.0}
             for s, t in seconds.items() for r in (0, 1)]
    s = summarize(cfg, steps, [], parameters=1, world=2, global_batch=8, evaluation=None, check=None,
                  error=None)
    assert s["measured_steps"] == 4
    assert s["seconds_per_iter"] == pytest.approx(2.0) and s["seconds_per_iter_median"] == pytest.approx(1.0)
    assert s["samples_per_s"] == pytest.approx(8 * 4 / 8.0)
