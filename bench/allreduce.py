"""All-reduce micro-benchmark: bus bandwidth vs message size (gloo on CPU, NCCL on GPU).

``python bench/allreduce.py [--workers 2] [--cores-per-worker 1] [--min-kib 4] [--max-mib 64]``

N local ranks all-reduce float32 messages from 4 KiB to 64 MiB (powers of
4) through ``paralab.comm`` (the path every strategy uses). For each size the
median time of one call gives

    algbw = bytes / time          busbw = algbw x 2(N-1)/N

(nccl-tests' definition: busbw is what each rank's link carries per second,
comparable across N). Strategies' achieved ``bus_bandwidth`` in summary.json
can be read against this curve: small messages are latency-bound, big ones
approach the link's (here: loopback memory copy) bandwidth. Writes
``bench/results/allreduce.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

from common import RESULTS, SRC, write_result

sys.path.insert(0, str(SRC))

TARGET_S = 0.4  # time to spend timing each size


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/allreduce.py", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores-per-worker", type=int, default=1, help="0: do not pin")
    p.add_argument("--min-kib", type=float, default=4)
    p.add_argument("--max-mib", type=float, default=64)
    p.add_argument("--out", default=str(RESULTS / "allreduce.json"))
    return p.parse_args(argv)


def _rank(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from paralab.comm import Comm
    from paralab.recorder import Recorder

    if args.cores_per_worker:
        c = args.cores_per_worker
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(allowed) >= (rank + 1) * c:
            os.sched_setaffinity(0, allowed[rank * c:(rank + 1) * c])
        torch.set_num_threads(c)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.workers, timeout=timedelta(seconds=120))
    comm = Comm(Recorder(rank, enabled=False), rank, args.workers)
    rows = []
    size = int(args.min_kib * 1024)
    while size <= args.max_mib * (1 << 20):
        t = torch.ones(size // 4)
        comm.all_reduce(t)  # warm-up: connections, buffers
        start = time.perf_counter()
        comm.all_reduce(t)
        once = torch.tensor([time.perf_counter() - start])
        comm.broadcast(once, 0)  # every rank must run the same number of calls
        reps = max(3, min(500, int(TARGET_S / max(once.item(), 1e-6))))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        alg = size / median / 1e9
        rows.append({"bytes": size, "reps": reps, "median_s": median, "min_s": min(times),
                     "algbw_GBps": alg, "busbw_GBps": alg * 2 * (args.workers - 1) / args.workers})
        size *= 4
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str]) -> int:
    import torch
    import torch.multiprocessing as mp

    from paralab.run.rendezvous import free_port

    args = parse(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(args.workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs) or queue.empty():
        print("allreduce bench: a rank failed", file=sys.stderr)
        return 1
    rows = queue.get()
    result = {"benchmark": "allreduce", "backend": "gloo", "workers": args.workers,
              "cores_per_worker": args.cores_per_worker, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows,
              "peak_busbw_GBps": max(r["busbw_GBps"] for r in rows)}
    out = write_result(args.out, result)
    print(f"gloo all-reduce, {args.workers} ranks x {args.cores_per_worker or 'all'} core(s); "
          f"busbw = algbw x 2(N-1)/N")
    print(f"{'size':>10} {'reps':>5} {'median ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{human(r['bytes']):>10} {r['reps']:>5} {1e3 * r['median_s']:>10.3f} {r['algbw_GBps']:>11.3f} "
              f"{r['busbw_GBps']:>11.3f}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
