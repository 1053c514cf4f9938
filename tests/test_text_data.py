"""Text data for the language model: byte windows, the split, synthetic text, refusals, runs on text."""
import math
import re

import pytest
import torch

from conftest import run_paralab
from paralab.cli import main
from paralab.data import BatchSource, check_dataset, load_dataset, resolve_dataset, to_device, train_size
from paralab.data import text
from paralab.errors import UsageError
from paralab.training.evaluate import format_report, text_metrics

TINY = ["--model", "gpt", "--layers", "1", "--embed", "32", "--heads", "2", "--context", "16",
        "--batch-size", "8", "--dataset", "synthetic-text", "--synthetic-size", "256", "--no-progress",
        "--eval-batches", "2", "--eval-batch-size", "16", "--timeout", "60"]


def test_windows_are_shifted_by_one():
    stream = torch.arange(50, dtype=torch.uint8)
    x, y = text.windows(stream, context=8, stride=8)
    assert x.shape == y.shape == (text.window_count(50, 8), 8) == (6, 8)
    for i in range(len(x)):
        assert x[i].tolist() == list(range(8 * i, 8 * i + 8))
        assert y[i].tolist() == list(range(8 * i + 1, 8 * i + 9))  # the next byte of every position
    data = text.make_synthetic_text(40, context=12, seed=3)
    src = BatchSource(data, per_rank_batch=5)
    xb, yb = src.batch(2)
    assert xb.dtype == yb.dtype == torch.int64 and xb.shape == (5, 12)
    assert torch.equal(xb[:, 1:], yb[:, :-1])
    _, idx = src.indices(2)
    stream = data.train_text.long()
    for row, i in zip(yb, idx.tolist()):  # y ends at the byte after the window's x, stride = context
        assert torch.equal(row, stream[12 * i + 1:12 * i + 13])


def test_tokens_pass_through_untouched_and_stay_integer():
    data = text.make_synthetic_text(64, context=16)
    src = BatchSource(data, per_rank_batch=8, augment=True)  # augmentation asked for: not applied to text
    x, y = src.batch(0)
    _, idx = src.indices(0)
    assert torch.equal(x, data.train_x[idx].long()) and torch.equal(y, data.train_y[idx].long())
    tx, ty, real = next(src.test_batches(4))
    assert tx.dtype == ty.dtype == torch.int64 and bool(real.all())
    assert to_device(x, "cpu", torch.float64).dtype == torch.int64
    assert to_device(torch.zeros(2), "cpu", torch.float64).dtype == torch.float64


def test_split_is_deterministic_disjoint_and_the_last_tenth(tmp_path):
    raw = bytes(torch.randint(0, 256, (5003,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).tolist())
    (tmp_path / "jargon.txt").write_bytes(raw)
    a = load_dataset("jargon", tmp_path, model="gpt", context=16)
    b = load_dataset("jargon", tmp_path, model="gpt", context=16)
    assert a.source == str(tmp_path / "jargon.txt")
    assert bytes(a.train_text.tolist()) + bytes(a.test_text.tolist()) == raw
    assert len(a.test_text) == 5003 // 10 and len(a.train_text) == 5003 - 500
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    # every training window lies in the training text, every validation window in the validation text
    train = raw[:len(a.train_text)]
    assert all(bytes(w.tolist()) in train for w in a.train_y[::50])
    assert len(a.train_y) == (len(a.train_text) - 1) // 16 == train_size("jargon", tmp_path, 0, model="gpt", context=16)
    assert len(a.test_y) == (500 - 1) // 16


def test_synthetic_text_is_deterministic_and_made_of_the_grammar():
    a, b = text.synthetic_text(3000, seed=0), text.synthetic_text(3000, seed=0)
    assert a == b and len(a) == 3000 and a != text.synthetic_text(3000, seed=1)
    words = set(w for ws in text.WORDS.values() for w in ws)
    assert set(re.findall(r"[a-z]+", a.decode("ascii"))[:-1]) <= words  # the last word may be cut
    data = load_dataset("synthetic-text", None, synthetic_size=100, seed=0, model="gpt", context=16)
    assert len(data.train_y) == 100 == train_size("synthetic-text", None, 100, context=16)
    assert len(data.test_y) >= 1 and data.describe().startswith("synthetic-text: 100 train")


def test_absent_text_refused_with_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(text.TEXTS, "jargon", text.TextSource(
        **{**text.TEXTS["jargon"].__dict__, "system_dir": tmp_path / "not-installed"}))
    out = tmp_path / "never"
    code = main(["train", "single", "--model", "gpt", "--dataset", "jargon", "--num-batches", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "apt-get install jargon-text" in err and "synthetic-text" in err, err
    assert not out.exists()
    assert resolve_dataset("auto", None, "gpt") == "synthetic-text"  # auto falls back to synthetic text
    assert main(["data", "download", "jargon"]) == 2
    assert "apt-get install jargon-text" in capsys.readouterr().err
    assert main(["data", "info"]) == 0
    info = capsys.readouterr().out
    assert re.search(r"jargon\s+absent .*apt-get install jargon-text", info) and "synthetic-text" in info


@pytest.mark.parametrize("argv,holds", [(["--model", "gpt", "--dataset", "synthetic"], "holds images"),
                                        (["--model", "vgg11", "--dataset", "synthetic-text"], "holds texts")])
def test_modality_mismatch_refused(tmp_path, capsys, argv, holds):
    out = tmp_path / "never"
    assert main(["train", "single", *argv, "--num-batches", "1", "--out", str(out)]) == 2
    assert holds in capsys.readouterr().err and not out.exists()


def test_image_models_resolve_auto_as_before(tmp_path):
    assert resolve_dataset("auto", tmp_path, "vgg11") == resolve_dataset("auto", tmp_path) == "synthetic"
    with pytest.raises(UsageError, match="lower --context"):
        (tmp_path / "jargon.txt").write_bytes(b"x" * 100)
        check_dataset("jargon", tmp_path, model="gpt", context=64)


def test_installed_jargon_loads():
    path = text.text_path("jargon", None)
    if path is None:
        pytest.skip("Debian's jargon-text is not installed (apt-get install jargon-text)")
    data = load_dataset("auto", None, model="gpt", context=64)
    assert data.name == "jargon" and data.source == str(path)
    n = len(data.train_text) + len(data.test_text)
    assert n > 1_500_000 and len(data.test_text) == n // 10
    whole = bytes(data.train_text.tolist()) + bytes(data.test_text.tolist())
    assert "hacker" in whole.decode("utf-8")  # plain UTF-8 text, read as bytes
    assert len(data.train_y) == (len(data.train_text) - 1) // 64


def test_text_metrics_and_eval_report():
    m = text_metrics(2.0, correct=30, tokens=120, windows=10, dataset="synthetic-text")
    assert m["perplexity"] == pytest.approx(math.exp(2.0)) and m["accuracy"] == 0.25
    assert m["bits_per_byte"] == pytest.approx(2.0 / math.log(2))
    report = format_report(m)
    assert "perplexity   7.3891" in report and "confusion" not in report


def test_gpt_trains_on_synthetic_text(tmp_path):
    r = run_paralab("train", "single", *TINY, "--num-batches", "30", "--optimizer", "adam", "--lr", "0.01",
                    out=tmp_path / "single", fast=False)
    assert r.returncode == 0, r.stderr
    s = r.summary
    assert s["dataset"] == "synthetic-text" and s["first_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert s["final_loss"] < s["first_loss"] - 1.0  # learnable: well below a uniform guess after 30 steps
    assert s["test_perplexity"] == pytest.approx(math.exp(s["test_loss"]))
    assert "perplexity" in (tmp_path / "single" / "eval.txt").read_text() and "perplexity" in r.stdout


def test_gpt_ddp_check_passes_on_text(tmp_path):
    r = run_paralab("train", "ddp", "--workers", "2", *TINY, "--num-batches", "3", "--check",
                    out=tmp_path / "ddp", fast=False)
    assert r.returncode == 0, r.stderr + r.stdout
    s = r.summary
    assert s["check"]["result"] == "PASS" and s["test_perplexity"] == pytest.approx(math.exp(s["test_loss"]))
