"""A decoded dataset kept on disk: raw bytes under a checked header, never a pickle.

Reading Fashion-MNIST means inflating 31 MB of gzip and checking each file's MD5 (about half a
second a load), and every rank of every run loads it. :func:`arrays` decodes once and keeps the
result in a folder of copies (``~/.cache/paralab/decoded``, or ``$PARALAB_DECODED``), named by a digest of
what it came from
(the source folder, each file's name, size and modification time, and whether the MD5s were
checked), so a changed or replaced source file is decoded again. The file holds:

- the magic ``PARALAB-ARRAYS1\\n`` (16 bytes), then a little-endian ``uint32`` count;
- per array: its name (``uint16`` length, UTF-8), its number of dimensions (``uint8``) and each
  dimension (``uint32``);
- then each array's bytes (``uint8``), in that order, and nothing after them.

A file that does not match (another magic, other names, a size other than the header promises)
is ignored and written again; one that cannot be written (a read-only home) is not kept.
:func:`kept` is the same for arrays that come from no file (the synthetic images, named by their
generator's version, seed and sizes).
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Callable

import numpy as np

MAGIC = b"PARALAB-ARRAYS1\n"


def key_of(folder: Path, names: list[str], checked: bool) -> str:
    """A digest of what the decoded arrays come from: a change to any source file changes it."""
    parts = [str(folder.resolve()), f"checked={checked}"]
    for name in names:
        st = (folder / name).stat()
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def encode(arrays: dict[str, np.ndarray]) -> bytes:
    header = [MAGIC, struct.pack("<I", len(arrays))]
    for name, a in arrays.items():
        raw = name.encode()
        header.append(struct.pack("<H", len(raw)) + raw + struct.pack(f"<B{a.ndim}I", a.ndim, *a.shape))
    return b"".join(header) + b"".join(np.ascontiguousarray(a, dtype=np.uint8).tobytes() for a in arrays.values())


def decode(blob: bytes, names: list[str]) -> dict[str, np.ndarray] | None:
    """The arrays in ``blob``, or None where it is not a file of exactly ``names``."""
    try:
        if not blob.startswith(MAGIC):
            return None
        at = len(MAGIC)
        (count,) = struct.unpack_from("<I", blob, at)
        at += 4
        if count != len(names):
            return None
        shapes = {}
        for _ in range(count):
            (length,) = struct.unpack_from("<H", blob, at)
            name = blob[at + 2:at + 2 + length].decode()
            at += 2 + length
            (ndim,) = struct.unpack_from("<B", blob, at)
            shapes[name] = struct.unpack_from(f"<{ndim}I", blob, at + 1)
            at += 1 + 4 * ndim
        if list(shapes) != names or at + sum(int(np.prod(s)) for s in shapes.values()) != len(blob):
            return None
    except (struct.error, UnicodeDecodeError):
        return None
    out = {}
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = np.frombuffer(blob, dtype=np.uint8, count=size, offset=at).reshape(shape)
        at += size
    return out


def arrays(cache: Path, label: str, folder: Path, sources: dict[str, str], checked: bool,
           build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``build()``'s arrays (uint8; ``sources``: each array's name -> the file in ``folder`` it comes from),
    from the cache when it holds them for these files, else built and kept there."""
    return kept(cache / f"{label}-{key_of(folder, list(sources.values()), checked)}.bin", list(sources), build)


def kept(path: Path, names: list[str], build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``build()``'s arrays ``names`` (uint8), read from ``path`` where it holds exactly them, else built and
    written there (``path``'s name must say everything the arrays depend on)."""
    cache = path.parent
    try:
        found = decode(path.read_bytes(), names)
    except OSError:
        found = None
    if found is not None:
        return found
    built = build()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(encode({n: built[n] for n in names}))
        tmp.replace(path)  # never a half-written file under the real name
    except OSError:  # not kept (a full disk, a read-only home): the next load decodes again
        try:
            tmp.unlink(missing_ok=True)  # nor a half-written one under another
        except OSError:
            pass
    return built
