"""Shared test helpers: run the CLI in a subprocess and read its run directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, saying why, where no CUDA device is visible (`make gpu-check` runs them)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

# Small and fast: every multi-worker test uses these unless it needs otherwise.
FAST = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.125", "--batch-size", "32",
        "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64", "--timeout", "30"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def rows(self, name: str) -> list[dict]:
        return [json.loads(line) for line in (self.out / name).read_text().splitlines()]


def run_paralab(*args: str, out: Path | None = None, env: dict | None = None, timeout: float = 240,
                fast: bool = True) -> Result:
    cmd = [sys.executable, "-m", "paralab", *args]
    if args and args[0] == "train":
        if fast:  # before the test's own options, so a test can override any of them
            cmd = cmd[:5] + FAST + cmd[5:]
        if out is not None:
            cmd += ["--out", str(out)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return Result(p.returncode, p.stdout, p.stderr, out or Path("."))


@pytest.fixture
def paralab(tmp_path):
    """``paralab("train", "ddp", "--workers", "2")`` -> Result with a fresh run directory."""
    counter = iter(range(1000))

    def run(*args, **kwargs):
        out = kwargs.pop("out", tmp_path / f"run{next(counter)}")
        return run_paralab(*args, out=out, **kwargs)
    return run
