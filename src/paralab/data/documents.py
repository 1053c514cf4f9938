"""Texts of separate documents: packed into full windows, or one document per padded window.

A document is its bytes followed by one end-of-document byte, :data:`EOD`
(``0``, which no text here holds: a ``NUL`` in a file is dropped). Two sets:

``jargon-entries``
    The Jargon File (``text.py``'s ``jargon``) cut at its entries: every line
    that opens a glossary entry (``   :term:``) starts a document; the front
    matter before the first entry and the appendices after the last are left
    out. 2,307 entries, median 433 bytes (10 % under 104, 10 % over 1,192).
``synthetic-docs``
    ``synthetic-text``'s sentences cut into documents whose lengths are drawn
    from a log-normal distribution (median ``--doc-length`` bytes, sigma 1:
    a long tail, as real corpora have), seeded: tests use it.

Split: the last 10 % of the documents validate (``synthetic-docs``: documents
are generated until ``--synthetic-size`` windows' worth of training bytes,
then about a ninth as many bytes of validation documents).

Two ways to make samples of ``context + 1`` bytes (``x`` its first ``context``,
``y`` its last, as ``text.py`` does):

- **padding** (the default): every document on its own rows: cut into windows
  of ``context + 1`` bytes every ``context`` bytes, the last one filled up with
  :data:`EOD`. No row holds two documents, so plain causal attention is right;
  the padding costs compute.
- **packing** (``--packing``): the documents one after another in one stream,
  cut into windows as a plain text is. No padding; a row holds several
  documents (or the end of one and the start of the next), so attention must
  not cross a boundary: every layout builds the document-causal mask from the
  document ids (:func:`doc_ids`) of the rows it holds (``models/documents.py``).

In both, the targets that do not belong to a document are ignored
(:data:`IGNORE`, what ``F.cross_entropy`` skips): where the input is an
:data:`EOD` (the next byte starts another document, or is padding). The
end-of-document byte itself is a target (the model learns where a document
ends). The loss of a step is the sum over its valid targets divided by their
count over the *whole* global batch (``training/losses.py``).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UsageError
from .text import (VOCAB, absent_message, read_text_bytes, split_point, synthetic_sizes, synthetic_text,
                   text_path, windows)

EOD = 0          # the byte that ends every document
IGNORE = -100    # a target the loss skips (F.cross_entropy's ignore_index)
JARGON_ENTRIES = "jargon-entries"
SYNTHETIC_DOCS = "synthetic-docs"
DOCUMENT_DATASETS = (JARGON_ENTRIES, SYNTHETIC_DOCS)
ENTRY = re.compile(rb"^   :[^:\n]+:", re.M)   # a line opening a Jargon File entry
APPENDICES = re.compile(rb"^\s+Part\xc2\xa0III\.", re.M)  # where the glossary ends


def doc_ids(x: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` tokens -> each token's document within its row (0, 1, ...): the number of
    :data:`EOD` bytes before it (an :data:`EOD` belongs to the document it ends)."""
    ends = (x == EOD).long()
    return ends.cumsum(1) - ends


def mask_targets(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` with :data:`IGNORE` where the input is an :data:`EOD` (the next byte belongs to no document)."""
    return y.masked_fill(x == EOD, IGNORE)


def valid_targets(y: torch.Tensor) -> int:
    return int((y != IGNORE).sum())


# ---------------------------------------------------------------- the documents
def jargon_entries(raw: bytes) -> list[bytes]:
    """The Jargon File's entries, each one document (module docstring)."""
    starts = [m.start() for m in ENTRY.finditer(raw)]
    if not starts:
        raise UsageError("the jargon text holds no entry lines ('   :term:'): is it the Jargon File?")
    end = APPENDICES.search(raw, starts[-1])
    bounds = starts + [end.start() if end else len(raw)]
    return [raw[a:b].replace(b"\0", b"").strip() for a, b in zip(bounds, bounds[1:])]


def synthetic_documents(nbytes: int, median: int, seed: int) -> list[bytes]:
    """Documents of about ``nbytes`` in all (their :data:`EOD` included), lengths log-normal around
    ``median`` bytes (sigma 1, at least 1 byte)."""
    rng = random.Random(104_729 + seed)
    lengths, total = [], 0
    while total < nbytes:
        n = max(1, round(median * math.exp(rng.gauss(0.0, 1.0))))
        lengths.append(n)
        total += n + 1
    stream = synthetic_text(sum(lengths), seed)
    docs, at = [], 0
    for n in lengths:
        docs.append(stream[at:at + n].strip() or b".")
        at += n
    return docs


def packed(docs: list[bytes]) -> torch.Tensor:
    """The documents one after another, each followed by :data:`EOD`: uint8 ``[bytes]``."""
    return torch.frombuffer(bytearray(b"".join(d + bytes([EOD]) for d in docs)), dtype=torch.uint8)


def padded(docs: list[bytes], context: int) -> torch.Tensor:
    """Each document (with its :data:`EOD`) on its own rows of ``context + 1`` bytes, windows every
    ``context`` bytes, the last filled up with :data:`EOD`: uint8 ``[rows, context + 1]``."""
    rows = []
    for d in docs:
        doc = torch.frombuffer(bytearray(d + bytes([EOD])), dtype=torch.uint8)
        n = max(1, math.ceil((len(doc) - 1) / context))
        full = torch.full((n * context + 1,), EOD, dtype=torch.uint8)
        full[:len(doc)] = doc
        rows.append(full.unfold(0, context + 1, context))
    return torch.cat(rows)


@dataclass
class DocumentDataset:
    """Training and validation documents as rows of ``context + 1`` bytes (``x``, and ``y`` shifted by one
    with the targets outside documents :data:`IGNORE`: ``BatchSource.batch`` masks them), packed or
    padded (module docstring). Offers what the loader reads of a :class:`~.text.TextDataset`."""
    name: str
    train_docs: list[bytes]
    test_docs: list[bytes]
    context: int
    packing: bool
    source: str
    modality: ClassVar[str] = "text"
    vocab: ClassVar[int] = VOCAB
    classes: ClassVar[tuple] = ()
    documents: ClassVar[bool] = True

    def __post_init__(self):
        self.stride = self.context
        for part, docs in (("train", self.train_docs), ("test", self.test_docs)):
            if self.packing:
                x, y = windows(packed(docs), self.context, self.context)
            else:
                rows = padded(docs, self.context)
                x, y = rows[:, :-1], rows[:, 1:]
            setattr(self, f"{part}_x", x)
            setattr(self, f"{part}_y", y)
        if len(self.train_y) == 0 or len(self.test_y) == 0:
            part = "training" if len(self.train_y) == 0 else "validation"
            raise UsageError(f"{self.name}: its documents make no {part} window of --context {self.context} + 1 "
                             "bytes; lower --context")

    def describe(self) -> str:
        how = "packed" if self.packing else "one document per row, padded"
        valid = valid_targets(mask_targets(self.train_x, self.train_y))
        return (f"{self.name}: {len(self.train_docs):,} train / {len(self.test_docs):,} validation documents, "
                f"{how}: {len(self.train_y):,} / {len(self.test_y):,} windows of {self.context}+1 bytes, "
                f"{valid / self.train_y.numel():.1%} of the training targets in a document; from {self.source}")


# ---------------------------------------------------------------- the data layer's entry points
def _documents(name: str, data_dir, *, context: int, synthetic_size: int, doc_length: int,
               seed: int) -> tuple[list[bytes], list[bytes], str]:
    if name == SYNTHETIC_DOCS:
        train, test = synthetic_sizes(synthetic_size, context)
        return (synthetic_documents(train, doc_length, seed), synthetic_documents(test, doc_length, seed + 1),
                f"generated (seeded grammar, log-normal lengths around {doc_length} bytes, seed {seed})")
    path = _jargon_path(data_dir)
    docs = jargon_entries(read_text_bytes(path))
    cut = split_point(len(docs))
    return docs[:cut], docs[cut:], f"{path}, cut at its entries"


def load_documents(name: str, data_dir, *, context: int, synthetic_size: int, doc_length: int, packing: bool,
                   seed: int = 0) -> DocumentDataset:
    train, test, source = _documents(name, data_dir, context=context, synthetic_size=synthetic_size,
                                     doc_length=doc_length, seed=seed)
    return DocumentDataset(name, train, test, context, packing, source)


def check_documents(name: str, data_dir, context: int) -> None:
    """Refuse (exit 2) ``jargon-entries`` when the Jargon File is absent or holds no entries."""
    if name == JARGON_ENTRIES:
        jargon_entries(read_text_bytes(_jargon_path(data_dir)))


def _jargon_path(data_dir):
    """The Jargon File, or UsageError saying how to install it (or to use synthetic-docs)."""
    path = text_path("jargon", data_dir)
    if path is None:
        raise UsageError(absent_message("jargon", data_dir).replace("--dataset synthetic-text",
                                                                     f"--dataset {SYNTHETIC_DOCS}"))
    return path


NOT_DOCUMENTS = (f"--packing packs documents one after another; --dataset {{name}} has none (a plain text is "
                 f"already one stream, an image set is not text): use --dataset {SYNTHETIC_DOCS} or "
                 f"{JARGON_ENTRIES} (with --model gpt), or drop --packing")


def info_lines(data_dir) -> list[str]:
    """``paralab data info``'s rows for the datasets of documents."""
    jargon = "present" if text_path("jargon", data_dir) else "absent "
    return [f"{JARGON_ENTRIES:<15}{jargon}  documents: the jargon text cut at its entries (2,307; padded, or "
            "--packing)",
            f"{SYNTHETIC_DOCS:<15}always   documents generated in memory, log-normal lengths (--doc-length; padded, "
            "or --packing)"]
