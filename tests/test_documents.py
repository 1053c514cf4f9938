"""Documents (issue 38): packed or padded rows, the token-weighted loss, document-causal attention, the cp balancer.

The references here are not paralab's: a packed row's attention is compared with each document run alone
through PyTorch's causal attention; the loss with ``F.cross_entropy`` over the whole batch's valid targets;
ring attention with one process's masked attention; the balancer's count of blocks with a brute-force mask.
Then ``--check`` on packed documents under three layouts (the reference replays the same data in one process;
every other layout is checked with dropout and clipping on too, tests/test_features_together.py), and
the two seeded bugs a check of documents must catch are in tests/test_mutants.py (a loss averaged per
microbatch, ring attention that crosses a boundary).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn_ranks import spawn

from conftest import run_paralab
from paralab.cli import main
from paralab.comm import Comm
from paralab.data import BatchSource, load_dataset, train_size
from paralab.data import documents as data_docs
from paralab.data.documents import EOD, IGNORE, doc_ids, jargon_entries, mask_targets
from paralab.models import documents
from paralab.recorder import Recorder
from paralab.strategies.context import balance
from paralab.strategies.context.layout import Layout
from paralab.strategies.context.ring import ring_attention
from paralab.strategies.context.ulysses import ulysses_attention
from paralab.training import losses, step as steps

DOCS = ["--model", "gpt", "--dataset", "synthetic-docs", "--doc-length", "10", "--synthetic-size", "256",
        "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16", "--batch-size", "16",
        "--eval-batches", "1", "--eval-batch-size", "16", "--num-batches", "3", "--precision", "fp64"]


# ---------------------------------------------------------------- the data
def test_synthetic_documents_are_seeded_and_their_lengths_log_normal():
    a = data_docs.synthetic_documents(200_000, median=40, seed=0)
    assert a == data_docs.synthetic_documents(200_000, median=40, seed=0) != data_docs.synthetic_documents(
        200_000, median=40, seed=1)
    lengths = sorted(len(d) for d in a)
    assert all(EOD not in d for d in a)
    median = lengths[len(lengths) // 2]
    assert 32 <= median <= 48, median       # log-normal around 40 (strip() takes a space now and then)
    # sigma 1: the 84th percentile about e times the median
    assert 2.2 < lengths[int(0.84 * len(lengths))] / median < 3.3


def test_packed_rows_are_the_stream_and_padded_rows_hold_one_document_each():
    packed = load_dataset("synthetic-docs", None, synthetic_size=100, model="gpt", context=16, packing=True,
                          doc_length=12)
    padded = load_dataset("synthetic-docs", None, synthetic_size=100, model="gpt", context=16, packing=False,
                          doc_length=12)
    assert packed.train_docs == padded.train_docs
    stream = b"".join(d + bytes([EOD]) for d in packed.train_docs)
    for i in (0, 7, len(packed.train_y) - 1):  # window i is the stream's bytes 16 i .. 16 i + 16
        assert bytes(packed.train_x[i].tolist()) == stream[16 * i:16 * i + 16]
        assert bytes(packed.train_y[i].tolist()) == stream[16 * i + 1:16 * i + 17]
    rows = torch.cat([padded.train_x, padded.train_y[:, -1:]], 1)
    for row in rows:  # one document, then only padding: no EOD is followed by a byte of text
        ends = (row == EOD).nonzero().flatten().tolist()
        if ends:  # a row that ends its document holds only its EOD and padding after it (a middle row: none)
            assert ends == list(range(ends[0], len(row)))
    needed = sum(max(1, math.ceil(len(d) / 16)) for d in padded.train_docs)  # len(d) + 1 bytes, windows of 17
    assert len(padded.train_y) == needed == train_size("synthetic-docs", None, 100, model="gpt", context=16,
                                                       doc_length=12)


def test_targets_outside_a_document_are_ignored_and_ids_count_the_ends():
    x = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9]])
    y = torch.tensor([[6, EOD, 7, EOD, EOD, 8, 9, 1]])
    assert mask_targets(x, y).tolist() == [[6, EOD, IGNORE, EOD, IGNORE, IGNORE, 9, 1]]
    assert doc_ids(x).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # an EOD belongs to the document it ends
    data = load_dataset("synthetic-docs", None, synthetic_size=64, model="gpt", context=16, packing=False,
                        doc_length=8)
    xb, yb = BatchSource(data, per_rank_batch=8).batch(0)
    assert torch.equal(yb == IGNORE, xb == EOD) and bool((yb == IGNORE).any())


def test_the_jargon_file_is_cut_at_its_entries(tmp_path):
    front = b"The Jargon File\n\n   Table of Contents\n\n"
    entries = [b"   :foo: n.\n\n   A word.\n", b"   :bar baz: /bar/, v.\n\n   Another,\n   on two lines.\n",
               b"   :qux:\n\n   The last one.\n"]
    tail = b"\n                             Part\xc2\xa0III.\xc2\xa0Appendices\n\n   A. Hacker Folklore\n"
    raw = front + b"\n".join(entries) + tail
    assert jargon_entries(raw) == [e.strip() for e in entries]  # front matter and appendices left out
    (tmp_path / "jargon.txt").write_bytes(raw * 4)  # twelve entries: the last tenth (one) validates
    data = load_dataset("jargon-entries", tmp_path, model="gpt", context=8, packing=True)
    assert len(data.train_docs) == 4 * 3 - 1 and len(data.test_docs) == 1  # front/tail between copies end an entry


def test_the_installed_jargon_file_has_its_entries():
    from paralab.data.text import read_text_bytes, text_path
    path = text_path("jargon", None)
    if path is None:
        pytest.skip("the Jargon File is not installed (make data)")
    docs = jargon_entries(read_text_bytes(path))
    assert len(docs) == 2307 and docs[0].startswith(b":(TM):") and docs[-1].startswith(b":zorkmid:")


# ---------------------------------------------------------------- the loss
def test_any_split_weighted_by_its_elements_gives_the_global_token_mean():
    """Shards, microbatches and sequence chunks of unequal valid counts, each losing cross_entropy() under the
    step's count and combined by their share of the elements (as every layout combines them), give
    F.cross_entropy's mean over the valid targets of the whole batch; per-piece means do not."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 12, 11, dtype=torch.float64, generator=g)
    target = torch.randint(0, 11, (8, 12), generator=g)
    target[:3, 4:] = IGNORE     # short documents in the first rows: unequal counts
    target[6, :10] = IGNORE
    expected = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=IGNORE)
    with steps.entered(steps.Step(valid=int((target != IGNORE).sum()), elements=target.numel())):
        pieces = [(slice(0, 2), slice(0, 12)), (slice(2, 4), slice(0, 6)), (slice(2, 4), slice(6, 12)),
                  (slice(4, 8), slice(0, 3)), (slice(4, 8), slice(3, 12))]
        combined = sum(losses.cross_entropy(logits[r, c], target[r, c]) * target[r, c].numel() / target.numel()
                       for r, c in pieces)
        assert combined.item() == pytest.approx(expected.item(), rel=1e-13)
        per_piece_means = sum(F.cross_entropy(logits[r, c].reshape(-1, 11), target[r, c].reshape(-1),
                                              ignore_index=IGNORE) * target[r, c].numel() / target.numel()
                              for r, c in pieces)
        assert abs(per_piece_means.item() - expected.item()) > 1e-3  # the bug the mutant seeds
    plain = torch.randint(0, 11, (8, 12), generator=g)  # no documents: the plain mean, bit for bit
    assert torch.equal(losses.cross_entropy(logits, plain), F.cross_entropy(logits.reshape(-1, 11), plain.reshape(-1)))


# ---------------------------------------------------------------- attention
def _packed_ids(rows: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 50, (rows, t), generator=g)
    x[torch.rand(rows, t, generator=g) < 0.15] = EOD
    return doc_ids(x)


def test_packed_attention_is_each_document_alone():
    g = torch.Generator().manual_seed(1)
    b, h, t, d = 3, 2, 24, 4
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64, generator=g) for _ in range(3))
    ids = _packed_ids(b, t, 2)
    with steps.entered(steps.Step(doc_ids=ids)):
        out = documents.attention(q, k, v)
    for row in range(b):
        for doc in ids[row].unique().tolist():
            cols = (ids[row] == doc).nonzero().flatten()
            alone = F.scaled_dot_product_attention(q[row:row + 1, :, cols], k[row:row + 1, :, cols],
                                                   v[row:row + 1, :, cols], is_causal=True)
            assert torch.allclose(out[row:row + 1, :, cols], alone, rtol=0, atol=1e-13)
    assert torch.equal(documents.attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


B, H, T, D = 3, 4, 32, 8


def _cp_case(comm, method, layout):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    ids = _packed_ids(B, T, 3)
    with steps.entered(steps.Step(doc_ids=ids)):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = documents.attention(*whole)
        expected.backward(dout)
        mine = [layout.take(t, comm.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        core = ring_attention if method == "ring" else ulysses_attention
        out = core(*mine, comm=comm, layout=layout, recorder=comm.recorder)
        out.backward(layout.take(dout, comm.rank, dim=2))
    worst = {"out": (out - layout.take(expected, comm.rank, dim=2)).abs().max().item()}
    for name, m, w in zip("qkv", mine, whole):
        worst["d" + name] = (m.grad - layout.take(w.grad, comm.rank, dim=2)).abs().max().item()
    return worst


def _cp_rank(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world)
    comm = Comm(Recorder(rank, torch.device("cpu")), rank, world)
    fixed = Layout(T, world, True)
    work = balance.block_work(_packed_ids(B, T, 3), fixed.chunks)
    dealt = Layout(T, world, True, balance.deal(work, tuple(fixed.chunks_of(r) for r in range(world))))
    layouts = {"balanced": fixed, "contiguous": Layout(T, world, False), "dealt": dealt}
    results = {f"{m}-{name}": _cp_case(comm, m, layout) for m in ("ring", "all-to-all")
               for name, layout in layouts.items()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_on_packed_documents_equals_one_process(tmp_path, world):
    spawn(_cp_rank, (world, tmp_path), world)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6
        for case, worst in results.items():
            assert max(worst.values()) < 1e-12, (rank, case, worst)


# ---------------------------------------------------------------- the cp balancer
def test_block_work_counts_the_rows_a_mask_needs():
    for seed in range(5):
        ids = _packed_ids(4, 48, seed)
        chunks, c = 6, 8
        pos = torch.arange(48)
        mask = (ids.unsqueeze(2) == ids.unsqueeze(1)) & (pos.unsqueeze(1) >= pos.unsqueeze(0))
        brute = [[sum(int(mask[r, a * c:(a + 1) * c, b * c:(b + 1) * c].any()) for r in range(4)) for b in range(chunks)]
                 for a in range(chunks)]
        assert balance.block_work(ids, chunks) == brute


def _ring_by_hand(work, assignment):
    """The ring's rotations walked as ring.py walks them: rank r computes its query chunks against source
    (r - i)'s key chunks at rotation i; the rotation lasts as long as its busiest rank."""
    total = 0
    ranks = len(assignment)
    for i in range(ranks):
        loads = []
        for r in range(ranks):
            source = (r - i) % ranks
            loads.append(sum(work[a][b] for a in assignment[r] for b in assignment[source] if b <= a))
        total += max(loads)
    return total


def test_dealt_chunks_are_a_partition_never_slower_than_head_and_tail():
    g = torch.Generator().manual_seed(0)
    better = 0
    for trial in range(60):
        ranks = int(torch.randint(2, 5, (1,), generator=g))
        ids = _packed_ids(int(torch.randint(1, 4, (1,), generator=g)), 8 * ranks * 4, trial)
        work = balance.block_work(ids, 2 * ranks)
        pairs = tuple((r, 2 * ranks - 1 - r) for r in range(ranks))
        dealt = balance.deal(work, pairs)
        assert sorted(a for chunks in dealt for a in chunks) == list(range(2 * ranks))
        assert all(len(chunks) == 2 for chunks in dealt)
        assert balance.ring_time(work, dealt) == _ring_by_hand(work, dealt)
        assert balance.ring_time(work, dealt) <= balance.ring_time(work, pairs)
        assert balance.ring_time(work, dealt) >= balance.even_time(work, ranks)
        better += balance.ring_time(work, dealt) < balance.ring_time(work, pairs)
    assert better > 10  # it does deal differently, often


# ---------------------------------------------------------------- runs: every layout checked
FAST_LAYOUTS = [
    ("ddp", "--workers", "2", "--accumulate", "2"),
    ("cp", "--workers", "2"),
    ("pipeline", "--workers", "2", "--microbatches", "2"),
]
def _checked(tmp_path, layout, *extra):
    r = run_paralab("train", *layout, *DOCS, "--check", *extra, out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.parametrize("layout", FAST_LAYOUTS, ids=lambda a: " ".join(a))
def test_packed_documents_are_exact_under(layout, tmp_path):
    r = _checked(tmp_path, layout, "--packing")
    if layout[0] == "cp":  # the chunks dealt by the documents' blocks, and how even, in the summary
        balance_seen = r.summary["strategy_details"]["0"]["context_parallel"]["document_balance"]
        assert balance_seen["steps"] == 3
        assert 1 <= balance_seen["dealt_over_even"] <= balance_seen["head_tail_over_even"]


def test_padded_documents_are_exact_and_the_validation_counts_valid_targets(tmp_path):
    r = _checked(tmp_path, ("ddp", "--workers", "2", "--accumulate", "2"))
    data = load_dataset("synthetic-docs", None, synthetic_size=256, model="gpt", context=16, doc_length=10)
    x, y = data.test_x[:16].long(), data.test_y[:16].long()  # --eval-batches 1 of 16: the first 16 windows
    valid = int((mask_targets(x, y) != IGNORE).sum())
    assert f"(synthetic-docs: 16 windows, {valid} tokens)" in (r.out / "eval.txt").read_text()
    assert valid < y.numel()  # padding left out of the validation loss


def test_the_course_setting_passes_packed(tmp_path):
    _checked(tmp_path, ("tp", "--workers", "2"), "--packing", "--precision", "fp32")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv,says", [
    (["--packing"], "--dataset auto (for --model vgg11: images) has none"),
    (["--model", "gpt", "--dataset", "synthetic-text", "--packing"], "--dataset synthetic-text has none"),
    (["--dataset", "synthetic", "--packing"], "--dataset synthetic has none"),
    (["--model", "gpt", "--dataset", "synthetic-docs", "--doc-length", "0"], "--doc-length must be positive"),
    (["--dataset", "synthetic-docs"], "--model vgg11 reads images but --dataset synthetic-docs holds texts"),
])
def test_packing_without_documents_is_refused(tmp_path, capsys, argv, says):
    out = tmp_path / "run"
    assert main(["train", "single", *argv, "--num-batches", "1", "--out", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()
