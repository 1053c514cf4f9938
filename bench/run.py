"""Run the benchmarks: ``python bench/run.py [NAME ...]`` (default: all).

Each benchmark is a module in this folder with ``main(argv) -> int`` that
measures its strategies side by side in one run, prints a table of ratios and
writes ``bench/results/<name>.json``.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("allreduce", "dp", "pipeline", "fsdp", "mesh", "tp", "schedules", "startup", "moe")
BENCHMARKS += ("context",)  # bench/context.py: cp on the gpt
BENCHMARKS += ("recompute",)  # bench/recompute.py: time against saved activations
BENCHMARKS += ("hsdp",)  # bench/hsdp.py: HSDP and fsdp x tp
BENCHMARKS += ("documents",)  # bench/documents.py: packing vs padding, the cp balancer on packed documents
BENCHMARKS += ("chaos",)  # bench/chaos.py: faults at random moments, checkpoints that survive them
BENCHMARKS += ("check_band",)  # bench/check_band.py: --check's noise band on correct layouts and seeded bugs


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE))
    names = argv or [n for n in BENCHMARKS if (HERE / f"{n}.py").exists()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    code = 0
    for name in names:
        print(f"=== bench {name} ===", flush=True)
        code |= importlib.import_module(name).main([])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
