"""Text datasets for the language model: byte-level tokens, a fixed split, windows of ``context + 1`` bytes.

A text is its bytes, as stored (UTF-8): token ``i`` is byte ``i``, so the
vocabulary is 256 and nothing is decoded, parsed or unpickled. Two texts:

``jargon``
    The Jargon File 4.4.7 (Eric S. Raymond et al., public domain): 1.68 MB of
    English prose in one plain-text file, Debian's ``jargon-text`` package
    (``apt-get install jargon-text``: ``/usr/share/doc/jargon-text/jargon.txt.gz``);
    or a ``jargon.txt``/``jargon.txt.gz`` in ``--data-dir``.
``synthetic-text``
    Made-up sentences from a small seeded grammar ("the quiet robot follows a
    red river."), generated in memory: deterministic for a seed, and learnable
    (spelling is fixed, word order follows the grammar, only the word choices
    are random). Tests use it, and ``auto`` falls back to it.

Split: the last 10 % of a text's bytes (from byte ``n - n // 10``) are the
validation text, the rest the training text. ``synthetic-text`` is generated
to size instead: ``--synthetic-size`` training windows, then a continuation
of the same stream about a ninth as long (at least one window) to validate.

Samples: windows of ``context + 1`` bytes starting every ``stride = context``
bytes; ``x`` is a window's first ``context`` bytes, ``y`` its last ``context``
(the next byte of each position). So one epoch predicts every training byte
but the first once. No window crosses the split: the two are disjoint.
"""
from __future__ import annotations

import gzip
import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..errors import UsageError

VOCAB = 256                 # byte-level tokens
VALIDATION_FRACTION = 10    # the last 1/10 of a text's bytes validate
MAX_TEXT_BYTES = 64 << 20   # bounded read: a small crafted .gz could inflate to gigabytes
SYNTHETIC_TEXT = "synthetic-text"


@dataclass(frozen=True)
class TextSource:
    """Where an installed text lives and how to get it."""
    name: str
    title: str
    files: tuple[str, ...]   # looked for in --data-dir, then in system_dir
    system_dir: Path
    package: str
    install: str
    licence: str
    origin: str


TEXTS = {
    "jargon": TextSource(
        "jargon", "the Jargon File 4.4.7, English prose", ("jargon.txt", "jargon.txt.gz"),
        Path("/usr/share/doc/jargon-text"), "jargon-text", "apt-get install jargon-text",
        "public domain", "Debian package jargon-text"),
}
TEXT_DATASETS = (*TEXTS, SYNTHETIC_TEXT)


def text_path(name: str, data_dir: Path | None) -> Path | None:
    """The file holding text ``name``: in ``data_dir`` if it has one, else the package's; None if absent."""
    src = TEXTS[name]
    for folder in ([data_dir] if data_dir else []) + [src.system_dir]:
        for file in src.files:
            if (folder / file).is_file():
                return folder / file
    return None


def absent_message(name: str, data_dir: Path | None) -> str:
    src = TEXTS[name]
    where = " or ".join(str(d / src.files[-1]) for d in ([data_dir] if data_dir else []) + [src.system_dir])
    return (f"the {name} text is not installed (looked for {where}). Install it with "
            f"`{src.install}` (Debian/Ubuntu, as root; `make data` does it), or put {src.files[0]} "
            f"in --data-dir (an image whose dpkg excludes /usr/share/doc: see docs/data.md), "
            f"or use --dataset {SYNTHETIC_TEXT}")


def read_text_bytes(path: Path) -> bytes:
    """The file's bytes (a ``.gz`` decompressed, bounded); nothing decoded."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read(MAX_TEXT_BYTES + 1)
        else:
            with open(path, "rb") as f:
                raw = f.read(MAX_TEXT_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise UsageError(f"{path} cannot be read ({exc}): the file is corrupt; reinstall it") from exc
    if len(raw) > MAX_TEXT_BYTES:
        raise UsageError(f"{path} holds more than {MAX_TEXT_BYTES >> 20} MiB of text, more than paralab "
                         "loads into memory")
    if not raw:
        raise UsageError(f"{path} is empty")
    return raw


def split_point(n: int) -> int:
    """The first validation byte of an ``n``-byte text: the last 10 % validate."""
    return n - n // VALIDATION_FRACTION


def window_count(nbytes: int, context: int, stride: int | None = None) -> int:
    """Windows of ``context + 1`` bytes, one every ``stride`` (default ``context``) bytes."""
    stride = stride or context
    return 0 if nbytes < context + 1 else (nbytes - context - 1) // stride + 1


def windows(text: torch.Tensor, context: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) views ``[N, context]`` of a uint8 text: y is x shifted by one byte."""
    if len(text) < context + 1:
        empty = text.new_empty((0, context))
        return empty, empty
    w = text.unfold(0, context + 1, stride)  # a view: no copy of the text
    return w[:, :-1], w[:, 1:]


@dataclass
class TextDataset:
    """Training and validation text as uint8 tensors, cut into windows (views, not copies).

    Offers what the loader reads of an image :class:`~paralab.data.datasets.Dataset`:
    ``train_x``/``train_y``/``test_x``/``test_y`` (here ``[N, context]`` bytes, ``y``
    shifted by one), ``name``, ``source``, ``classes`` (none), ``describe()``.
    """
    name: str
    train_text: torch.Tensor  # uint8 [bytes]
    test_text: torch.Tensor
    context: int
    source: str
    modality: ClassVar[str] = "text"
    vocab: ClassVar[int] = VOCAB
    classes: ClassVar[tuple] = ()

    def __post_init__(self):
        self.stride = self.context
        self.train_x, self.train_y = windows(self.train_text, self.context, self.stride)
        self.test_x, self.test_y = windows(self.test_text, self.context, self.stride)
        if len(self.train_y) == 0:
            raise UsageError(f"{self.name}: {len(self.train_text)} training bytes make no window of "
                             f"--context {self.context} + 1 bytes; lower --context")

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_y)} train / {len(self.test_y)} validation windows of "
                f"{self.context}+1 bytes (stride {self.stride}; {len(self.train_text):,} / "
                f"{len(self.test_text):,} bytes) from {self.source}")


# ---------------------------------------------------------------- synthetic
#: the grammar: sentence = det [adj] noun verb det [adj] noun [conj sentence] "."
WORDS = {
    "det": ("the", "a", "every", "no", "one"),
    "adj": ("small", "red", "quiet", "old", "bright", "lazy", "green", "loud"),
    "noun": ("cat", "robot", "river", "teacher", "garden", "model", "signal", "tree", "engine", "bird"),
    "verb": ("sees", "follows", "builds", "likes", "moves", "finds", "reads", "hears"),
    "conj": ("and", "but", "while", "because"),
}


def _pick(rng: random.Random, words: tuple[str, ...]) -> str:
    return words[int(rng.random() * len(words))]


def _phrase(rng: random.Random) -> list[str]:
    words = [_pick(rng, WORDS["det"])]
    if rng.random() < 0.5:
        words.append(_pick(rng, WORDS["adj"]))
    return words + [_pick(rng, WORDS["noun"])]


def synthetic_text(nbytes: int, seed: int = 0) -> bytes:
    """``nbytes`` of made-up sentences from :data:`WORDS`; the same seed gives the same bytes."""
    rng = random.Random(7_919 + seed)
    parts: list[str] = []
    size = 0
    while size < nbytes:
        words = _phrase(rng) + [_pick(rng, WORDS["verb"])] + _phrase(rng)
        while rng.random() < 0.3:
            words += [_pick(rng, WORDS["conj"])] + _phrase(rng) + [_pick(rng, WORDS["verb"])] + _phrase(rng)
        sentence = " ".join(words) + (".\n" if rng.random() < 0.25 else ". ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts).encode("ascii")[:nbytes]


def synthetic_sizes(train_windows: int, context: int) -> tuple[int, int]:
    """Bytes of synthetic training and validation text for ``train_windows`` training windows."""
    train = train_windows * context + 1
    return train, max(train // 9, context + 1)


def make_synthetic_text(train_windows: int, context: int, seed: int = 0) -> TextDataset:
    train, test = synthetic_sizes(train_windows, context)
    raw = synthetic_text(train + test, seed)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return TextDataset(SYNTHETIC_TEXT, data[:train], data[train:], context,
                       f"generated (seeded grammar, seed {seed})")


# ---------------------------------------------------------------- the data layer's entry points
def resolve_text(data_dir: Path | None) -> str:
    """What ``--dataset auto`` means for a text model: the first installed text, else synthetic-text."""
    for name in TEXTS:
        if text_path(name, data_dir) is not None:
            return name
    return SYNTHETIC_TEXT


def check_text(name: str, data_dir: Path | None, context: int) -> None:
    """Refuse (UsageError, exit 2) an installed text that is absent, unreadable, or too short for
    one training and one validation window of ``context + 1`` bytes."""
    if name in TEXTS:
        path = text_path(name, data_dir)
        if path is None:
            raise UsageError(absent_message(name, data_dir))
        n = len(read_text_bytes(path))  # 1.7 MB: reading it checks it before any worker starts
        cut = split_point(n)
        if window_count(n - cut, context) == 0:
            raise UsageError(f"{name}: its {n - cut:,} validation bytes (the last 10 % of {path}) make no "
                             f"window of --context {context} + 1 bytes; lower --context")


def text_train_windows(name: str, data_dir: Path | None, synthetic_size: int, context: int) -> int:
    """Training windows of a text :func:`check_text` accepted."""
    if name == SYNTHETIC_TEXT:
        return synthetic_size
    n = len(read_text_bytes(text_path(name, data_dir)))
    return window_count(split_point(n), context)


def load_text(name: str, data_dir: Path | None, *, context: int, synthetic_size: int,
              seed: int = 0) -> TextDataset:
    if name == SYNTHETIC_TEXT:
        return make_synthetic_text(synthetic_size, context, seed)
    path = text_path(name, data_dir)
    if path is None:
        raise UsageError(absent_message(name, data_dir))
    raw = read_text_bytes(path)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    cut = split_point(len(data))
    return TextDataset(name, data[:cut], data[cut:], context, str(path))


def info_lines(data_dir: Path | None) -> list[str]:
    """``paralab data info``'s rows for the texts."""
    lines = []
    for name, src in TEXTS.items():
        path = text_path(name, data_dir)
        if path is not None:
            n = len(read_text_bytes(path))
            lines.append(f"{name:<15}present  {path}  (text, {n / 1e6:.2f} MB: {src.title}; {src.licence}; "
                         f"{src.origin}; the last 10 % validate)")
        else:
            lines.append(f"{name:<15}absent   (text: {src.title}, {src.licence}; `{src.install}`, "
                         f"or {src.files[0]} in --data-dir)")
    lines.append(f"{SYNTHETIC_TEXT:<15}always   text generated in memory from a seeded grammar "
                 "(--synthetic-size training windows)")
    return lines
