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
