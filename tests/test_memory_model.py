"""The memory cost model (analysis/memory.py) against the ZeRO paper and by hand."""
import pytest

from paralab.analysis.memory import bytes_per_parameter, memory_per_worker, zero_table

GB = 1e9


def test_zero_paper_example_7_5b_parameters_64_workers_mixed_adam():
    # Rajbhandari et al., sec. 5.1 / figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    ddp, z1, z2, z3 = (e.total / GB for e in zero_table(7_500_000_000, 64, "adam", "mixed"))
    assert ddp == pytest.approx(120.0)
    assert round(z1, 1) == 31.4 and round(z2, 1) == 16.6 and round(z3, 1) == 1.9
    assert bytes_per_parameter("adam", "mixed").optimizer == 12  # the paper's K


def test_components_and_substituted_formulas():
    e = memory_per_worker(1000, 4, stage=2, optimizer="sgd-momentum", precision="fp32")
    assert (e.params.value, e.grads.value, e.optimizer_state.value) == (4000, 1000, 1000)
    assert e.total == 6000 and e.name == "zero-2"
    d = e.to_dict()
    assert d["formulas"]["total"]["formula"] == "p x Psi + (g + K) x Psi / N"
    assert d["formulas"]["total"]["substituted"].startswith("4 x 1000 + (4 + 4) x 1000 / 4")
    assert d["bytes_per_parameter"] == {"p": 4, "g": 4, "K": 4}
    assert "formula:" in e.text() and "substituted:" in e.text()


@pytest.mark.parametrize("optimizer, precision, pgk", [
    ("sgd", "fp32", (4, 4, 0)), ("sgd-momentum", "fp32", (4, 4, 4)), ("adam", "fp32", (4, 4, 8)),
    ("sgd", "mixed", (2, 2, 4)), ("sgd-momentum", "mixed", (2, 2, 8)), ("adam", "mixed", (2, 2, 12))])
def test_each_stage_shards_one_more_state(optimizer, precision, pgk):
    p, g, k = pgk
    psi, n = 12_000, 3
    totals = [e.total for e in zero_table(psi, n, optimizer, precision)]
    assert totals == [(p + g + k) * psi, (p + g) * psi + k * psi / n, p * psi + (g + k) * psi / n,
                      (p + g + k) * psi / n]


def test_working_set_line_and_bad_input():
    e = memory_per_worker(10_000, 2, stage=3, unit_parameters=2_500)  # fp32 sgd-momentum: p = g = K = 4
    assert e.working.value == (4 + 4) * 2_500 and e.components()["working"] == 20_000
    assert e.components()["peak"] == 12 * 10_000 / 2 + 20_000
    assert memory_per_worker(10_000, 2, stage=2, unit_parameters=2_500).working.value == 2 * 4 * 2_500
    assert memory_per_worker(10_000, 2, stage=1, unit_parameters=2_500).working.value == 4 * 2_500
    assert memory_per_worker(10_000, 2, stage=0, unit_parameters=2_500).working is None


def test_step_in_backward_holds_one_gradient_shard():
    e = memory_per_worker(10_000, 4, stage=3, optimizer="adam", unit_parameters=2_000, step_in_backward=True)
    assert e.grads.value == 4 * 2_000 / 4 and e.total == (4 + 8) * 10_000 / 4 + 4 * 2_000 / 4
    assert e.total_formula.formula == "(p + K) x Psi / N + g x Psi_unit / N"
    s2 = memory_per_worker(10_000, 4, stage=2, unit_parameters=2_000, step_in_backward=True)
    assert s2.total == 4 * 10_000 + 4 * 2_000 / 4 + 4 * 10_000 / 4
    for bad in ({"stage": 1, "unit_parameters": 10}, {"stage": 3}):
        with pytest.raises(ValueError):
            memory_per_worker(10_000, 4, step_in_backward=True, **bad)
    with pytest.raises(ValueError):
        memory_per_worker(10, 2, stage=4)
    with pytest.raises(ValueError):
        memory_per_worker(10, 2, optimizer="lamb")
    with pytest.raises(ValueError):
        memory_per_worker(10, 2, precision="fp8")
