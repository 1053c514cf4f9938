"""Matmul throughput by size: the four GEMMs of a gpt block, timed on one device.

    python bench/matmul.py                  # this machine's CPU, fp32, a small grid (seconds)
    python bench/matmul.py --device cuda    # bf16 on the first GPU, the widths of published runs

The planner times every matmul at one ``efficiency`` x the dense peak (a
preset's 0.6, docs/plan.md), where published runs rise from 43 % to 52 % of
the peak with the model's size. A matmul efficiency that depends on the
shape would be calibrated from figures like these, measured on the device:
for m tokens (microbatch x sequence) and a width h split over t tensor
ranks, a block's forward GEMMs (``x @ w``, ``x`` m x k, ``w`` k x n):

    qkv   k = h      n = 3 h / t    (the query, key and value projections)
    proj  k = h / t  n = h          (attention's output projection)
    up    k = h      n = 4 h / t    (the MLP's first matrix)
    down  k = 4 h/t  n = h          (its second)

each timed after a warm-up as ``--repeats`` calls queued back to back (the device's time per call, the
host launching ahead as in a step that is not host-bound; one call alone, which also waits for its
launch, is kept beside it as ``seconds_alone``), as achieved
FLOP/s (``2 m n k`` per call) and, where the device's dense peak is known
(``gpu_check.PEAKS``), its fraction of it, and the ramp a cluster file's
``matmul`` takes (the median fraction by FLOPs; the planner then times a
gpt's weight matmuls at it). ``bench/gpu_check.py`` runs it on a lent GPU.
Writes ``bench/results/matmul-<device>.json`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import cpu_name, write_result

HERE = Path(__file__).resolve().parent

#: (tokens, widths, tensor-parallel degrees) per device kind: the CPU's a course size, the GPU's published ones
GRIDS = {"cpu": ((64, 256, 1024), (128, 256, 512), (1,)),
         "cuda": ((2048, 8192), (2048, 4096, 8192, 12288, 25600), (1, 8))}
GEMMS = ("qkv", "proj", "up", "down")


def shape(name: str, m: int, h: int, t: int) -> tuple[int, int, int]:
    """(m, k, n) of a block's forward GEMM ``name`` for m tokens and width h over t tensor ranks."""
    k, n = {"qkv": (h, 3 * h // t), "proj": (h // t, h), "up": (h, 4 * h // t), "down": (4 * h // t, h)}[name]
    return m, k, n


def seconds_of(m: int, k: int, n: int, device: str, dtype, repeats: int) -> tuple[float, float]:
    """(queued, alone): seconds per call of an (m x k) @ (k x n) matmul, after two untimed calls.

    *queued*: ``repeats`` calls issued back to back between two events, divided by ``repeats``, queued behind
    a sleeping kernel so none waits for its launch: the device's own time, the host launching ahead of it as
    in a training step that is not host-bound (the planner's ``launch_us`` prices the host separately).
    *alone*: the median of ``repeats`` single calls, each between its own events, so a small matmul also
    waits for its launch. On a CPU the two are the same wall-clock measure, by ``time.perf_counter``."""
    import torch
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(2):
        x @ w
    if device != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ w
            times.append(time.perf_counter() - t0)
        return statistics.median(times), statistics.median(times)

    def events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = []
    for _ in range(repeats):
        start, end = events()
        start.record()
        x @ w
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    start, end = events()
    torch.cuda._sleep(repeats * 200_000)  # the device busy (about 0.1 ms a call) while the host queues them all
    start.record()
    for _ in range(repeats):
        x @ w
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats, statistics.median(alone)


def measure(device: str, *, tokens=None, widths=None, tp=None, repeats: int = 10, peak: float | None = None,
            say=print) -> list[dict]:
    """Every GEMM of the grid (``GRIDS[device]`` unless given) timed: one row each."""
    import torch
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    grid_m, grid_h, grid_t = GRIDS[device]
    rows = []
    for m in tokens or grid_m:
        for h in widths or grid_h:
            for t in tp or grid_t:
                if h % t:
                    continue
                for name in GEMMS:
                    m_, k, n = shape(name, m, h, t)
                    s, alone = seconds_of(m_, k, n, device, dtype, repeats)
                    flops = 2 * m_ * n * k
                    row = {"gemm": name, "tokens": m, "width": h, "tp": t, "m": m_, "k": k, "n": n,
                           "flops": flops, "seconds": s, "flops_per_s": flops / s,
                           "fraction_of_peak": flops / s / peak if peak else None,
                           "seconds_alone": alone, "fraction_of_peak_alone": flops / alone / peak if peak else None}
                    rows.append(row)
                    say(f"  {name:<5} m {m_:>6} k {k:>6} n {n:>6}: {flops / s / 1e12:8.3f} TFLOP/s"
                        + (f" ({100 * row['fraction_of_peak']:.1f} % of peak; one call alone "
                           f"{100 * row['fraction_of_peak_alone']:.1f} %)" if peak else ""))
    return rows


def ramp(rows: list[dict]) -> list[list[float]]:
    """A cluster file's ``matmul`` from measured rows: per distinct FLOPs, ascending, the median fraction of
    the peak (empty where the peak is unknown)."""
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["fraction_of_peak"]:
            by.setdefault(r["flops"], []).append(r["fraction_of_peak"])
    return [[f, round(min(1.0, statistics.median(v)), 4)] for f, v in sorted(by.items())]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/matmul.py", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (fp32) or cuda (bf16, first GPU)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per GEMM (the median is kept)")
    p.add_argument("--tokens", type=int, nargs="+", help="tokens m (default: the device's grid)")
    p.add_argument("--widths", type=int, nargs="+", help="widths h (default: the device's grid)")
    p.add_argument("--tp", type=int, nargs="+", help="tensor-parallel degrees t (default: the device's grid)")
    p.add_argument("--out", help="the JSON to write (default bench/results/matmul-<device>.json)")
    a = p.parse_args(argv)
    if a.repeats < 1 or any(v < 1 for v in (a.tokens or []) + (a.widths or []) + (a.tp or [])):
        p.error("--repeats, --tokens, --widths and --tp take positive integers")
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/matmul.py: --device cuda, but torch sees no CUDA device; nothing was measured", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else cpu_name()
    peak = None
    if a.device == "cuda":
        from gpu_check import peak_flops
        peak = peak_flops(name, "bf16")
    print(f"matmul: {name}, {'bf16' if a.device == 'cuda' else 'fp32'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    rows = measure(a.device, tokens=a.tokens, widths=a.widths, tp=a.tp, repeats=a.repeats, peak=peak)
    out = Path(a.out) if a.out else HERE / "results" / f"matmul-{a.device}.json"
    path = write_result(out, {"device": name, "kind": a.device, "dtype": "bf16" if a.device == "cuda" else "fp32",
                              "peak_flops": peak, "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows,
                              "cluster_matmul": ramp(rows)})
    print(f"written: {path}")
    if peak:
        print(f"for a cluster file of this device (docs/plan.md, Clusters):\nmatmul = {ramp(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
