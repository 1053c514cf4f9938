"""Correct layouts never say bug: every built-in layout of bench/check_band.py, fp32 and bf16, 20 steps.

The slow selection's share of the band's matrix: each layout of ``LAYOUTS`` (the data-parallel flavours, ZeRO
1/2/3, HSDP, tp and sp, the pipeline schedules, cp ring and all-to-all, experts, recomputation, the lossy
compressions, dp x tp x pp) at one seed in each precision, two runs at a time; ``bench/check_band.py`` runs three
seeds of each and the seeded bugs beside them (docs/correctness.md, "Bug or rounding"). Each must end ``exact`` or
``within rounding``, its worst ratio to the band at most 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from check_band import COMMON, GPT, LAYOUTS, precision_args  # noqa: E402 - the bench's own matrix, not a copy

pytestmark = pytest.mark.slow
PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    from conftest import selected, side_by_side
    chosen = {(p["name"], p["precision"]) for p in selected(request, "test_a_correct_layout_is_never_a_bug")}
    jobs = {(name, p): (*LAYOUTS[name], *GPT, *COMMON, *precision_args(p), "--num-batches", "20", "--check-every", "5",
                        "--no-first-divergence")
            for name in LAYOUTS for p in PRECISIONS if (name, p) in chosen}
    return side_by_side(jobs, tmp_path_factory.mktemp("matrix"), timeout=600)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_correct_layout_is_never_a_bug(runs, name, precision):
    r = runs[(name, precision)]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    check = r.summary["check"]
    assert check["verdict"] in ("exact", "within rounding") and check["result"] == "PASS", r.stdout[-3000:]
    # exact (the compressed runs: the reference replays them bit for bit) needs no band; else inside it
    assert check["verdict"] == "exact" or 0 < check["worst_ratio"] <= 1, check
