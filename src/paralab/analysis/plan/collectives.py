"""This machine's collectives as a run meets them: timed between chunks of compute, every worker at once.

A ring formula with a bandwidth and a latency measured on idle processes
(``calibrate.link_times``) is right for a cluster whose devices wait for
nothing but the wire. On one machine whose workers share its cores, a
collective also waits for the slowest rank of its group to reach it (the
others took its core), for each rank to be woken when its bytes arrive, and
for the kernel, which moves the bytes on the same cores. None of that is in
the formula; all of it is in what a run's spans measure.

:func:`measure` starts ``workers`` processes (each one thread, in its
namespace of an emulated network where one is given) that do what a
training step does: compute a chunk (the course gpt's block, forward and
backward, 2 sequences), then call one collective through ``comm.py``, many
times over. Every group size a layout can use (each divisor of the workers
above 1, all groups of that size calling at once, as a tp x dp layout does),
each operation (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``) and four sizes. A call's time is the mean over its repeats
and over the ranks. The mean, not the median: over an
emulated link a few calls take several times the typical one (TCP's
delayed acknowledgements; docs/plan.md), and a step pays for every call.
:meth:`~.cluster.Cluster.collective` fits a latency and a bandwidth to the sizes (:func:`fitted`) instead of
using the ring formula with an idle link's.

``S`` is the operation's whole buffer: an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input, what an all-to-all sends.

A pipeline's transfer is not timed here: this loop's blocking send would
measure the receiver waiting for the sender's core (6.5-7.2 ms at 1 Gbit
from 4 kB to 512 kB, docs/plan.md), which the pipeline's replay on shared
cores (``shared_cores.py``) already models, with each send's and receive's
processor time (``calibrate.p2p_time``); the transfer itself takes the
link's formula (``S / B + a``).

Small all-reduces that follow one another with only elementwise work
between them (sequence parallelism's replicated parameters, summed in
backward) meet no straggler: ``all_reduce_burst`` is the smallest size timed
back to back.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BURST = "all_reduce_burst"  # a small all-reduce right after another: no rank is behind
CHUNK = (128, 4, 64, 2)  # the compute between calls: a gpt block (width, heads, tokens, sequences)


def group_sizes(workers: int) -> list[int]:
    """The group sizes a layout of ``workers`` can use: every divisor above 1."""
    return [g for g in range(2, workers + 1) if workers % g == 0]


def sizes_for(gbps: float) -> list[int]:
    """Four buffer sizes in bytes, from 4 kB to one moving in about 40 ms over the link (256 kB to 2 MB),
    about evenly spaced in log: a call's time is fitted to them."""
    big = int(min(2 * 2 ** 20, max(256 * 1024, gbps * 1e9 / 8 * 0.04)))
    big -= big % 4096
    return [4096, big // 32, big // 4, big]


def _rank(rank: int, world: int, init: str, join, record, sizes: list[int], repeats: int, out) -> None:
    if join is not None:
        join(record, rank)  # into this rank's namespace of the emulated network
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from ...comm import Comm
    from ...models.gpt import Block
    from ...recorder import Recorder
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        rec = Recorder(rank, enabled=False)
        width, heads, tokens, batch = CHUNK
        block = Block(width, heads)
        x = torch.randn(batch, tokens, width, requires_grad=True)

        def chunk() -> None:
            block(x).sum().backward()

        comms = {}
        for g in group_sizes(world):  # every rank creates every group, in the same order
            for lo in range(0, world, g):
                members = list(range(lo, lo + g))
                pg = dist.new_group(members)
                if rank in members:
                    comms[g] = Comm(rec, members.index(rank), g, group=pg, ranks=members)
        rows = []
        for g, comm in comms.items():
            for op in OPS:
                for size in sizes:
                    call = _call(comm, op, size, g, torch)
                    call()  # warm-up: connections and buffers
                    times = []
                    for _ in range(repeats):
                        chunk()
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    rows.append((op, g, size, statistics.fmean(times)))
                    if op == "all_reduce" and size == sizes[0]:  # small calls in a burst, nothing between
                        t0 = time.perf_counter()
                        for _ in range(repeats):
                            call()
                        rows.append((BURST, g, size, (time.perf_counter() - t0) / repeats))
        everyone = Comm(rec, rank, world).gather_objects({"rows": rows})  # JSON over the wire (wire.py)
        if rank == 0:
            out.put(everyone)
    finally:
        dist.destroy_process_group()


def _call(comm, op: str, size: int, g: int, torch):
    """A no-argument function doing ``op`` on a ``size``-byte buffer in ``comm``'s group of ``g``."""
    n = size // 4
    full = torch.ones(n - n % g)
    if op == "all_reduce":
        return lambda: comm.all_reduce(full)
    if op == "all_gather":
        shard = torch.ones(full.numel() // g)
        return lambda: comm.all_gather_into(full, shard)
    if op == "reduce_scatter":
        shard = torch.empty(full.numel() // g)
        return lambda: comm.reduce_scatter(shard, full)
    got = torch.empty_like(full)  # all_to_all
    return lambda: comm.all_to_all_single(got, full)


def answers(target, args: list[tuple], count: int, timeout: float) -> list:
    """Start a spawned process per entry of ``args`` (each runs ``target(*entry, queue)``), take ``count``
    answers from the queue, and end every process however that goes: the measuring processes of this module
    and of ``calibrate.py``."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in range(count)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def measure(workers: int, gbps: float, repeats: int = 30, join=None, record: dict | None = None,
            init_method: str | None = None, timeout: float = 300.0) -> dict:
    """Every group size, operation and size timed in the loop (``join``, ``record``, ``init_method``: the
    emulated network's, as ``paralab.run.network`` gives them; none: loopback). Returns the rows and
    their points by operation and group size (:func:`points`)."""
    sizes = sizes_for(gbps)
    with tempfile.TemporaryDirectory() as tmp:
        init = init_method or f"file://{Path(tmp) / 'store'}"
        everyone = answers(_rank, [(r, workers, init, join, record, sizes, repeats) for r in range(workers)], 1,
                           timeout)[0]
    rows = []
    for i, (op, g, size, _) in enumerate(everyone[0]["rows"]):
        rows.append({"op": op, "group": g, "bytes": size,  # a call's time: the mean over the ranks
                     "seconds": statistics.fmean(r["rows"][i][3] for r in everyone)})
    return {"workers": workers, "gbps": gbps, "sizes": sizes, "repeats": repeats, "rows": rows,
            "points": points(rows)}


def points(rows: list[dict]) -> dict:
    """{op: {group size: [[bytes, seconds], ...]}} in size order: what :meth:`~.cluster.Cluster.collective`
    fits."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["bytes"]):
        out.setdefault(r["op"], {}).setdefault(str(r["group"]), []).append([r["bytes"], r["seconds"]])
    return out


def fitted(pts: list, size: float) -> float:
    """Seconds of one call of ``size`` bytes from measured ``[bytes, seconds]`` points: the line
    ``a + size / B`` (a collective's form: a latency and a bandwidth) fitted to all of them by least squares,
    never under the fastest measured call. Not a line through each pair of neighbours: the mean at one size
    can carry a tail the others do not (TCP's delayed acknowledgements, docs/plan.md), and a fit over every
    size weighs it against them."""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if len(pts) == 1:
        return ys[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 0.0) if sxx else 0.0
    return max(my + slope * (size - mx), min(ys))
