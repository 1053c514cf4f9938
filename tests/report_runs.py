"""One tiny `paralab compare` per test session, shared by the report, plot, calc and browser tests.

Not a test module (no ``test_`` prefix): test modules call :func:`tiny_compare`
from a fixture; the first call runs the comparison, later calls reuse it.
The matrix is single (1 worker), ddp (1 and 2 workers: asynchronous bucket
all-reduces) and pipeline (2 workers, 2 microbatches: timeline and bubble),
so every figure of the report has something real to draw.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TINY = ["--num-batches", "4", "--batch-size", "32", "--width", "0.125", "--dataset", "synthetic",
        "--eval-batches", "1", "--microbatches", "2", "--bucket-mb", "0.05",
        "--train-args=--synthetic-size 512 --eval-batch-size 64 --timeout 60"]

_cache: dict = {}


def run_compare(out: Path, *args: str, env: dict | None = None, timeout: float = 400):
    import os
    cmd = [sys.executable, "-m", "paralab", "compare", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def tiny_compare(base: Path):
    """(report directory, completed process) of the session's comparison."""
    if "report" not in _cache:
        out = Path(base) / "tiny-compare"
        # default worker counts (1,2): single only at 1, pipeline only at 2
        p = run_compare(out, "--strategies", "single,ddp,pipeline", *TINY)
        _cache["report"] = (out, p)
    return _cache["report"]
