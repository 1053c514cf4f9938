"""Record the losses that tests/test_losses_before.py holds the current code to.

    python tests/data/record_losses.py SRC OUT.json

runs each layout in LAYOUTS with the paralab in ``SRC/src`` (a checkout of the commit before the
warm-start change, acd54ed^) and writes the loss at every step, as ``float.hex`` (every bit),
with the CPU and the threads that computed them: the same layouts on the same kind of CPU must give
the same bits after the change.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.125", "--batch-size", "32",
          "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64", "--num-batches", "4", "--lr", "0.1"]
LAYOUTS = [["ddp", "--workers", "2", "--precision", "fp32"],
           ["ddp", "--workers", "2", "--precision", "fp64"],
           ["pipeline", "--workers", "2", "--precision", "fp32"],
           ["fsdp", "--workers", "2", "--precision", "fp32"],
           ["tp", "--workers", "2", "--precision", "fp64"],
           ["single", "--precision", "fp32"]]


def cpu_signature() -> dict:
    """What decides the kernels' arithmetic: torch, the CPU model, its vector instructions, the cores."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    import torch
    return {"model": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "vector": sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"))}


def losses(src: Path, layout: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": str(src / "src")}
        subprocess.run([sys.executable, "-m", "paralab", "train", *layout, *COMMON, "--out", d], check=True,
                       env=env, capture_output=True)
        rows = [json.loads(line) for line in (Path(d) / "steps.jsonl").read_text().splitlines()]
    return steps_losses(rows)


def steps_losses(rows: list[dict]) -> list[str]:
    """The loss at each step, from the lowest rank that reports one (a pipeline's last stage), in hex."""
    by_step = {}
    for r in sorted(rows, key=lambda r: (r["step"], r["rank"])):
        if r.get("loss") is not None:
            by_step.setdefault(r["step"], float(r["loss"]).hex())
    return [by_step[s] for s in sorted(by_step)]


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    runs = [{"layout": layout, "losses": losses(src, layout)} for layout in LAYOUTS]
    out.write_text(json.dumps({"recorded_with": commit, "cpu": cpu_signature(), "common": COMMON, "runs": runs},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
