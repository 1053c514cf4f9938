"""``paralab data download cifar10`` and ``paralab data info`` (texts: data/text.py)."""
from __future__ import annotations

import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import UsageError
from .datasets import (CIFAR_FOLDER, DEFAULT_DATA_ROOT, FASHION_FILES, cifar_dir, fashion_dir, md5sum)
from .documents import info_lines as document_info_lines
from .text import SYNTHETIC_TEXT, TEXTS, info_lines as text_info_lines

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"


class DownloadError(Exception):
    """The network or the archive let us down (exit code 1, not a usage error)."""


def download_cifar10(data_dir: Path | None, url: str = CIFAR_URL, timeout: float = 30.0, log=print) -> Path:
    root = Path(data_dir or DEFAULT_DATA_ROOT)
    if cifar_dir(root) is not None:
        log(f"CIFAR-10 already present in {cifar_dir(root)}")
        return cifar_dir(root)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        archive = Path(tmp) / "cifar-10-python.tar.gz"
        log(f"downloading {url} ...")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp, open(archive, "wb") as f:
                total = int(resp.headers.get("Content-Length") or 0)
                done = 0
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    done += len(chunk)
                    if total:
                        print(f"\r  {done / 1e6:6.1f} / {total / 1e6:.1f} MB", end="", flush=True)
            print()
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise DownloadError(f"could not download CIFAR-10 ({exc}). This machine may be offline: "
                                f"fetch {url} elsewhere, unpack it into {root}, or use --dataset "
                                "fashion-mnist / --dataset synthetic") from exc
        digest = md5sum(archive)
        if digest != CIFAR_MD5:
            raise DownloadError(f"downloaded archive has MD5 {digest}, expected {CIFAR_MD5}; try again")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target = root / CIFAR_FOLDER
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(Path(tmp) / CIFAR_FOLDER), target)
    log(f"CIFAR-10 ready in {target}")
    return target


def info(data_dir: Path | None) -> str:
    lines = []
    c = cifar_dir(data_dir)
    if c:
        size = sum(p.stat().st_size for p in c.iterdir() if p.is_file())
        lines.append(f"cifar10        present  {c}  ({size / 1e6:.1f} MB, 50000 train / 10000 test)")
    else:
        lines.append(f"cifar10        absent   (looked in {data_dir or DEFAULT_DATA_ROOT}; "
                     "`paralab data download cifar10`)")
    f = fashion_dir(data_dir)
    if f:
        size = sum((f / name).stat().st_size for name, _ in FASHION_FILES.values())
        lines.append(f"fashion-mnist  present  {f}  ({size / 1e6:.1f} MB, 60000 train / 10000 test)")
    else:
        lines.append("fashion-mnist  absent   (apt-get install dataset-fashion-mnist, or --data-dir)")
    lines.append("synthetic      always   generated in memory (--synthetic-size, default 10000 train)")
    lines += text_info_lines(data_dir)
    lines += document_info_lines(data_dir)
    from .datasets import resolve_dataset
    lines.append(f"--dataset auto picks: {resolve_dataset('auto', data_dir)} for image models, "
                 f"{resolve_dataset('auto', data_dir, 'gpt')} for --model gpt")
    return "\n".join(lines)


def not_downloadable(name: str) -> str:
    """Why ``paralab data download NAME`` does nothing for a dataset other than cifar10, and what does."""
    if name == "fashion-mnist":
        how = "installed by apt (dataset-fashion-mnist)"
    elif name in TEXTS:
        how = (f"a text installed by the package manager: `{TEXTS[name].install}` (as root; `make data` "
               f"does it), or put {TEXTS[name].files[0]} in --data-dir")
    elif name in ("synthetic", SYNTHETIC_TEXT):
        how = "generated in memory: nothing to download"
    else:
        how = "not a dataset paralab knows (see `paralab data info`)"
    return f"only cifar10 can be downloaded; {name!r} is {how}"


def require_dir(data_dir: str | None) -> Path | None:
    if data_dir is None:
        return None
    p = Path(data_dir)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--data-dir {p} is not a directory")
    return p
