"""Dropout, gradient clipping and packed documents, all three on, under every layout: ``--check`` exact in fp64.

Each feature has its own tests that it is right in one process against references paralab did not write
(tests/test_dropout.py, tests/test_clip.py, tests/test_documents.py) and a run of its own, alone, in the
default selection. Under every layout they are checked here together, one run per layout (the three
matrices each ran every layout apart: 59 runs, now 35): a strategy that draws a mask wrong, counts a
replicated gradient twice in the norm or weighs a document's tokens by its microbatch fails its check
here as it did alone, and the seeded bugs of each (tests/test_mutants.py) are still caught each on its own.

SGD with momentum, not Adam: Adam's step is blind to a gradient scaled by one factor, which is what a norm
or a token count gone wrong does (the AdamW recipe has its own matrix, tests/test_recipe.py). The clip
(0.05, against norms of about 2) fires at every step, so the weights compared depend on the norm.
"""
from __future__ import annotations

import pytest

from test_clip import norms_recorded

CLIP = 0.05
ARGS = ["--model", "gpt", "--dataset", "synthetic-docs", "--packing", "--doc-length", "10", "--synthetic-size", "256",
        "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16", "--batch-size", "16",
        "--eval-batches", "1", "--eval-batch-size", "16", "--num-batches", "3", "--precision", "fp64",
        "--dropout", "0.2", "--clip-grad", str(CLIP), "--check"]
W2, W4 = ["--workers", "2"], ["--workers", "4"]
LAYOUTS = [
    ["single"], ["single", "--recompute", "full"],
    ["ddp", *W2, "--accumulate", "2"], ["ddp", *W2, "--recompute", "full"],
    ["gather-scatter", *W2, "--accumulate", "2"], ["torch-ddp", *W2], ["model", *W2],
    ["fsdp", *W2, "--zero-stage", "1"], ["fsdp", *W2, "--zero-stage", "3"],
    ["fsdp", "--workers", "3", "--zero-stage", "3", "--batch-size", "18"],
    ["fsdp", *W4, "--zero-stage", "2", "--replicate", "2"], ["fsdp", *W4, "--zero-stage", "3", "--replicate", "2"],
    ["fsdp", *W4, "--zero-stage", "3", "--tp", "2"],
    ["torch-fsdp", *W2], ["torch-fsdp", *W4, "--tp", "2"],
    ["pipeline", *W2, "--microbatches", "4", "--schedule", "1f1b", "--recompute", "full"],
    ["pipeline", *W2, "--microbatches", "4", "--schedule", "zb-h1", "--recompute", "full"],
    ["pipeline", *W2, "--microbatches", "4", "--schedule", "zb-h2"],
    ["pipeline", *W2, "--microbatches", "4", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
     "--layers", "4"],
    ["torch-pipeline", *W2, "--microbatches", "2"], ["torch-pipeline", *W2, "--microbatches", "4", "--schedule", "zbv"],
    ["tp", *W2], ["tp", *W2, "--sequence-parallel"], ["torch-tp", *W2], ["torch-tp", *W2, "--sequence-parallel"],
    ["cp", *W2, "--cp-method", "ring"], ["cp", *W2, "--cp-method", "all-to-all"], ["cp", *W2, "--no-cp-balance"],
    ["cp", *W4, "--cp-method", "ring", "--context", "32"],
    ["ddp", *W4, "--tp", "2", "--pp", "2", "--microbatches", "2"],
    ["ddp", *W4, "--tp", "2", "--sequence-parallel", "--pp", "2", "--microbatches", "2", "--recompute", "full"],
    ["allreduce", *W4, "--cp", "2", "--pp", "2", "--microbatches", "2", "--batch-size", "8"],
    ["ddp", *W4, "--cp", "2", "--pp", "2", "--microbatches", "2", "--batch-size", "8"],
    ["allreduce", *W2, "--ep", "2", "--experts", "4", "--top-k", "2"],
    ["ddp", *W2, "--cp", "2", "--batch-size", "8", "--optimizer", "adamw", "--lr-schedule", "cosine"],
]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected layouts' runs, two at a time: layout -> Result."""
    from conftest import selected, side_by_side
    jobs = {tuple(w["layout"]): (w["layout"][0], *ARGS, *w["layout"][1:])
            for w in selected(request, "test_dropout_clipping_and_packed_documents_are_exact_together")}
    return side_by_side(jobs, tmp_path_factory.mktemp("together"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda a: " ".join(a))
def test_dropout_clipping_and_packed_documents_are_exact_together(layout, runs):
    r = runs[tuple(layout)]
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["precision"] == "fp64" and check["max_weight_dev"] <= 1e-12, check
    assert check["max_grad_norm_dev"] <= 1e-12, check
    assert not [n for n in check["unexercised"] if "random numbers" in n or "never clipped" in n], check
    norms = norms_recorded(r)
    assert all(v == norms[0] for v in norms.values()), norms  # every rank clipped by the same norm
    assert all(n > 10 * CLIP for n in norms[0])
    if layout[0] == "cp" and "--no-cp-balance" not in layout and "all-to-all" not in layout:  # the ring's chunks,
        # dealt by the documents' blocks (Ulysses splits heads, not the sequence's work)
        assert r.summary["strategy_details"]["0"]["context_parallel"]["document_balance"]["steps"] == 3
