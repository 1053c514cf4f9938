"""The cost model against an emulated network: collective time vs message size, predicted vs measured.

``sudo python bench/network.py [--workers 4] [--rates 100mbit,1gbit,10gbit] [--repeats 3]``

For each link rate, N ranks each get a namespace and a full-duplex link of
that rate to one switch (``paralab.run.network``, as ``paralab train --network``
builds it) and time, through ``paralab.comm`` over gloo:

- **all-reduce** of S bytes, against the ring formula of ``analysis/cost.py``:
  ``T = 2(N-1)/N x S / B``;
- **gather + scatter** of S bytes through rank 0 (what ``gather-scatter``
  does per parameter), against ``T = 2(N-1) x S / B``: the root's link
  carries N-1 copies in and N-1 out;
- **broadcast** of S bytes from rank 0 (no formula in ``cost.py``): beside
  two candidates, the root sending N-1 copies over its own link
  (``(N-1) x S / B``) and a binomial tree (``ceil(log2 N) x S / B``).

B is the tbf rate. Every rank's time of one call is taken after a barrier;
a call's time is the slowest rank's; each size is timed ``--repeats`` times
and the best (least disturbed) is kept. TCP/IP over Ethernet carries 1448
payload bytes per 1514-byte frame, so even a perfect collective takes
about 4.6 % longer than the formula, which counts payload at the raw rate.

Writes ``bench/results/network.json`` and, with matplotlib,
``bench/results/network.png``; prints a table per rate. Needs root (the
namespaces); run it under the shared CPU lock on a busy machine.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta

from common import RESULTS, SRC, cpu_name, write_result

sys.path.insert(0, str(SRC))

OPS = ("all_reduce", "gather_scatter", "broadcast")


def parse(argv):
    p = argparse.ArgumentParser(prog="bench/network.py", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="100mbit,1gbit,10gbit")
    p.add_argument("--min-kib", type=float, default=64)
    p.add_argument("--max-mib", type=float, default=16, help="largest message (at 100 Mbit: 4 MiB at most)")
    p.add_argument("--repeats", type=int, default=3, help="timings per size and operation; the best is kept")
    p.add_argument("--out", default=str(RESULTS / "network.json"))
    return p.parse_args(argv)


def sizes_for(rate_bps: float, args) -> list[int]:
    """Powers of 4 from --min-kib up to --max-mib, capped so one gather+scatter takes at most ~3 s."""
    cap = min(args.max_mib * (1 << 20), rate_bps / 8 * 3 / (2 * (args.workers - 1)))
    out, size = [], int(args.min_kib * 1024)
    while size <= cap:
        out.append(size)
        size *= 4
    return out


def _rank(rank: int, args, record: dict, init_method: str, sizes: list[int], queue) -> None:
    from paralab.run.network import join
    join(record, rank)
    import torch
    import torch.distributed as dist

    from paralab.comm import Comm
    from paralab.recorder import Recorder

    torch.set_num_threads(1)
    n = args.workers
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n,
                            timeout=timedelta(seconds=300))
    comm = Comm(Recorder(rank, enabled=False), rank, n)

    def gather_scatter(t):
        if rank == 0:
            received = [torch.empty_like(t) for _ in range(n)]
            comm.gather(t, received, dst=0)
            comm.scatter(t, [received[0]] * n, src=0)
        else:
            comm.gather(t, None, dst=0)
            comm.scatter(t, None, src=0)

    calls = {"all_reduce": lambda t: comm.all_reduce(t), "gather_scatter": gather_scatter,
             "broadcast": lambda t: comm.broadcast(t, 0)}
    rows = []
    for size in sizes:
        t = torch.ones(size // 4)
        for op in OPS:
            calls[op](t)  # warm-up: connections and buffers
            times = []
            for _ in range(args.repeats):
                comm.barrier()
                start = time.perf_counter()
                calls[op](t)
                mine = time.perf_counter() - start
                times.append(max(comm.all_gather_objects(mine)))  # the call ends when the slowest rank is done
            rows.append({"op": op, "bytes": size, "best_s": min(times), "times_s": times})
    if rank == 0:
        queue.put(rows)
    comm.barrier()
    dist.destroy_process_group()


def predicted(op: str, size: int, n: int, gbps: float) -> dict:
    from paralab.analysis.cost import bytes_per_second, gather_scatter_time, ring_allreduce_time
    if op == "all_reduce":
        return {"model": "ring 2(N-1)/N x S/B", "s": ring_allreduce_time(size, n, gbps).value}
    if op == "gather_scatter":
        return {"model": "2(N-1) x S/B", "s": gather_scatter_time(size, n, gbps).value}
    b = bytes_per_second(gbps)
    return {"model": "flat (N-1) x S/B", "s": (n - 1) * size / b,
            "tree_s": math.ceil(math.log2(n)) * size / b}


def measure(rate: str, args) -> list[dict]:
    import torch.multiprocessing as mp

    from paralab.run import network

    spec = network.parse(rate)
    sizes = sizes_for(spec.rate_bps, args)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with network.Network(spec, args.workers) as net:
        record = net.record()
        procs = [ctx.Process(target=_rank, args=(r, args, record, net.init_method(), sizes, queue))
                 for r in range(args.workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or queue.empty():
            raise RuntimeError(f"network bench at {rate}: a rank failed")
        rows = queue.get()
    for row in rows:
        pred = predicted(row["op"], row["bytes"], args.workers, spec.gbps)
        row |= {"rate": rate, "gbps": spec.gbps, "predicted_s": pred["s"], "model": pred["model"],
                "measured_over_predicted": row["best_s"] / pred["s"]}
        if "tree_s" in pred:
            row["predicted_tree_s"] = pred["tree_s"]
    return rows


def human(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"




def plot(rows: list[dict], rates: list[str], n: int, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    colours = {"all_reduce": "C0", "gather_scatter": "C1", "broadcast": "C2"}
    for ax, rate in zip(axes[0], rates):
        for op in OPS:
            pts = sorted((r for r in rows if r["rate"] == rate and r["op"] == op), key=lambda r: r["bytes"])
            if not pts:
                continue
            x = [r["bytes"] / 1e6 for r in pts]
            ax.plot(x, [r["best_s"] * 1e3 for r in pts], "o-", color=colours[op], label=f"{op} measured")
            ax.plot(x, [r["predicted_s"] * 1e3 for r in pts], "--", color=colours[op],
                    label=f"{op} predicted ({pts[0]['model']})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (MB)")
        ax.set_ylabel("time of one call (ms)")
        ax.set_title(f"{n} ranks, {rate} per rank link (tbf)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    import torch

    from paralab.run import network

    args = parse(argv)
    if os.geteuid() != 0:
        print("bench/network.py builds network namespaces: run it as root", file=sys.stderr)
        return 2
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    started = time.time()
    load_before = os.getloadavg()
    rows = []
    for rate in rates:
        print(f"bench network: {rate} ...", flush=True)
        rows += measure(rate, args)
    spec = network.parse(rates[0])
    result = {"benchmark": "network", "backend": "gloo", "workers": args.workers, "repeats": args.repeats,
              "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "wall_s": time.time() - started,
              "link": {"qdisc": "tbf", "burst": f"max({network.MIN_BURST} B, {network.BURST_S * 1e3:g} ms at rate)",
                       "limit": f"max({network.MIN_LIMIT} B, {network.QUEUE_S * 1e3:g} ms at rate)", "mtu": 1500,
                       "example": network.describe(network.Network(spec, args.workers).record())},
              "rows": rows}
    out = write_result(args.out, result)
    png = out.with_suffix(".png")
    plot(rows, rates, args.workers, png)
    print(f"{args.workers} ranks, gloo, each on its own full-duplex link; {result['cpu']}; best of {args.repeats}")
    print(f"{'rate':>8} {'op':>15} {'size':>9} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>9}")
    for r in rows:
        print(f"{r['rate']:>8} {r['op']:>15} {human(r['bytes']):>9} {r['best_s'] * 1e3:>12.2f} "
              f"{r['predicted_s'] * 1e3:>13.2f} {r['measured_over_predicted']:>9.2f}")
    print(f"written to {out}" + (f" and {png}" if png.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
