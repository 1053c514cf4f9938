"""``this-machine``: a cluster measured here, in well under a minute, and cached.

Five measurements, each the best (a unit's, a transfer's: the median) of a few repeats:

- matmul FLOP/s in the run's dtype on one core (one worker of paralab's
  launcher is pinned to its share of the cores): ``2 n^3 / t`` for n = 512;
- a real unit: the course gpt's block (width 128, 64 tokens) forward and
  backward. Its fixed cost (dispatch: what makes small microbatches slow; a
  third of it is a forward's) is timed directly, on one sequence of one
  token, whose arithmetic is negligible; the rate its arithmetic achieves
  is the slope of ``t(b) = fixed + b x flops / rate`` through 1, 2, 4 and 8
  sequences. (An intercept fitted through those four times instead swings
  from 0.4 to 1.7 ms between runs on a 2-core VM, and below zero on a
  slower one.) Once per worker count (cached) the block on 8 sequences runs
  in as many processes at once as the plan has workers (the best of three):
  its slowdown against one alone divides the rate and multiplies the fixed
  cost (workers sharing cores, and whatever else runs here). The rate over the matmul's x
  the share of cores is the cluster's ``efficiency``;
- memory bandwidth: a 256 MB tensor copied, bytes read and written / time;
- a pipeline's send or receive: two processes run a pipeline of two tiny
  stages through paralab's own executor (GPipe, 16 microbatches); a step's
  wall time less its compute and its waits for the peer, per send or
  receive, is the processor time the executor spends around a transfer
  (posting it, its bookkeeping, waking for it): the median of 10 steps;
- the link: gloo processes on loopback all-reduce 1 kB and 16 MB through
  ``comm.py`` (timed by the recorder), two of them, and (once per worker
  count, cached) as many as the plan has workers; a ring of n takes
  ``2(n-1)/n x S / B + 2(n-1) a``, so the two sizes give the bandwidth B and
  the latency a of a step (which, with more processes than cores, includes
  waiting to be scheduled).

The result is cached as JSON (``~/.cache/paralab/calibration-<host>.json``,
or the file ``--calibration`` names): a second plan reads it instead of
measuring (``--recalibrate`` measures again). :func:`this_machine` turns it
into a :class:`~.cluster.Cluster` for a number of workers: all on one node;
more workers than cores share them, each getting ``cores / workers`` of one
core's rate; memory is the machine's divided among the workers.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

from ...progress import Progress
from .cluster import Cluster
from .collectives import answers

SMALL, LARGE = 1024, 16 * 2 ** 20  # all-reduce sizes in bytes
REPEATS = 10
PIPE_MICROBATCHES, PIPE_STEPS = 16, 10  # the pipeline whose sends and receives are timed (p2p_time)


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paralab" / \
        f"calibration-{socket.gethostname()}.json"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "this CPU"


def matmul_rate(dtype: str, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` on one thread (best of ``repeats``)."""
    import torch
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(n, n).to(kind)
        x @ x  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ x
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / best


def copy_rate(size: int = 256 * 2 ** 20, repeats: int = 3) -> float:
    """Bytes per second a copy moves (read + write) on one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.empty(size // 4)
        b = torch.empty_like(a)
        b.copy_(a)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * size / best


BATCHES = (1, 2, 4, 8)  # sequences per forward and backward of the calibration's block


def block_flops(batch: int) -> float:
    """Forward and backward FLOPs of the course gpt's block (width 128, 4 heads, 64 tokens) on ``batch``."""
    from .workload import gpt_workload
    return 3 * batch * gpt_workload(1, 128, 4, 64, 256).units[1].forward_flops


def block_times(dtype: str, batches: tuple = BATCHES, repeats: int = 5, tokens: int = 64) -> dict[int, float]:
    """{sequences: median seconds} of the course gpt's block (width 128, 4 heads, ``tokens`` tokens), forward and
    backward on one thread: its matmuls, its elementwise work and its fixed cost."""
    import torch

    from ...models.gpt import Block
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = Block(128, 4).to(kind)
        out = {}
        for b in batches:
            x = torch.randn(b, tokens, 128, dtype=kind, requires_grad=True)
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                block(x).sum().backward()
                if i:  # the first is warm-up
                    times.append(time.perf_counter() - t0)
            out[b] = statistics.median(times)
    finally:
        torch.set_num_threads(threads)
    return out


def speed_probe(dtype: str = "fp32", repeats: int = 21) -> float:
    """Seconds of the calibration's block on 8 sequences, alone, now (the median of ``repeats``): set
    against the calibration's ``block_seconds["8"]``, how much slower (> 1) or faster the machine runs
    than when it was calibrated (a VM's speed moves)."""
    return block_times(dtype, (8,), repeats)[8]


def at_speed(cal: dict, factor: float) -> dict:
    """The calibration of the same machine computing ``factor`` times slower: every compute rate divided,
    every compute time multiplied; the link's measurements kept."""
    out = dict(cal)
    for key in ("matmul_flops", "copy_bytes_per_s", "block_flops"):
        out[key] = cal[key] / factor
    for key in ("unit_overhead_s", "p2p_overhead_s"):
        if key in cal:
            out[key] = cal[key] * factor
    out["block_seconds"] = {b: t * factor for b, t in cal["block_seconds"].items()}
    out["block_flops_by_workers"] = {w: r / factor for w, r in cal.get("block_flops_by_workers", {}).items()}
    return out


def dispatch_time(dtype: str, repeats: int = 21) -> float:
    """Seconds of the calibration's block forward and backward on one sequence of one token (the median of
    ``repeats``): its arithmetic is negligible, so this is what a unit costs whatever its size."""
    return block_times(dtype, (1,), repeats, tokens=1)[1]


def fit_block(times: dict, fixed: float) -> float:
    """FLOP/s of ``t(b) = fixed + b x flops / rate`` through the batches' times with the fixed cost measured
    (least squares through the origin of ``t - fixed``): the rate a unit's arithmetic achieves."""
    pts = [(int(b), t - fixed) for b, t in times.items()]
    slope = max(sum(b * t for b, t in pts) / sum(b * b for b, _ in pts), 1e-12)
    return block_flops(1) / slope


def block_rate(dtype: str) -> float:
    """FLOP/s of the block on 8 sequences, fixed cost included (what :func:`parallel_block_rate` compares)."""
    return block_flops(8) / block_times(dtype, (8,))[8]


def _block_worker(dtype: str, out) -> None:
    out.put(block_rate(dtype))


def parallel_block_rate(dtype: str, workers: int, timeout: float = 120.0) -> float:
    """The block's rate per process with ``workers`` processes running it at once (one thread each): what
    one worker achieves when the workers share the cores (and whatever else runs here). The median."""
    return statistics.median(answers(_block_worker, [(dtype,)] * workers, workers, timeout))


def _rank(rank: int, world: int, store: str, out) -> None:
    """One of the link-measuring processes: repeated all-reduces through comm.py."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from ...comm import Comm
    from ...recorder import Recorder
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        rec = Recorder(rank)
        comm = Comm(rec, rank, world)
        times = {}
        for size in (SMALL, LARGE):
            t = torch.zeros(size // 4)
            for _ in range(3):
                comm.all_reduce(t, name=f"warm{size}")
            for _ in range(REPEATS):
                comm.all_reduce(t, name=f"size{size}")
            times[size] = min(s.seconds for s in rec.spans if s.name == f"size{size}")  # best: least disturbed
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def link_times(world: int = 2, timeout: float = 60.0) -> dict[int, float]:
    """{bytes: best seconds} of a ``world``-process gloo all-reduce on loopback."""
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        return answers(_rank, [(r, world, store) for r in range(world)], 1, timeout)[0]


def _pipeline_rank(rank: int, world: int, store: str, out) -> None:
    """One of two processes running a pipeline of two tiny stages through paralab's own executor (GPipe,
    :data:`PIPE_MICROBATCHES` microbatches): each step's wall time less its compute and its waits for the
    peer, per send or receive, is what the executor's bookkeeping around a transfer costs the processor."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from ...comm import Comm
    from ...recorder import Recorder
    from ...strategies.pipeline.executor import Executor
    from ...strategies.pipeline.schedules import build_schedule
    from ...strategies.pipeline.stage import Stage
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        width, m = 16, PIPE_MICROBATCHES
        ctx = SimpleNamespace(device=torch.device("cpu"), autocast=nullcontext,
                              loss=lambda out, y: ((out - y) ** 2).mean(), scaled=lambda loss: loss)
        stage = Stage({rank: torch.nn.Linear(width, width)}, rank == 0, rank == world - 1, (width,), (width,), ctx)
        actions = build_schedule("gpipe", world, m)[rank]
        transfers = sum(1 for a in actions if a.kind.is_send or a.kind.is_recv)
        chunks = [(torch.randn(4, width), torch.randn(4, width), 1 / m) for _ in range(m)]
        rec = Recorder(rank)
        executor = Executor(Comm(rec, rank, world), rec, ctx.device, nullcontext)
        per_action = []
        for step in range(-2, PIPE_STEPS):  # two to warm up
            rec.step = step
            t0 = time.perf_counter()
            executor.run({rank: stage}, actions, chunks)
            wall = time.perf_counter() - t0
            accounted = sum(s.seconds for s in rec.spans if s.step == step and s.category in ("compute", "idle"))
            for unit in stage.units:
                unit.zero_grad(set_to_none=True)
            if step >= 0:
                per_action.append((wall - accounted) / transfers)
        out.put(statistics.median(per_action))
    finally:
        dist.destroy_process_group()


def p2p_time(timeout: float = 60.0) -> float:
    """Processor seconds of one pipeline send or receive beside its transfer: two processes of
    :func:`_pipeline_rank`, the mean of their medians."""
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        return statistics.fmean(answers(_pipeline_rank, [(r, 2, store) for r in range(2)], 2, timeout))


def fit_ring(times: dict[int, float], n: int) -> tuple[float, float]:
    """(Gb/s, latency s) of the ring ``T = 2(n-1)/n x S / B + 2(n-1) a`` through the two sizes' times."""
    small, large = times[SMALL], times[LARGE]
    per_byte = max(large - small, 1e-12) / (LARGE - SMALL)  # 2(n-1)/n / B
    latency = max(small - SMALL * per_byte, 0.0) / (2 * (n - 1))
    return 2 * (n - 1) / n * 8 / per_byte / 1e9, latency


def measure(dtype: str, progress: bool = True) -> dict:
    """Every measurement, as the cache holds it."""
    bar = Progress(6, "calibrating this machine", enabled=progress)
    t0 = time.perf_counter()
    rate = matmul_rate(dtype)
    bar.update(1, f"matmul {rate / 1e9:.1f} GFLOP/s ({dtype}, one core)")
    blocks = block_times(dtype)
    fixed = dispatch_time(dtype)
    unit = fit_block(blocks, fixed)
    bar.update(2, f"a gpt block {unit / 1e9:.1f} GFLOP/s + {fixed * 1e6:.0f} us fixed (forward and backward)")
    mem = copy_rate()
    bar.update(3, f"copy {mem / 1e9:.1f} GB/s")
    overhead = fixed / 3  # a forward's share: backward costs twice a forward
    bar.update(4, f"a unit's fixed cost {overhead * 1e6:.0f} us a forward")
    times = link_times()
    gbps, latency = fit_ring(times, 2)
    bar.update(5, f"loopback {gbps:.2f} Gb/s, {latency * 1e6:.0f} us")
    action = p2p_time()
    bar.update(6, f"a pipeline's send or receive {action * 1e6:.0f} us")
    bar.close()
    return {"dtype": dtype, "matmul_flops": rate, "copy_bytes_per_s": mem, "unit_overhead_s": overhead,
            "p2p_overhead_s": action,
            "block_flops": unit, "block_seconds": {str(b): t for b, t in blocks.items()}, "allreduce_seconds": {
        str(k): v for k, v in times.items()}, "link_gbps": gbps, "link_latency_s": latency,
            "cores": os.cpu_count() or 1, "memory_bytes": _memory_bytes(), "cpu": cpu_name(),
            "host": socket.gethostname(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": time.perf_counter() - t0}


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 10 ** 9


def is_calibration(path: Path) -> bool:
    """Whether the file ``path`` is a calibration this module wrote (JSON: dtype -> measurements, each with
    the time it was measured), which a new measurement may replace."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and bool(data) and all(isinstance(v, dict) and "measured_at" in v
                                                         for v in data.values())


def calibration(dtype: str, cache: Path | None = None, again: bool = False, progress: bool = True,
                workers: int | None = None) -> tuple[dict, str]:
    """(the measurements, where they came from): the cache if it holds this dtype, else measured and cached;
    with ``workers``, also the block's rate with that many processes at once (measured once per count)."""
    cache = cache or default_cache()
    data: dict = {}
    if cache.is_file():
        try:
            data = json.loads(cache.read_text())
        except ValueError:
            data = {}  # a damaged cache is measured again
    found = data.get(dtype) if not again else None
    fresh = found is None or "block_seconds" not in found
    if fresh:
        found = measure(dtype, progress)
    if "p2p_overhead_s" not in found:  # a cache from before this measurement: add it, once
        found["p2p_overhead_s"] = p2p_time()
        fresh = True
    key = str(workers) if workers else None
    if key and (key not in found.setdefault("block_flops_by_workers", {})
                or workers > 1 and key not in found.get("link_by_workers", {})):
        bar = Progress(2, f"calibrating: {workers} workers at once", enabled=progress)
        # the best of three: the least disturbed (another process here can slow one down)
        found["block_flops_by_workers"][key] = max(parallel_block_rate(dtype, workers) for _ in range(3))
        bar.update(1, f"a gpt block {found['block_flops_by_workers'][key] / 1e9:.1f} GFLOP/s per worker")
        if workers > 1:
            gbps, latency = fit_ring(link_times(workers), workers)
            found.setdefault("link_by_workers", {})[key] = {"gbps": gbps, "latency_s": latency}
            bar.update(2, f"a ring of {workers}: {gbps:.2f} Gb/s, {latency * 1e6:.0f} us a step")
        bar.close()
        fresh = True
    if fresh:
        data[dtype] = found
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(cache)  # never a half-written cache
        return found, f"measured now, cached in {cache}"
    return found, f"read from {cache} (measured {found['measured_at']}; --recalibrate measures again)"


def this_machine(cal: dict, workers: int, where: str) -> Cluster:
    """The cluster of ``workers`` processes on this machine, from a calibration."""
    cores = cal["cores"]
    share = min(1.0, cores / workers)
    rate = cal["matmul_flops"] * share
    together = cal.get("block_flops_by_workers", {}).get(str(workers))
    alone = block_flops(8) / cal["block_seconds"]["8"]
    slowdown = alone / together if together is not None else 1 / share  # of a unit, the workers at once
    block = cal["block_flops"] / slowdown
    efficiency = min(1.0, block / rate)
    ring = cal.get("link_by_workers", {}).get(str(workers))
    gbps, latency = (ring["gbps"], ring["latency_s"]) if ring else (cal["link_gbps"], cal["link_latency_s"])
    return Cluster(
        "this-machine", {cal["dtype"]: rate / 1e12}, cal["memory_bytes"] / workers / 1e9,
        cal["copy_bytes_per_s"] * share / 1e9, max(workers, 1), intra_gbps=gbps,
        intra_latency_us=latency * 1e6, inter_gbps=gbps, inter_latency_us=latency * 1e6, efficiency=efficiency,
        unit_overhead_us=cal["unit_overhead_s"] * 1e6 * slowdown, crowding=slowdown if share < 1 else 0.0,
        p2p_overhead_us=cal.get("p2p_overhead_s", 0.0) * 1e6,  # alone: shared_cores.py shares it
        elementwise=False,  # the block's measured rate holds its elementwise work
        source=f"measured on {cal['cpu']} ({cores} cores), {where}: {cal['dtype']} matmul "
               f"{cal['matmul_flops'] / 1e9:.3g} GFLOP/s per core"
               + (f" x {cores}/{workers} (workers share the cores)" if share < 1 else "")
               + f", a gpt block (h 128, s 64, b 8) forward and backward {block / 1e9:.3g} GFLOP/s per worker "
               + (f"with {workers} running at once" if together is not None else "(one alone, x the share)")
               + f": efficiency {efficiency:.2f}"
               + f", a unit's fixed cost {cal['unit_overhead_s'] * 1e6:.3g} us"
               + f", a pipeline's send or receive {cal.get('p2p_overhead_s', 0.0) * 1e6:.3g} us of processor"
               + f", copy {cal['copy_bytes_per_s'] / 1e9:.3g} GB/s, gloo loopback "
                 f"{gbps:.3g} Gb/s and {latency * 1e6:.3g} us a ring step"
               + (f" (a ring of {workers} at once)" if ring else " (2 processes)"))
