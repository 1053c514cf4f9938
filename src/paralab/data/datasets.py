"""Datasets held in memory as uint8 tensors ``[N, 3, 32, 32]`` plus int64 labels.

Readers for the real on-disk formats (CIFAR-10 python pickles, read by a
restricted unpickler that can build nothing but what the official files hold;
Fashion-MNIST IDX ``.gz``) and a deterministic, learnable synthetic set. Everything is
loaded once (Fashion-MNIST decoded once and kept as raw bytes: ``decoded.py``); augmentation and
normalisation happen later, batched. Text datasets
(byte tokens for the language model) live in ``text.py``; the functions here
dispatch to it by name and resolve ``auto`` by the model's modality.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from ..errors import UsageError
from . import decoded
from .documents import DOCUMENT_DATASETS, check_documents, load_documents
from .text import TEXT_DATASETS, check_text, load_text, resolve_text, text_train_windows

FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_DATA_ROOT = Path(os.environ.get("PARALAB_DATA", Path.home() / ".cache" / "paralab"))

CIFAR_MEAN = (125.3 / 255, 123.0 / 255, 113.9 / 255)
CIFAR_STD = (63.0 / 255, 62.1 / 255, 66.7 / 255)
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck")
FASHION_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat",
                   "sandal", "shirt", "sneaker", "bag", "ankle-boot")
# Fashion-MNIST statistics after padding to 32x32 (the padding is zeros).
FASHION_MEAN = (0.2190,) * 3
FASHION_STD = (0.3318,) * 3

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = "test_batch"
# Sizes of the official files, checked before unpickling.
CIFAR_FILE_BYTES = {**{name: 31035704 for name in CIFAR_TRAIN}, CIFAR_TEST: 31035526}
CIFAR_TRAIN_SIZE = 50000
FASHION_TRAIN_SIZE = 60000
MAX_IDX_BYTES = 64 << 20  # the largest Fashion-MNIST file inflates to 47,040,016 bytes
# MD5 of each file's *decompressed* IDX bytes: Debian re-compresses the
# archives, so the digest of the .gz itself differs between sources.
FASHION_FILES = {
    "train_x": ("train-images-idx3-ubyte.gz", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train_y": ("train-labels-idx1-ubyte.gz", "9018921c3c673c538a1fc5bad174d6f9"),
    "test_x": ("t10k-images-idx3-ubyte.gz", "8181f5470baa50b63fa0f6fddb340f0a"),
    "test_y": ("t10k-labels-idx1-ubyte.gz", "15d484375f8d13e6eb1aabb0c3f46965"),
}


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor  # uint8 [N, 3, 32, 32]
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str  # where it came from, for the run record
    modality: ClassVar[str] = "image"  # what a model must read to train on it (text: data/text.py)

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_y)} train / {len(self.test_y)} test "
                f"images from {self.source}")


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------- CIFAR-10
def cifar_dir(data_dir: Path | None) -> Path | None:
    """The folder holding the CIFAR-10 batches, or None if absent."""
    for root in ([data_dir] if data_dir else [DEFAULT_DATA_ROOT]):
        for candidate in (root / CIFAR_FOLDER, root):
            if (candidate / CIFAR_TEST).exists():
                return candidate
    return None


# What the official python batches (Python 2 cPickle, protocol 2) are made of: a
# dict of byte-string keys (b"batch_label", b"labels", b"data", b"filenames") to a
# byte string, a list of ints, a numpy uint8 array [10000, 3072] and a list of byte
# strings. Strings, ints, lists, tuples and dicts are pickle opcodes and need no
# global; the array names exactly three: numpy's array reconstructor, ndarray and
# dtype. (Python 2 numpy wrote the reconstructor as numpy.core.multiarray; numpy
# 2 writes numpy._core.multiarray: the same function, both accepted.)
try:
    from numpy._core.multiarray import _reconstruct as _np_reconstruct  # numpy >= 2
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

_NDARRAY = object()  # what the name numpy.ndarray unpickles to: a token, never callable


def _reconstruct(subtype, shape, typecode):
    """numpy's ``_reconstruct``, for a plain empty ndarray only (the form numpy pickles:
    ``_reconstruct(ndarray, (0,), b"b")``, its content set afterwards by ``__setstate__``)."""
    if subtype is not _NDARRAY or tuple(shape) != (0,):
        raise pickle.UnpicklingError("numpy._reconstruct is allowed only for an empty plain ndarray")
    return _np_reconstruct(np.ndarray, (0,), typecode)


def _dtype(*args):
    """``numpy.dtype(...)`` for dtypes that hold no Python objects."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError("a dtype holding Python objects is not allowed")
    return dtype


class UnsafePickleError(pickle.UnpicklingError):
    """The file names a global that no CIFAR-10 batch contains; nothing was run."""


class CifarUnpickler(pickle.Unpickler):
    """An unpickler that can build only what an official CIFAR-10 python batch holds.

    Every global a pickle refers to (the only way a pickle can run code: a
    callable that ``REDUCE``/``NEWOBJ``/``INST``/``OBJ`` then calls) goes
    through :meth:`find_class`; here it resolves only the three numpy names
    above, each to a guarded stand-in, and refuses everything else before
    importing anything. ``persistent_load`` is not defined, so persistent
    ids are refused too. ``encoding="bytes"`` keeps Python 2 strings as bytes,
    as the official files need.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _dtype,
    }

    def __init__(self, file):
        super().__init__(file, encoding="bytes")

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"it refers to {module}.{name}, which no CIFAR-10 batch contains "
                                    "(only numpy arrays, lists, strings and ints); refused "
                                    "without loading or running it") from None


def _field(batch: dict, key: str):
    """``batch[b"key"]`` (the official files, read with encoding="bytes") or ``batch["key"]``."""
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise KeyError(f"no {key!r} entry")


def read_cifar_batch(path: Path, expected_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 3, 32, 32]`` uint8 and labels ``[N]`` int64 of one python batch.

    Read with :class:`CifarUnpickler`: a file that refers to anything but what
    the official batches hold is refused (UsageError) without running it.
    """
    if expected_bytes is not None and path.stat().st_size != expected_bytes:
        raise UsageError(f"{path} has {path.stat().st_size} bytes, expected {expected_bytes}: "
                         "the file is corrupt or truncated; download it again "
                         "with `paralab data download cifar10`")
    try:
        with open(path, "rb") as f:
            batch = CifarUnpickler(f).load()
    except UnsafePickleError as exc:
        raise UsageError(f"{path} is not a CIFAR-10 python batch: {exc}. Replace it with the official "
                         "files (`paralab data download cifar10`)") from exc
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise UsageError(f"{path} is not a CIFAR-10 python batch ({type(exc).__name__}: {exc}); "
                         "download it again with `paralab data download cifar10`") from exc
    try:
        if not isinstance(batch, dict):
            raise ValueError(f"it holds a {type(batch).__name__}, not a dict")
        data, labels = _field(batch, "data"), _field(batch, "labels")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.size % (3 * 32 * 32):
            raise ValueError("'data' is not a uint8 array of 3x32x32 images")
        if not isinstance(labels, list) or not all(type(v) is int and 0 <= v < 10 for v in labels):
            raise ValueError("'labels' is not a list of class numbers 0-9")
    except (KeyError, ValueError) as exc:
        raise UsageError(f"{path} is not a CIFAR-10 python batch ({exc}); "
                         "download it again with `paralab data download cifar10`") from exc
    data = data.reshape(-1, 3, 32, 32)
    labels = np.asarray(labels, dtype=np.int64)
    if len(data) != len(labels):
        raise UsageError(f"{path}: {len(data)} images but {len(labels)} labels")
    return data, labels


def load_cifar10(data_dir: Path | None, check_sizes: bool = True) -> Dataset:
    folder = cifar_dir(data_dir)
    if folder is None:
        where = data_dir or DEFAULT_DATA_ROOT
        raise UsageError(f"CIFAR-10 not found in {where}. Fetch it with `paralab data download "
                         "cifar10` (needs internet), or use --dataset fashion-mnist or "
                         "--dataset synthetic")
    xs, ys = [], []
    for name in CIFAR_TRAIN:
        path = folder / name
        if not path.exists():
            raise UsageError(f"{path} is missing; download CIFAR-10 again")
        x, y = read_cifar_batch(path, CIFAR_FILE_BYTES[name] if check_sizes else None)
        xs.append(x)
        ys.append(y)
    tx, ty = read_cifar_batch(folder / CIFAR_TEST, CIFAR_FILE_BYTES[CIFAR_TEST] if check_sizes else None)
    return Dataset("cifar10", torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)),
                   torch.from_numpy(tx), torch.from_numpy(ty), CIFAR_CLASSES,
                   CIFAR_MEAN, CIFAR_STD, str(folder))


# ------------------------------------------------------------ Fashion-MNIST
def read_idx(path: Path, md5: str | None = None) -> np.ndarray:
    """Read one gzipped IDX file (unsigned-byte data) into a numpy array.

    With ``md5``, the decompressed bytes must have that digest.
    """
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read(MAX_IDX_BYTES + 1)  # bounded: a small crafted .gz could inflate to gigabytes
    except (OSError, EOFError) as exc:
        raise UsageError(f"{path} is not a readable gzip file ({exc}); the file is corrupt") from exc
    if len(raw) > MAX_IDX_BYTES:
        raise UsageError(f"{path} inflates to more than {MAX_IDX_BYTES >> 20} MiB, more than any "
                         "Fashion-MNIST file (47 MB): not Fashion-MNIST")
    if md5 is not None and hashlib.md5(raw).hexdigest() != md5:
        raise UsageError(f"{path} fails its MD5 check (decompressed content): the file is corrupt "
                         "or not Fashion-MNIST; reinstall it or pass --dataset synthetic")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise UsageError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    expected = int(np.prod(dims)) + 4 + 4 * ndim
    if len(raw) != expected:
        raise UsageError(f"{path} holds {len(raw)} bytes, its header promises {expected}: corrupt file")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_dir(data_dir: Path | None) -> Path | None:
    roots = [data_dir] if data_dir else [DEFAULT_DATA_ROOT / "fashion-mnist", FASHION_SYSTEM_DIR]
    for root in roots:
        if (root / FASHION_FILES["test_y"][0]).exists():
            return root
    return None


def to_cifar_shape(images: np.ndarray) -> torch.Tensor:
    """[N, 28, 28] gray -> [N, 3, 32, 32]: pad by 2 and repeat the channel."""
    x = torch.from_numpy(images.copy()).unsqueeze(1)
    x = torch.nn.functional.pad(x, (2, 2, 2, 2))
    return x.expand(-1, 3, -1, -1).contiguous()


def decoded_dir() -> Path:
    """Where decoded copies are kept (``decoded.py``): ``$PARALAB_DECODED``, else ``decoded`` in the data root."""
    return Path(os.environ.get("PARALAB_DECODED") or DEFAULT_DATA_ROOT / "decoded")


def load_fashion_mnist(data_dir: Path | None, check_md5: bool = True) -> Dataset:
    folder = fashion_dir(data_dir)
    if folder is None:
        raise UsageError(f"Fashion-MNIST not found in {data_dir or FASHION_SYSTEM_DIR}; install "
                         "Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist) "
                         "or use --dataset synthetic")
    for name, _ in FASHION_FILES.values():
        if not (folder / name).exists():
            raise UsageError(f"{folder / name} is missing")

    def inflate() -> dict[str, np.ndarray]:
        return {key: read_idx(folder / name, md5 if check_md5 else None) for key, (name, md5) in FASHION_FILES.items()}

    arrays = decoded.arrays(decoded_dir(), "fashion-mnist", folder,
                            {key: name for key, (name, _) in FASHION_FILES.items()}, check_md5, inflate)
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise UsageError(f"Fashion-MNIST {split}: images and labels differ in count")
        if len(arrays[f"{split}_y"]) and int(arrays[f"{split}_y"].max()) >= len(FASHION_CLASSES):
            raise UsageError(f"Fashion-MNIST {split}: a label above {len(FASHION_CLASSES) - 1}: a corrupt file "
                             f"(or a damaged decoded copy in {decoded_dir()}: delete it)")
    return Dataset("fashion-mnist", to_cifar_shape(arrays["train_x"]),
                   torch.from_numpy(arrays["train_y"].astype(np.int64)),
                   to_cifar_shape(arrays["test_x"]), torch.from_numpy(arrays["test_y"].astype(np.int64)),
                   FASHION_CLASSES, FASHION_MEAN, FASHION_STD, str(folder))


# ---------------------------------------------------------------- synthetic
SHIFTS = range(-3, 4)  # a synthetic image's class template moves by up to 3 pixels each way


def shifted_templates(templates: torch.Tensor) -> torch.Tensor:
    """Every class template under every circular shift: row ``k * 49 + (dr + 3) * 7 + (dc + 3)`` is
    template ``k`` rolled ``dr`` pixels down and ``dc`` right."""
    rolled = [torch.roll(templates, (dr, dc), dims=(2, 3)) for dr in SHIFTS for dc in SHIFTS]
    return torch.stack(rolled, 1).reshape(-1, *templates.shape[1:])


def synthetic_images(n: int, labels: torch.Tensor, shifted: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Class template + a random shift + noise, clipped to uint8 (``shifted``: :func:`shifted_templates`).

    The images are laid out channels-last in memory, as they always were."""
    shift = torch.randint(SHIFTS[0], SHIFTS[-1] + 1, (n, 2), generator=gen) - SHIFTS[0]
    noise = torch.randn(n, 3, 32, 32, generator=gen).mul_(40)
    image = noise.add_(shifted[labels * len(SHIFTS) ** 2 + shift[:, 0] * len(SHIFTS) + shift[:, 1]])
    return image.clamp_(0, 255).to(torch.uint8).contiguous(memory_format=torch.channels_last)


def make_synthetic(train_size: int = 10000, test_size: int = 2000, seed: int = 0,
                   num_classes: int = 10) -> Dataset:
    """A deterministic, learnable CIFAR-shaped set.

    Each class has a smooth colour template (an 8x8 random pattern upsampled
    to 32x32); a sample is its class template, shifted by up to 3 pixels,
    plus Gaussian noise. The same seed always gives the same tensors.
    """
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    coarse = torch.rand(num_classes, 3, 8, 8, generator=gen) * 255
    templates = torch.nn.functional.interpolate(coarse, size=32, mode="bilinear", align_corners=False)
    train_y = torch.randint(0, num_classes, (train_size,), generator=gen)
    test_y = torch.randint(0, num_classes, (test_size,), generator=gen)
    shifted = shifted_templates(templates)
    train_x = synthetic_images(train_size, train_y, shifted, gen)
    test_x = synthetic_images(test_size, test_y, shifted, gen)
    stats = train_x[: min(train_size, 2000)].float() / 255
    mean = tuple(stats.mean(dim=(0, 2, 3)).tolist())
    std = tuple(stats.std(dim=(0, 2, 3)).tolist())
    return synthetic_set(train_x, train_y, test_x, test_y, mean, std, seed, num_classes)


def synthetic_set(train_x, train_y, test_x, test_y, mean: tuple, std: tuple, seed: int,
                  num_classes: int) -> Dataset:
    """The synthetic :class:`Dataset` of these tensors (just made, or read back from a kept copy)."""
    return Dataset("synthetic", train_x, train_y, test_x, test_y, tuple(f"class{i}" for i in range(num_classes)),
                   mean, std, f"generated (seed {seed})")


#: the version of :func:`make_synthetic`'s arithmetic, in the name of a kept copy: change it with the arithmetic,
#: so that copies made by the old one are never read
SYNTHETIC_VERSION = 1


def load_synthetic(train_size: int, test_size: int, seed: int = 0, num_classes: int = 10) -> Dataset:
    """:func:`make_synthetic`'s set, generated once and kept as raw bytes (``decoded.py``, in
    :func:`decoded_dir`): every rank of every run otherwise draws it again (about half a second at the
    default 10,000 images on one core). The copy holds the same bytes, in the same channels-last layout,
    and the same normalisation figures."""
    def generate() -> dict[str, np.ndarray]:
        d = make_synthetic(train_size, test_size, seed, num_classes)
        stats = np.array(d.mean + d.std, dtype="<f8").view(np.uint8)  # their float64 bytes, as they were
        return {"train_x": d.train_x.permute(0, 2, 3, 1).numpy(), "train_y": d.train_y.numpy().astype(np.uint8),
                "test_x": d.test_x.permute(0, 2, 3, 1).numpy(), "test_y": d.test_y.numpy().astype(np.uint8),
                "stats": stats}
    if num_classes > 256:  # a label must fit a byte
        return make_synthetic(train_size, test_size, seed, num_classes)
    # torch's generators and interpolation make the bytes: a copy made by another torch is not read
    name = (f"synthetic{SYNTHETIC_VERSION}-torch{torch.__version__}-seed{seed}-{train_size}-{test_size}-"
            f"{num_classes}.bin")
    a = decoded.kept(decoded_dir() / name, ["train_x", "train_y", "test_x", "test_y", "stats"], generate)
    stats = tuple(a["stats"].view("<f8").tolist())

    def images(x: np.ndarray) -> torch.Tensor:  # N x H x W x C bytes -> N x C x H x W, channels-last
        return torch.from_numpy(np.array(x)).permute(0, 3, 1, 2)
    return synthetic_set(images(a["train_x"]), torch.from_numpy(a["train_y"].astype(np.int64)), images(a["test_x"]),
                         torch.from_numpy(a["test_y"].astype(np.int64)), stats[:3], stats[3:], seed, num_classes)


DATASETS = ("auto", "cifar10", "fashion-mnist", "synthetic", *TEXT_DATASETS, *DOCUMENT_DATASETS)
TEXTUAL = (*TEXT_DATASETS, *DOCUMENT_DATASETS)  # what --model gpt reads


def modality_of(model: str | None) -> str:
    """What ``model`` reads: "image" or "text" (no model named: "image")."""
    from ..models import MODALITY
    return MODALITY.get(model, "image") if model else "image"


def resolve_dataset(name: str, data_dir: Path | None, model: str | None = None) -> str:
    """Turn ``auto`` into the first dataset present for the model's modality: for image models
    cifar10, fashion-mnist, synthetic; for text models the first installed text, else synthetic-text."""
    if name != "auto":
        return name
    if modality_of(model) == "text":
        return resolve_text(data_dir)
    if cifar_dir(data_dir) is not None:
        return "cifar10"
    if fashion_dir(data_dir) is not None:
        return "fashion-mnist"
    return "synthetic"


def check_dataset(name: str, data_dir: Path | None, model: str | None = None, context: int | None = None) -> None:
    """Refuse (UsageError) a dataset that cannot be loaded, or that ``model`` cannot read (a text:
    one too short for windows of ``context + 1`` bytes), before any worker starts."""
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if data_dir is not None and not data_dir.is_dir():
        raise UsageError(f"--data-dir {data_dir} does not exist or is not a directory")
    if name != "auto" and model is not None:
        wants, holds = modality_of(model), "text" if name in TEXTUAL else "image"
        if wants != holds:
            choices = [d for d in DATASETS if d == "auto" or (d in TEXTUAL) == (wants == "text")]
            raise UsageError(f"--model {model} reads {wants}s but --dataset {name} holds {holds}s; "
                             f"pick one of {', '.join(choices)} (or another --model)")
    if name in TEXT_DATASETS:
        check_text(name, data_dir, _context(context))
    if name in DOCUMENT_DATASETS:
        check_documents(name, data_dir, _context(context))
    if name == "cifar10":
        folder = cifar_dir(data_dir)
        if folder is None:
            load_cifar10(data_dir)  # raises with the download hint
        for file, size in CIFAR_FILE_BYTES.items():
            path = folder / file
            if not path.exists() or path.stat().st_size != size:
                raise UsageError(f"{path} is missing or has the wrong size (expected {size} bytes): "
                                 "the download is corrupt; run `paralab data download cifar10` again")
        for file in CIFAR_FILE_BYTES:
            # read every batch once here (restricted unpickler, well under a second), so a crafted
            # or corrupt file is refused with exit 2 before any worker starts, never inside one
            read_cifar_batch(folder / file)
    if name == "fashion-mnist":
        load_fashion_mnist(data_dir)  # small: reading it checks presence, format and MD5


def train_size(name: str, data_dir: Path | None, synthetic_size: int, *, model: str | None = None,
               context: int | None = None, packing: bool = False, doc_length: int = 64) -> int:
    """Training samples of a dataset that :func:`check_dataset` accepted, without loading it
    (the real sets are the official files: their sizes and checksums are checked; a text's
    samples are its training windows of ``context + 1`` bytes; documents' are counted by cutting them)."""
    name = resolve_dataset(name, data_dir, model)
    if name in DOCUMENT_DATASETS:
        return len(load_documents(name, data_dir, context=_context(context), synthetic_size=synthetic_size,
                                  doc_length=doc_length, packing=packing).train_y)
    if name in TEXT_DATASETS:
        return text_train_windows(name, data_dir, synthetic_size, _context(context))
    return {"cifar10": CIFAR_TRAIN_SIZE, "fashion-mnist": FASHION_TRAIN_SIZE}.get(name, synthetic_size)


def _context(context: int | None) -> int:
    if context is None:  # the model's default (GPTOptions, declared once)
        from ..models import GPTOptions
        return GPTOptions().context
    return context


def load_dataset(name: str, data_dir: Path | None = None, *, synthetic_size: int = 10000,
                 seed: int = 0, model: str | None = None, context: int | None = None, packing: bool = False,
                 doc_length: int = 64):
    """The dataset ``name`` (``auto``: by ``model``'s modality): an image :class:`Dataset`, a
    :class:`~paralab.data.text.TextDataset` cut into windows of ``context + 1`` bytes, or a
    :class:`~paralab.data.documents.DocumentDataset` of documents, packed or padded into them."""
    name = resolve_dataset(name, data_dir, model)
    if name in DOCUMENT_DATASETS:
        return load_documents(name, data_dir, context=_context(context), synthetic_size=synthetic_size,
                              doc_length=doc_length, packing=packing, seed=seed)
    if name in TEXT_DATASETS:
        return load_text(name, data_dir, context=_context(context), synthetic_size=synthetic_size, seed=seed)
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir)
    if name == "synthetic":
        return load_synthetic(train_size=synthetic_size, test_size=max(1000, synthetic_size // 5), seed=seed)
    raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
