"""Test-split evaluation: loss, accuracy, per-class precision/recall/F1, confusion matrix;
for a language model (a text dataset) the validation loss per token, its perplexity,
bits per byte and next-token accuracy (256 byte classes: no confusion matrix).

Each rank predicts the test samples it is given (data-parallel ranks a
strided share, padded to equal length and the padding left out of the counts;
pipeline ranks all of it, the last stage producing logits);
confusion matrices and loss sums are then added over the data-parallel
shards, each shard's once (:func:`once_per_shard`: the ranks of one shard, a
tp or cp group, may each hold its logits), so the numbers are the same
whatever the strategy.
"""
from __future__ import annotations

import math

import torch

from ..data.loader import to_device
from . import step as steps
from .losses import IGNORE, cross_entropy
from ..progress import Progress


def predictions(strategy, source, batch_size: int, max_batches: int | None, device, progress: bool = False):
    """(logits, targets) of this rank's test batches where it has logits, padding rows left out; every
    rank calls ``predict`` on every batch (it is a collective for sharded and staged strategies)."""
    batches = list(source.test_batches(batch_size, max_batches))
    bar = Progress(len(batches), "eval", enabled=progress)
    for i, (x, y, real) in enumerate(batches):
        with steps.entered(steps.whole(x, source.packing)):  # packed documents: each row's attention mask
            logits = strategy.predict(to_device(x, device, strategy.ctx.dtype))
        if logits is not None:
            yield logits.float().cpu()[real], y[real]
        bar.update(i + 1)
    bar.close()


def evaluate(strategy, source, classes, comm, batch_size: int, max_batches: int | None, device,
             progress: bool = False) -> dict | None:
    if source.text:
        return evaluate_text(strategy, source, comm, batch_size, max_batches, device, progress)
    k = len(classes)
    confusion = torch.zeros(k, k, dtype=torch.long)
    loss_sum = 0.0
    for logits, y in predictions(strategy, source, batch_size, max_batches, device, progress):
        loss_sum += cross_entropy(logits, y, reduction="sum").item()
        confusion += torch.bincount(y * k + logits.argmax(1), minlength=k * k).view(k, k)
    parts = once_per_shard(comm.all_gather_objects((source.rank, int(confusion.sum()), confusion, loss_sum)))
    confusion = sum(c for c, _ in parts)
    loss_sum = sum(s for _, s in parts)
    n = int(confusion.sum())
    if n == 0:
        return None
    return metrics(confusion, loss_sum / n, classes)


def evaluate_text(strategy, source, comm, batch_size: int, max_batches: int | None, device,
                  progress: bool = False) -> dict | None:
    """A language model on the validation windows: summed token losses and correct next-token
    predictions, added over ranks; ``loss`` is their mean per token (documents: per valid target, the
    ignored ones, padding and the byte after a document's end, left out)."""
    loss_sum, correct, tokens, windows = 0.0, 0, 0, 0
    for logits, y in predictions(strategy, source, batch_size, max_batches, device, progress):
        loss_sum += cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        tokens += int((y != IGNORE).sum())
        windows += len(y)
    parts = once_per_shard(comm.all_gather_objects((source.rank, windows, loss_sum, correct, tokens, windows)))
    loss_sum, correct, tokens, windows = (sum(p[j] for p in parts) for j in range(4))
    if tokens == 0:
        return None
    return text_metrics(loss_sum / tokens, correct, tokens, windows, source.data.name)


def once_per_shard(parts: list[tuple]) -> list[tuple]:
    """Every rank's ``(its data-parallel shard, samples it predicted, *figures)``: the figures of each shard once.
    The ranks of one shard predict the same samples: a tp or cp group's ranks each hold the whole logits, a
    pipeline's last stage alone (the others predicted none); each shard's figures are those of a rank that
    predicted its samples."""
    best: dict[int, tuple] = {}
    for shard, samples, *figures in parts:
        if shard not in best or samples > best[shard][0]:
            best[shard] = (samples, figures)
    return [tuple(figures) for _, (_, figures) in sorted(best.items())]


def text_metrics(mean_loss: float, correct: int, tokens: int, windows: int, dataset: str) -> dict:
    """A language model's validation figures; ``loss`` is nats per token (a token is a byte)."""
    return {
        "modality": "text",
        "dataset": dataset,
        "loss": mean_loss,
        "perplexity": math.exp(mean_loss) if mean_loss < 700 else math.inf,
        "bits_per_byte": mean_loss / math.log(2),
        "accuracy": correct / tokens,
        "tokens": tokens,
        "samples": windows,
    }


def headline(m: dict) -> str:
    """The one line a run prints after evaluating."""
    if m.get("modality") == "text":
        return (f"validation: loss {m['loss']:.4f} per token  perplexity {m['perplexity']:.2f}  "
                f"next-byte accuracy {100 * m['accuracy']:.2f}% ({m['samples']} windows, {m['tokens']} tokens)")
    return f"test: loss {m['loss']:.4f}  accuracy {100 * m['accuracy']:.2f}% ({m['samples']} samples)"


def metrics(confusion: torch.Tensor, mean_loss: float, classes) -> dict:
    """Accuracy and per-class precision/recall/F1 from a confusion matrix (rows: true class)."""
    tp = confusion.diag().double()
    predicted = confusion.sum(0).double()
    actual = confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                     torch.zeros_like(tp))
    n = int(confusion.sum())
    return {
        "loss": mean_loss,
        "accuracy": float(tp.sum() / n),
        "samples": n,
        "classes": list(classes),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "f1": f1.tolist(),
        "support": actual.long().tolist(),
        "confusion": confusion.tolist(),
    }


def format_report(m: dict) -> str:
    """The text of eval.txt: a per-class table and the confusion matrix (a language model:
    its validation loss, perplexity, bits per byte and next-byte accuracy)."""
    if m.get("modality") == "text":
        return (f"validation ({m['dataset']}: {m['samples']} windows, "
                f"{m['tokens']} tokens)\n"
                f"loss         {m['loss']:.4f}  (nats per token, mean)\n"
                f"perplexity   {m['perplexity']:.4f}  (exp of the loss; 256 for a uniform guess)\n"
                f"bits/byte    {m['bits_per_byte']:.4f}\n"
                f"accuracy     {100 * m['accuracy']:.2f}%  (next byte, argmax)\n")
    names = m["classes"]
    width = max(12, max(len(c) for c in names) + 2)
    lines = [f"test loss {m['loss']:.4f}   accuracy {100 * m['accuracy']:.2f}%   ({m['samples']} samples)", "",
             f"{'class':<{width}}{'precision':>10}{'recall':>10}{'f1':>10}{'support':>10}"]
    for i, c in enumerate(names):
        lines.append(f"{c:<{width}}{m['precision'][i]:>10.4f}{m['recall'][i]:>10.4f}"
                     f"{m['f1'][i]:>10.4f}{m['support'][i]:>10d}")
    macro = [sum(m[key]) / len(names) for key in ("precision", "recall", "f1")]
    lines.append(f"{'macro avg':<{width}}{macro[0]:>10.4f}{macro[1]:>10.4f}{macro[2]:>10.4f}{m['samples']:>10d}")
    lines += ["", "confusion matrix (rows: true class, columns: predicted)"]
    cell = max(6, max(len(str(v)) for row in m["confusion"] for v in row) + 1)
    lines.append(" " * width + "".join(f"{i:>{cell}}" for i in range(len(names))))
    for i, row in enumerate(m["confusion"]):
        lines.append(f"{i} {names[i]:<{width - 2}}" + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines) + "\n"
