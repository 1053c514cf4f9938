"""A cluster as the planner sees it: one device's arithmetic and memory, and the two kinds of link.

:class:`Cluster` holds what a prediction needs and nothing else: peak FLOP/s
per dtype (dense, no sparsity), the fraction of it large matmuls achieve
(``efficiency``, an assumption a preset states), a ramp by a matmul's size
(``matmul``: measured on the device by ``bench/matmul.py`` in a cluster
file; derived from published GEMM figures for the Hopper presets,
:func:`gemm_ramp`), device memory and its
bandwidth, devices per node, and the bandwidth and latency of a link inside a
node (NVLink) and between nodes (one NIC per device). Bandwidths are per
direction, in Gb/s as everywhere in paralab's cost model.

:data:`PRESETS` are common nodes, each with its ``source`` (vendor datasheet
names and addresses; the latencies are typical values, said so). A user's
cluster is a JSON or TOML file with the same fields (:func:`load_cluster`):
a missing or unknown field is refused, naming it. ``this-machine`` is
measured (``calibrate.py``).
"""
from __future__ import annotations

import bisect
import difflib
import json
import math
import statistics
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from ...errors import UsageError
from .collectives import fitted

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Cluster:
    name: str
    peak_tflops: dict            # dtype -> dense peak TFLOP/s of one device
    memory_gb: float             # device memory, 1 GB = 10^9 B
    memory_gbs: float            # device memory bandwidth, GB/s (the optimizer step is bound by it)
    devices_per_node: int
    intra_gbps: float            # one direction of a device's link inside a node, Gb/s
    intra_latency_us: float
    inter_gbps: float            # one device's share of the network between nodes, Gb/s
    inter_latency_us: float
    efficiency: float            # achieved / peak for large matmuls (an assumption; 1 where measured)
    source: str                  # where each number comes from
    usable_fraction: float = 0.9  # of device memory a run may fill (allocator, context, workspaces)
    unit_overhead_us: float = 0.0  # fixed time of one unit's forward of one microbatch (launches, dispatch)
    collectives: dict | None = None  # measured: {op: {group size: [[bytes, seconds], ...]}} (collectives.py)
    crowding: float = 0.0  # workers sharing fewer cores: a unit's slowdown with all computing at once (0: a device each)
    launch_us: float = 0.0  # a device fed by its host (a GPU): the host's time to launch one unit's forward of one
    #                         microbatch, which a pass takes at least however little the device does (predict.py);
    #                         fitted to measured runs (analysis/measured.py)
    p2p_overhead_us: float = 0.0  # processor time of a point-to-point send or receive beside its transfer (measured here)
    elementwise: bool = True  # time a gpt block's elementwise kernels at memory_gbs beside the matmuls at their
    #                           rate (workload.block_elementwise); False where the rate was measured on a whole
    #                           block, which holds them (this-machine)
    matmul: tuple | None = None  # ((FLOPs of one 16-bit matmul, fraction of the dense peak it reached), ...),
    #                              ascending (bench/matmul.py measures it; gemm_ramp derives it from published
    #                              figures); a gpt's weight matmuls are timed at the fraction their size reaches
    #                              (matmul_efficiency); None: all at efficiency

    def collective(self, op: str, size: float, n: int, link: tuple[float, float], calls: int = 1) -> float:
        """Seconds of ``calls`` calls of ``op`` moving ``size`` bytes in all over a group of ``n`` ranks on
        ``link``: fitted to measured calls (``collectives.fitted``) where the cluster has them for ``op`` at ``n``
        (``collectives.py``; each call moving ``size / calls``), else the ring
        (``all_reduce`` and ``all_reduce_burst``: ``2(n-1)/n S/B + 2(n-1) a``; ``all_gather``,
        ``reduce_scatter``, ``all_to_all``: half that; ``send``: ``S/B + a``). ``S`` is the whole buffer (an
        all-gather's output, a reduce-scatter's input)."""
        if n <= 1 or calls <= 0:
            return 0.0
        measured = self.collectives and self.collectives.get(op, {}).get(str(n))
        if measured:
            return calls * fitted(measured, size / calls)
        gbps, lat = link
        if op == "send":
            return size / (gbps * 1e9 / 8) + calls * lat
        steps = (n - 1) * (2 if op.startswith("all_reduce") else 1)
        return steps / n * size / (gbps * 1e9 / 8) + steps * lat * calls

    def rate(self, dtype: str) -> float:
        """Achievable FLOP/s of one device in ``dtype``."""
        if dtype not in self.peak_tflops:
            raise UsageError(f"cluster {self.name} gives no peak for {dtype} (it has "
                             f"{', '.join(self.peak_tflops)}): choose --precision accordingly")
        return self.peak_tflops[dtype] * 1e12 * self.efficiency

    def peak(self, dtype: str) -> float:
        return self.peak_tflops[dtype] * 1e12

    def ramp(self, dtype: str) -> tuple | None:
        """The matmul ramp a plan in ``dtype`` uses: the cluster's, 16-bit as it was measured or published,
        for a 16-bit plan; None (every matmul at ``efficiency``) otherwise."""
        return self.matmul if dtype in ("bf16", "fp16") else None

    def matmul_efficiency(self, flops: float) -> float:
        """The fraction of the peak a matmul of ``flops`` reaches: ``efficiency`` without a measured ramp
        (``matmul``), else the ramp's, interpolated linearly in log FLOPs between its points and held at
        its first and last beyond them (no extrapolation past what was measured)."""
        pts = self.matmul
        if not pts:
            return self.efficiency
        if flops <= pts[0][0]:
            return pts[0][1]
        if flops >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right(pts, (flops, math.inf))  # past every point of at most ``flops``
        (f0, e0), (f1, e1) = pts[i - 1], pts[i]
        return e0 + (e1 - e0) * math.log(flops / f0) / math.log(f1 / f0)

    def link(self, span_devices: int) -> tuple[float, float]:
        """(Gb/s, latency s) of the groups of ``span_devices`` consecutive ranks (rank r in group r // span):
        inside a node where every such group lies in one, which is where the span divides a node's devices;
        else the network between nodes, which the groups that straddle two nodes wait on (tp 5 on nodes of 8:
        ranks 5-9 are on two)."""
        if self.devices_per_node % span_devices == 0:
            return self.intra_gbps, self.intra_latency_us * 1e-6
        return self.inter_gbps, self.inter_latency_us * 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


_LATENCY = ("latencies are typical small-message figures, assumed (not from a datasheet): 5 us inside a node, "
            "10 us between nodes")
_EFFICIENCY = ("efficiency 0.6 of the dense peak for the matmuls is an assumption (the best-shaped bf16 matmul "
               "reaches 85.9 % of it on an A100 SXM and 80.1 % on an H100 SXM, stas00/ml-engineering's mamf-finder "
               "table; a run's matmuls are smaller and less regular), the elementwise kernels timed at the memory "
               "bandwidth beside them; 20 us of fixed cost per unit forward of a microbatch (kernel launches) is "
               "assumed too")


def gemm_ramp(gemms, peak_tflops: float, ceiling: float) -> tuple:
    """A preset's ``matmul`` ramp from published GEMM figures, ``gemms`` = ((m, n, k, achieved TFLOP/s), ...):
    for each size (``2 m n k`` FLOPs) the median fraction of ``peak_tflops`` its GEMMs reached, ascending,
    until the line through them reaches ``ceiling`` (the one efficiency a run's large matmuls are given,
    where it stops). A matmul is then timed at the smaller of ``ceiling`` and what a GEMM of its size
    reached: a run sustains no more than ``ceiling`` on its large matmuls, and no small one beats the table."""
    sizes: dict[float, list[float]] = {}
    for m, n, k, tflops in gemms:
        sizes.setdefault(2.0 * m * n * k, []).append(tflops / peak_tflops)
    ramp: list[tuple[float, float]] = []
    for f, e in sorted((f, statistics.median(v)) for f, v in sizes.items()):
        if e < ceiling:
            ramp.append((f, e))
            continue
        if ramp:  # where the line in log FLOPs from the last size below the ceiling reaches it
            f0, e0 = ramp[-1]
            ramp.append((math.exp(math.log(f0) + (ceiling - e0) / (e - e0) * math.log(f / f0)), ceiling))
        break
    return tuple(ramp)


#: ``gemm_ramp`` of the OpenXLA authors' sm_90 bf16 GEMM table (docs/data/xla-sm90-bf16-gemm.csv: 125 single
#: GEMMs, m, n, k from 256 to 4096) at the H100's 989.4 TFLOP/s and the presets' 0.6, rounded to 4 digits
#: (tests/test_plan_matmul.py derives it again from the file)
HOPPER_GEMMS = ((3.355e7, 0.0065), (6.711e7, 0.0116), (1.342e8, 0.0221), (2.684e8, 0.0418), (5.369e8, 0.0791),
                (1.074e9, 0.1396), (2.147e9, 0.2195), (4.295e9, 0.3443), (8.59e9, 0.4751), (1.453e10, 0.6))
_HOPPER_RAMP = ("a gpt's weight matmuls at the smaller of the efficiency and what a bf16 GEMM of their size "
                "reached on an sm_90 GPU (the median over its sizes of the OpenXLA authors' published table, "
                "xla/service/gpu/model/matmul_interpolator_data.h, kDefaultMatmulPTable \"sm_90\"; "
                "docs/data/xla-sm90-bf16-gemm.csv): 0.0065 of the peak at 34 MFLOP, 0.22 at 2.1 GFLOP, "
                "0.48 at 8.6 GFLOP, the efficiency from 14.5 GFLOP up")

PRESETS: dict[str, Cluster] = {c.name: c for c in (
    Cluster("a100-sxm-datasheet", {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}, 80, 2039, 8,
            intra_gbps=2400, intra_latency_us=5, inter_gbps=200, inter_latency_us=10, efficiency=0.6, unit_overhead_us=20,
            source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS "
                   "dense, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s = 300 GB/s each way), "
                   "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; NVIDIA DGX A100 datasheet (8 GPUs, "
                   "8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute: one per GPU); "
                   f"{_LATENCY}; {_EFFICIENCY}"),
    Cluster("h100-sxm", {"fp32": 67.0, "bf16": 989.4, "fp16": 989.4}, 80, 3350, 8,
            intra_gbps=3600, intra_latency_us=5, inter_gbps=400, inter_latency_us=10, efficiency=0.6, unit_overhead_us=20,
            source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: FP32 67 TFLOPS, BF16/FP16 989 TFLOPS dense "
                   "(1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s = 450 GB/s each way), "
                   "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet; NVIDIA DGX "
                   "H100 datasheet (8 GPUs, 8 ConnectX-7 400 Gb/s InfiniBand/Ethernet: one per GPU); "
                   f"{_LATENCY}; {_EFFICIENCY}; {_HOPPER_RAMP}", matmul=HOPPER_GEMMS),
    Cluster("h200", {"fp32": 67.0, "bf16": 989.4, "fp16": 989.4}, 141, 4800, 8,
            intra_gbps=3600, intra_latency_us=5, inter_gbps=400, inter_latency_us=10, efficiency=0.6, unit_overhead_us=20,
            source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: the H100's compute, FP32 67 TFLOPS, "
                   "BF16/FP16 989 TFLOPS dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s), "
                   "https://www.nvidia.com/en-us/data-center/h200/; NVIDIA DGX H200 datasheet (8 GPUs, "
                   "8 ConnectX-7 400 Gb/s); " f"{_LATENCY}; {_EFFICIENCY}; {_HOPPER_RAMP}", matmul=HOPPER_GEMMS),
    Cluster("cpu", {"fp32": 0.08}, 4, 20, 2,
            intra_gbps=40, intra_latency_us=20, inter_gbps=10, inter_latency_us=50, efficiency=0.5,
            unit_overhead_us=50,
            source="one x86 core per worker: AMD Zen 2/3 cores retire two 256-bit FMAs a cycle, 32 fp32 FLOP/cycle "
                   "(AMD Software Optimization Guide for AMD Family 17h/19h Processors), x 2.5 GHz = 80 GFLOP/s; "
                   "4 GB and 20 GB/s of DRAM per worker, 2 workers a node, 10 Gb/s Ethernet between nodes "
                   "(IEEE 802.3ae 10GBASE) and loopback at 40 Gb/s inside one: assumed, a plain CPU node, not "
                   "a datasheet; efficiency 0.5 and 50 us per unit forward (dispatch) assumed"),
)}
#: the a100-sxm preset: the datasheet's node with the cost model's free parameters fitted to 1,440 measured runs
#: (``paralab measured --fit``, analysis/measured.py; the figures and how they were found: docs/plan.md)
FITTED = Path(__file__).resolve().parents[1] / "data"
# nodes that differ from one above in their memory or their links alone: only what differs is written
PRESETS["h800"] = replace(
    PRESETS["h100-sxm"], name="h800", intra_gbps=1600,
    source="NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5: the H100 SXM's compute, FP32 67 TFLOPS, "
           "BF16/FP16 989 TFLOPS dense, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s = 200 GB/s each way), "
           "https://www.nvidia.cn/data-center/h800/; 8 GPUs a node with a 400 Gb/s NIC each, as DGX H100 "
           f"(DeepSeek-V3's report, arXiv 2412.19437, describes its H800 nodes so); {_LATENCY}; {_EFFICIENCY}; "
           f"{_HOPPER_RAMP}")

#: the fields a cluster file must give (``name`` defaults to the file's stem; the others have defaults)
REQUIRED = tuple(f.name for f in fields(Cluster) if f.default is MISSING and f.name != "name")


#: what each number of a cluster file must be (every field but ``name``, ``source``, ``peak_tflops`` and
#: ``collectives``, which :func:`load_cluster` checks apart)
RANGES = {"memory_gb": "positive", "memory_gbs": "positive", "intra_gbps": "positive", "inter_gbps": "positive",
          "efficiency": "fraction", "usable_fraction": "fraction", "intra_latency_us": "non-negative",
          "inter_latency_us": "non-negative", "unit_overhead_us": "non-negative", "launch_us": "non-negative",
          "p2p_overhead_us": "non-negative",
          "crowding": "non-negative", "devices_per_node": "a positive integer"}


def load_cluster(path: str) -> Cluster:
    """A cluster from a JSON or TOML file (by its suffix; ``name`` defaults to the file's stem).
    UsageError naming the field for a missing, unknown (with the nearest known name) or invalid one: every
    number finite and in its range (:data:`RANGES`), so no plan is ever printed from a NaN or a negative time."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--cluster {path}: no such file, and not a preset ({', '.join(names())})")
    kind = "TOML" if p.suffix == ".toml" else "JSON"
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text, parse_constant=lambda c: float(c))  # NaN/Infinity: refused below, by name
    except UnicodeDecodeError:
        raise UsageError(f"--cluster {path}: not a text file (a {kind} cluster file is text; docs/plan.md)") from None
    except ValueError as exc:
        raise UsageError(f"--cluster {path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--cluster {path}: expected a table of fields, got {type(data).__name__}")
    data.setdefault("name", p.stem)
    known = [f.name for f in fields(Cluster)]
    for k in data:
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            raise UsageError(f"--cluster {path}: unknown field {k!r}" + (f" (did you mean {near[0]!r}?)" if near
                             else f"; the fields are {', '.join(known)}"))
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise UsageError(f"--cluster {path}: missing field(s) {', '.join(missing)} (every cluster file gives "
                         f"{', '.join(REQUIRED)}; see docs/plan.md)")
    for k in ("name", "source"):
        if not isinstance(data[k], str):
            raise UsageError(f"--cluster {path}: {k} must be a string (got {data[k]!r})")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks or any(k not in DTYPES for k in peaks):
        raise UsageError(f"--cluster {path}: peak_tflops must map dtypes ({', '.join(DTYPES)}) to TFLOP/s")
    for d, v in peaks.items():
        check_number(path, f"peak_tflops.{d}", v, "positive")
    for k, rule in RANGES.items():
        if k in data:
            check_number(path, k, data[k], rule)
    if not isinstance(data.get("elementwise", True), bool):
        raise UsageError(f"--cluster {path}: elementwise must be true or false (got {data['elementwise']!r})")
    ramp = data.get("matmul")
    if ramp is not None:
        if not (isinstance(ramp, list) and ramp and all(isinstance(pt, list) and len(pt) == 2 and number(pt[0])
                                                        and pt[0] > 0 and number(pt[1]) and 0 < pt[1] <= 1
                                                        for pt in ramp)
                and all(a[0] < b[0] for a, b in zip(ramp, ramp[1:]))):
            raise UsageError(f"--cluster {path}: matmul must be [[FLOPs, fraction of the peak], ...], FLOPs positive "
                             "and ascending, each fraction in (0, 1] (bench/matmul.py prints it for a device)")
        data["matmul"] = tuple((float(f), float(e)) for f, e in ramp)
    coll = data.get("collectives")
    if coll is not None and not (isinstance(coll, dict) and all(isinstance(by, dict) and all(
            isinstance(pts, list) and pts and all(isinstance(pt, list) and len(pt) == 2 and all(
                number(x) and x >= 0 for x in pt) for pt in pts) for pts in by.values())
            for by in coll.values())):
        raise UsageError(f"--cluster {path}: collectives must map an operation to {{group size: [[bytes, "
                         f"seconds], ...]}} in ascending bytes (as bench/plan.py measures them)")
    return Cluster(**data)


def number(v) -> bool:
    """A finite int or float (not a bool, not a string)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_number(path: str, field: str, v, rule: str) -> None:
    ok = number(v) and {"positive": lambda: v > 0, "non-negative": lambda: v >= 0, "fraction": lambda: 0 < v <= 1,
                        "a positive integer": lambda: isinstance(v, int) and v >= 1}[rule]()
    if not ok:
        what = {"positive": "a positive number", "non-negative": "a number, zero or more",
                "fraction": "a fraction in (0, 1]"}.get(rule, rule)
        raise UsageError(f"--cluster {path}: {field} must be {what} (got {v!r})")


PRESETS["a100-sxm"] = load_cluster(str(FITTED / "a100-sxm.json"))
PRESETS["a100-40gb"] = replace(
    PRESETS["a100-sxm"], name="a100-40gb", memory_gb=40, memory_gbs=PRESETS["a100-sxm"].memory_gbs * 1555 / 2039,
    source="the a100-sxm preset (fitted to measured A100 80GB runs) with the A100 40GB SXM's memory: 40 GB of HBM2 "
           "at 1,555 GB/s where the 80GB's HBM2e moves 2,039 GB/s (NVIDIA A100 Tensor Core GPU datasheet, "
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
           "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): the fitted memory bandwidth scaled by their ratio")


def names() -> list[str]:
    return [*PRESETS, "this-machine"]
