"""Checkpoint generations: each save is a folder that is committed whole, or does not count.

    <run>/checkpoint/step-00000006/rank0.pt ... rank<N-1>.pt   each rank's state at step 6
    <run>/checkpoint/step-00000006/manifest.json                written last: the commit
    <run>/checkpoint/init/...                                   the starting state (--save-init), alike

A save is collective. Every rank writes its file (to a temporary name,
flushed to disk, then renamed), summing it (SHA-256) as it goes, and tells
every other rank its size and sum, or the error it hit. Only when every rank's file
is complete does each rank write the manifest (the step, the run's identity,
every file's size and SHA-256), again to a temporary name renamed into place:
a generation with a manifest is complete, and one without is torn (a rank
stopped while saving) and is never read. PyTorch's Distributed Checkpoint
commits the same way, with a ``.metadata`` file written last; this manifest
is JSON, so reading it unpickles nothing.

Nothing committed is overwritten: a save of a step whose generation is
committed keeps it. Older generations are deleted only after a newer one is
committed, keeping the newest ``--keep-checkpoints`` (default 2); torn ones
older than the newest committed go too. Reading takes the newest committed
generation and checks each file's size and SHA-256 before loading it
(``weights_only``): a file that does not match is refused, naming it.

A write that fails on any rank (a full disk, a read-only folder) fails the
save on every rank alike, with one line naming the rank, the file and the
error (:class:`WriteError`); what was committed before is intact.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError

MANIFEST = "manifest.json"
FORMAT = 1


class WriteError(RuntimeError):
    """A save failed on some rank: the message says where and why, in one line."""


def folder_for(run_dir: Path, step: int, tag: str | None = None) -> Path:
    """``<run>/checkpoint/step-<step>``, or with ``tag`` (``init``) ``<run>/checkpoint/<tag>``."""
    return Path(run_dir) / "checkpoint" / (tag or f"step-{step:08d}")


@dataclass
class Generation:
    """One committed save: its folder and what its manifest says."""
    folder: Path
    step: int
    world: int
    identity: dict
    files: dict[int, dict]  # rank -> {"bytes": size, "sha256": hex digest}

    def path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.pt"

    def present(self, rank: int) -> bool:
        """Rank ``rank``'s file is here, of the size the manifest says (its sum is checked when read)."""
        try:
            return self.path(rank).stat().st_size == self.files[rank]["bytes"]
        except (OSError, KeyError):
            return False

    def verify(self, rank: int) -> Path:
        """Rank ``rank``'s file, checked against the manifest; UsageError naming the file if it is not it."""
        path, entry = self.path(rank), self.files.get(rank)
        if entry is None:
            raise UsageError(f"{self.folder / MANIFEST} lists no file for rank {rank}")
        if not path.exists():
            raise UsageError(f"{path} is missing: the run had {self.world} ranks and every rank's file is needed "
                             "(ranks started with --rank keep theirs on their own host: copy them here)")
        size = path.stat().st_size
        if size != entry["bytes"] or sha256(path) != entry["sha256"]:
            raise UsageError(f"{path} is not the file its manifest committed ({size} bytes, the manifest says "
                             f"{entry['bytes']}, or its SHA-256 differs): it was changed or cut short since; "
                             "restore it, or resume from another run")
        return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: Path) -> Generation | None:
    """The generation in ``folder`` if its manifest is there and reads as one, else None (torn or absent)."""
    try:
        doc = json.loads((Path(folder) / MANIFEST).read_text())
        files = {int(r): {"bytes": int(e["bytes"]), "sha256": str(e["sha256"])} for r, e in doc["files"].items()}
        if doc.get("format") != FORMAT or sorted(files) != list(range(int(doc["world"]))):
            return None
        return Generation(Path(folder), int(doc["step"]), int(doc["world"]), dict(doc["identity"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _steps(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))


def committed(run_dir: Path) -> list[Generation]:
    """Every committed generation of the run's steps, oldest first."""
    return [g for g in map(read_manifest, _steps(run_dir)) if g is not None]


def newest(run_dir: Path, tag: str | None = None, at: int | None = None) -> Generation | None:
    """The newest committed generation (with ``tag``: the tagged one; with ``at``: step ``at``'s), if
    committed."""
    if tag or at is not None:
        return read_manifest(folder_for(run_dir, at or 0, tag))
    found = committed(run_dir)
    return found[-1] if found else None


def torn(run_dir: Path) -> list[Path]:
    """Generation folders newer than the newest committed one and without a manifest: saves that stopped."""
    last = newest(run_dir)
    return [p for p in _steps(run_dir) if read_manifest(p) is None and (last is None or p.name > last.folder.name)]


class _Summed:
    """``torch.save`` into a file through this, which counts and sums (SHA-256) the bytes as they pass: the file
    is written once and read never. An OSError of the file (a full disk, by name) is raised as itself, where
    ``torch.save`` would report it as a RuntimeError of its own."""

    def __init__(self):
        self.sha, self.bytes, self.file, self.error = hashlib.sha256(), 0, None, None

    def save(self, payload, file) -> None:
        self.file = file
        try:
            torch.save(payload, self)
        except RuntimeError:
            if self.error is not None:
                raise self.error from None
            raise

    def write(self, data) -> int:
        try:
            n = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha.update(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.file.flush()


def _atomic_write(path: Path, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, flushed to disk, renamed to ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # each process its own: ranks may share the folder
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself on disk
    finally:
        os.close(fd)


def _agree(comm, error: str | None, what: str) -> None:
    """Every rank's ``error`` (None: fine); WriteError on every rank if any rank has one."""
    errors = [e for e in comm.all_gather_objects(error) if e]
    if errors:
        raise WriteError(f"{errors[0]} while writing {what}" + (f" (and {len(errors) - 1} more rank(s))"
                                                                if len(errors) > 1 else ""))


def write(run_dir: Path, rank: int, step: int, payload: dict, comm, identity: dict, tag: str | None = None,
          keep: int = 2, written=None) -> Generation:
    """Save this rank's ``payload`` as part of the generation of ``step`` and commit it with every other rank
    (a collective; see the module). WriteError on every rank if any rank could not. ``written`` (testing
    only: a fault point) is called once this rank's file is written, before the commit."""
    folder = folder_for(run_dir, step, tag)
    what = f"step {step}'s checkpoint" if not tag else f"the {tag} checkpoint"
    existing = read_manifest(folder)
    kept = existing is not None and existing.world == comm.world and rank in existing.files
    path, error, entry = folder / f"rank{rank}.pt", None, None
    if kept:  # committed already (a resumed run saving a step it had saved): never overwritten
        entry = existing.files[rank]
    else:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            summed = _Summed()
            _atomic_write(path, lambda f: summed.save(payload, f))
            entry = {"bytes": summed.bytes, "sha256": summed.sha.hexdigest()}
        except OSError as exc:
            error = f"{exc.strerror or type(exc).__name__} (rank {rank}: {path})"
            path.unlink(missing_ok=True)
    if written is not None:
        written()
    _agree(comm, error, what)
    files = {r: e for r, e in enumerate(comm.all_gather_objects(entry))}
    generation = Generation(folder, step, comm.world, identity, files)
    manifest = {"format": FORMAT, "step": step, "world": comm.world, "identity": identity,
                "files": {str(r): e for r, e in files.items()}}
    error = None
    try:  # every rank writes the same manifest: on a shared folder the last rename wins, on its own host each has one
        if not kept:
            _atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    except OSError as exc:
        error = f"{exc.strerror or type(exc).__name__} (rank {rank}: {folder / MANIFEST})"
    _agree(comm, error, what)
    if not tag:
        prune(run_dir, rank, keep)
    return generation


def prune(run_dir: Path, rank: int, keep: int) -> None:
    """After a commit: this rank's files of the committed generations older than the newest ``keep``, and of
    torn ones older than the newest committed, deleted; a generation folder left without rank files goes."""
    done = committed(run_dir)
    if not done:
        return
    newest_name = done[-1].folder.name
    old = [g.folder for g in done[:-keep]] + [p for p in _steps(run_dir)
                                              if read_manifest(p) is None and p.name < newest_name]
    for folder in old:  # the ranks prune at once, where they share the folder: each step may find it gone
        try:
            (folder / f"rank{rank}.pt").unlink(missing_ok=True)
            if not any(folder.glob("rank*.pt")):  # the last rank out removes the rest
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass
