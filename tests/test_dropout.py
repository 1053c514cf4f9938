"""The gpt's dropout (models/dropout.py): masks every layout draws alike, so --check stays exact with it.

In one process: a mask depends on the seed, the step, the block and where a value sits in the global batch
(its row, its token's position), not on how the batch or the sequence is cut. Then the check itself, with
``--dropout 0.2``, under data parallelism with recomputation; under every other strategy and composition it is
checked with clipping and packed documents on too (tests/test_features_together.py, slow selection).
"""
from __future__ import annotations

import pytest
import torch

from paralab.models import build_model, dropout
from paralab.models.dropout import Dropout
from paralab.training import step as steps

from conftest import run_paralab

SHAPE = dict(layers=2, heads=4, embed=32, context=16)


def masked(x, seed=0, step=0, rows=None, first=0, offsets=None, mb=0, positions=None, index=1):
    """What a Dropout(0.5) keeps of ``x``, drawn as a forward sitting at those coordinates would draw it."""
    d = Dropout(0.5, context=16)
    d.train()
    d.position_ids = positions
    with steps.entered(steps.Step(step, seed, rows=rows or len(x), first=first)):
        if offsets:
            steps.split(offsets)
        dropout.enter_unit(index)
        with steps.microbatch(mb):
            return d(x)


def test_a_value_gets_the_same_mask_however_the_batch_and_sequence_are_cut():
    x = torch.ones(8, 16, 4)
    whole = masked(x)
    # shards of rows (data parallelism), microbatches within a shard (accumulation, a pipeline)
    assert torch.equal(masked(x[4:], rows=8, first=4), whole[4:])
    assert torch.equal(masked(x[6:], rows=8, first=4, offsets=[2, 2], mb=1), whole[6:])
    # a rank's positions of the sequence (context parallelism's head and tail chunks, a sequence shard)
    chunks = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    assert torch.equal(masked(x[:, chunks], positions=chunks), whole[:, chunks])
    # and a mask is not the same elsewhere: another step, block or seed draws another one
    for other in (masked(x, step=1), masked(x, index=2), masked(x, seed=1)):
        assert not torch.equal(other, whole)
    assert 0.3 < (whole == 0).float().mean() < 0.7  # p = 0.5, and kept values scaled by 2
    assert set(whole.unique().tolist()) == {0.0, 2.0}


def test_off_in_evaluation_and_at_p_zero_and_the_same_model_without_it():
    torch.manual_seed(0)
    plain = build_model("gpt", **SHAPE)
    torch.manual_seed(0)
    dropping = build_model("gpt", **SHAPE, dropout=0.3)
    assert plain.state_dict().keys() == dropping.state_dict().keys()  # no parameter, no buffer
    x = torch.randint(0, 256, (2, 16))
    dropping.eval()
    plain.eval()
    assert torch.equal(dropping(x), plain(x))


def test_a_microbatch_no_driver_placed_is_refused_rather_than_drawn_wrong():
    d = Dropout(0.5, context=16)
    d.train()
    with steps.entered(steps.Step(rows=8)):
        steps.split([4, 4])
        with steps.microbatch(5), pytest.raises(RuntimeError, match="was not split into"):
            d(torch.ones(4, 16, 4))
    assert steps.current() == steps.Step()  # nothing of the step is left once its driver is done


GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--layers", "4", "--embed", "32", "--heads", "4",
       "--context", "16", "--batch-size", "16", "--num-batches", "3", "--dropout", "0.2", "--check", "--precision", "fp64",
       "--eval-batches", "1", "--eval-batch-size", "16"]
#: alone, in the default selection: data parallelism with each block recomputed in backward, where the masks must
#: be drawn again alike; under every other layout, with clipping and packed documents: tests/test_features_together.py
LAYOUT = ["ddp", "--workers", "2", "--recompute", "full"]


def test_the_check_is_exact_with_dropout(tmp_path):
    r = run_paralab("train", *LAYOUT, *GPT, out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    check = r.summary["check"]
    assert check["precision"] == "fp64" and check["max_weight_dev"] <= 1e-12, check
    assert not any("draws no random numbers" in n for n in check["unexercised"])
