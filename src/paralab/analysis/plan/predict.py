"""One layout's predicted step: compute, communication (what is exposed), bubble, memory.

Per step on the busiest device (all times in seconds):

- **compute**: each stage's forward of one microbatch is its units' FLOPs
  x b / tp at the cluster's achievable rate, plus the cluster's fixed cost
  per unit (launches: what makes tiny microbatches slow); its backward twice that, plus
  what recomputation runs again (``Workload.recompute_flops``).
- **tensor parallelism** (synchronous in paralab, in every layer's critical
  path): per block two activation all-reduces forward and two backward
  (``b s h e`` bytes, ring over the tp group; sequence parallelism's
  all-gather + reduce-scatter move the same bytes), one more at each end;
  full recomputation repeats the forward's two. Added to the stage's times.
- **context parallelism** (``cp`` ranks each hold ``s / cp`` tokens: the
  compute, the activations and the tp and pp messages divide by cp): the
  messages of ``analysis/context.py``; the ring's sends go out while the
  block's attention computes, so only what outlasts it is exposed;
  Ulysses's all-to-alls are synchronous. Gradients are averaged over dp x cp.
- **pipeline**: the schedule is run by the simulator
  (``strategies/pipeline/simulate.py``) on these per-stage times, with each
  boundary transfer (``b s h e`` bytes, ``/ tp`` under sequence parallelism)
  as its message delay: paralab's executor sends without blocking and posts
  its receives ahead, so a transfer only delays the receiver. ``bubble`` is
  the makespan less the busiest rank's work at free transfers, ``pp comm``
  what the transfers add on top.
- **data parallelism** (after the last microbatch, per paralab's flavours):
  ddp's buckets all-reduce during the last microbatch's backward, so only
  what outlasts it (and at least the last bucket) is exposed; ZeRO-1
  reduce-scatters after backward and all-gathers after the step (fsdp:
  asynchronously, hidden by the next forward; the pipeline flavour
  synchronously); ZeRO-2 reduce-scatters each unit in backward
  (synchronously) and all-gathers like ZeRO-1; ZeRO-3 gathers each unit one
  unit ahead in forward and backward (hidden by the unit's compute when
  shorter) and reduce-scatters in backward (exposed).
- **optimizer**: memory-bound: the device's model states read and written
  once at the device's memory bandwidth.
- **memory** (busiest device): model states from ``analysis/memory.py``
  (the stage's parameters over ``tp``, sharded over ``dp`` at the ZeRO stage;
  the working set of the rank's largest unit, its flat gradient copy at
  ZeRO-1; fsdp's step in backward at stages 2-3), plus each
  stage's activations for one microbatch x the schedule's peak microbatches
  alive on that rank (registry), one microbatch without a pipeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from ...strategies.pipeline.schedules import build_schedule, spec_of
from ...strategies.pipeline.simulate import simulate
from ..memory import memory_per_worker
from .cluster import Cluster
from .layouts import Layout
from .workload import Workload

BUCKET_BYTES = 25 * 2 ** 20  # ddp's default --bucket-mb
FIRST_BUCKET = 2 ** 20       # ddp's first bucket closes at 1 MiB


@dataclass(frozen=True)
class Setting:
    """What a plan holds fixed for every layout."""
    global_batch: int
    precision: str = "mixed"       # fp32 | mixed (16-bit parameters, gradients, activations; fp32 optimizer)
    optimizer: str = "adam"

    @property
    def dtype(self) -> str:
        return "bf16" if self.precision == "mixed" else "fp32"

    @property
    def element(self) -> int:
        return 2 if self.precision == "mixed" else 4


@dataclass
class Prediction:
    layout: Layout
    step: float
    compute: float            # busiest rank's arithmetic
    tp_comm: float            # tensor-parallel collectives (exposed: all of them)
    bubble: float             # pipeline idle at free transfers
    pp_comm: float            # what point-to-point transfers add to the pipeline
    dp_comm: float            # data-parallel communication left exposed
    dp_total: float           # data-parallel communication in flight
    optimizer: float
    memory: float             # peak bytes on the busiest device
    memory_parts: dict = field(default_factory=dict)
    fits: bool = True
    simulated: bool = False   # bubble from the simulator (else the schedule's closed form, for the shortlist)
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    notes: list = field(default_factory=list)
    cp_comm: float = 0.0      # context-parallel messages left exposed (the ring's hidden behind attention)
    memory_by_rank: list = field(default_factory=list)  # per pipeline rank: (model states, activations) bytes

    def to_dict(self) -> dict:
        keys = ("step", "compute", "tp_comm", "cp_comm", "bubble", "pp_comm", "dp_comm", "dp_total", "optimizer", "memory",
                "fits", "simulated", "mfu", "tokens_per_s", "samples_per_s")
        return {"layout": self.layout.to_dict(), **{k: getattr(self, k) for k in keys},
                "memory_parts": self.memory_parts, "notes": self.notes}


def ring(size: float, n: int, link: tuple[float, float], half: bool = False, calls: int = 1) -> float:
    """Ring all-reduce time of ``size`` bytes over ``n`` ranks (``half``: a reduce-scatter or an all-gather)."""
    if n <= 1:
        return 0.0
    gbps, lat = link
    steps = (n - 1) * (1 if half else 2)
    return steps / n * size / (gbps * 1e9 / 8) + steps * lat * calls


def stage_of_rank(layout: Layout) -> list[list[int]]:
    """The stages each pipeline rank holds (one, or v interleaved: stage s on rank s mod p)."""
    p, v = layout.pp, layout.virtual
    return [[s for s in range(p * v) if s % p == r] for r in range(p)]


def predict(work: Workload, lay: Layout, cluster: Cluster, setting: Setting, simulate_pipeline: bool = True,
            cut: list[tuple[int, int]] | None = None) -> Prediction:
    """``lay``'s predicted step and memory (``cut``: the stages' units, where a run chose its own)."""
    e, rate = setting.element, cluster.rate(setting.dtype)
    t, p, v, d, b, m = lay.tp, lay.pp, lay.virtual, lay.dp, lay.microbatch, lay.microbatches
    C = lay.cp  # the gradients are averaged over dp x cp (the dpcp group)
    stages = [tuple(c) for c in cut] if cut is not None else work.cut(p * v)
    if isinstance(stages, str):
        raise ValueError(stages)
    tp_link = cluster.link(t)
    cp_link = cluster.link(t * C)
    dp_link = cluster.link(t * C * d)
    pp_link = cluster.link(t * C * d * p)
    notes = []
    # ---------------------------------------------------------------- per-stage times
    fwd, bwd, tpc, cpc = [], [], [], []  # tpc: a stage's tp and cp communication per microbatch; cpc: the cp part
    s_tok = work.tokens_per_sample
    act_msg = b * s_tok * work.shape.get("embed", 0) * e / C  # a rank's tokens
    overhead = cluster.unit_overhead_us * 1e-6
    for lo, hi in stages:
        f = b * sum(u.forward_flops for u in work.units[lo:hi]) / (t * C) / rate + overhead * (hi - lo)
        extra = work.recompute_flops(lo, hi, b, lay.recompute) / (t * C) / rate
        blocks = sum(1 for u in work.units[lo:hi] if u.name == "block")
        comm = 0.0
        if t > 1:
            ends = (lo == 0) + (hi == len(work.units))
            per = ring(act_msg, t, tp_link)
            comm = (4 * blocks + 2 * ends + (2 * blocks if lay.recompute == "full" else 0)) * per
        cp = blocks * cp_exposed(work, lay, b, e, cp_link, rate) if C > 1 else 0.0
        fwd.append(f)
        bwd.append(2 * f + extra)
        tpc.append(comm + cp)
        cpc.append(cp)
    ranks = stage_of_rank(lay)
    busy = [sum(m * (fwd[s] + bwd[s] + tpc[s]) for s in held) for held in ranks]
    r_max = max(range(p), key=lambda r: busy[r])
    compute = sum(m * (fwd[s] + bwd[s]) for s in ranks[r_max])
    cp_comm = sum(m * cpc[s] for s in ranks[r_max])
    tp_comm = sum(m * tpc[s] for s in ranks[r_max]) - cp_comm
    # ---------------------------------------------------------------- pipeline
    bubble = pp_comm = 0.0
    simulated = False
    if p > 1:
        boundary = max(work.units[hi - 1].output_elements for lo, hi in stages[:-1]) * b * e / (t if lay.sp else 1) / C
        gbps, lat = pp_link
        transfer = boundary / (gbps * 1e9 / 8) + lat
        F = [fwd[s] + tpc[s] / 2 for s in range(p * v)]
        B = [bwd[s] + tpc[s] / 2 for s in range(p * v)]
        spec = spec_of(lay.schedule)
        if simulate_pipeline:
            free = makespan(lay.schedule, p, m, v, tuple(F), tuple(B), 0.0)
            real = makespan(lay.schedule, p, m, v, tuple(F), tuple(B), transfer)
            simulated = True
        else:  # the closed form on the slowest rank's times: only to shortlist
            f_r = max(sum(F[s] for s in held) for held in ranks)
            b_r = max(sum(B[s] for s in held) for held in ranks)
            free = m * (f_r + b_r) + spec.idle.value(p, v, f_r, b_r / 2, b_r / 2)
            real = free + 2 * (p - 1) * transfer
        bubble = max(free - busy[r_max], 0.0)
        pp_comm = max(real - free, 0.0)
        pipe = real
    else:
        pipe = busy[0]
    # ---------------------------------------------------------------- data parallelism
    stage_params = [sum(work.units[i].parameters for s in held for i in range(*stages[s])) for held in ranks]
    local = stage_params[r_max] / t
    grad_bytes = local * e
    dp_total = dp_exposed = 0.0
    last_backward = sum(bwd[s] + tpc[s] / 2 for s in ranks[r_max])
    first_forward = sum(fwd[s] + tpc[s] / 2 for s in ranks[r_max])
    units_with_params = sum(1 for s in ranks[r_max] for i in range(*stages[s]) if work.units[i].parameters)
    R = lay.replicate  # HSDP: shards over d / R, the shard all-reduced over R
    if d * C > 1:
        d_all = d * C  # the ranks that average each gradient
        if R > 1:
            S = d // R
            shard_link = cluster.link(t * S)
            rs = ring(grad_bytes, S, shard_link, half=True, calls=units_with_params)
            ag = ring(local * e, S, shard_link, half=True, calls=units_with_params)
            across = ring(grad_bytes / S, R, dp_link, calls=units_with_params)
            gathers = 2 * ag if lay.zero == 3 and p == 1 else ag
            dp_total = rs + across + gathers
            dp_exposed = rs + across + (max(ag - first_forward, 0.0) if p == 1 and t == 1 else ag)
        elif lay.zero == 0:
            # ddp closes its first bucket at 1 MiB, the others at --bucket-mb; the last one launched (the first
            # units' gradients) cannot overlap anything
            buckets = 1 + math.ceil(max(grad_bytes - FIRST_BUCKET, 0) / BUCKET_BYTES)
            dp_total = ring(grad_bytes, d_all, dp_link, calls=buckets)
            dp_exposed = max(dp_total - last_backward, dp_total / buckets)
        else:
            rs = ring(grad_bytes, d_all, dp_link, half=True, calls=units_with_params)
            ag = ring(local * e, d_all, dp_link, half=True, calls=units_with_params)
            if lay.zero == 3 and p == 1:  # under a pipeline the stage is gathered once per step
                dp_total = 2 * ag + rs
                dp_exposed = rs + max(ag - first_forward, 0.0) + max(ag - last_backward, 0.0)
            else:
                dp_total = rs + ag
                hidden_gather = p == 1 and (lay.zero == 2 or t == 1 and C == 1)  # fsdp's asynchronous all-gather
                dp_exposed = rs + (max(ag - first_forward, 0.0) if hidden_gather else ag)
    # ---------------------------------------------------------------- memory and optimizer
    def states_of(r: int):  # the working set is that of the rank's own largest unit
        unit_max = max((work.units[i].parameters for s in ranks[r] for i in range(*stages[s])), default=0)
        return model_states(stage_params[r], d * C // R, lay.zero, p > 1, setting.optimizer, setting.precision,
                            unit_max, t, e, m)
    est = states_of(r_max)[0]
    optimizer = 2 * est.total / (cluster.memory_gbs * 1e9)
    alive = spec_of(lay.schedule).alive(p, m, v) if p > 1 else [1]
    acts = []
    for r, held in enumerate(ranks):
        per_mb = sum(work.activation_bytes(*stages[s], b, t, lay.sp, lay.recompute, e) for s in held) / len(held) / C
        acts.append(per_mb * alive[r])
    # the busiest device for memory: model states of its stages + its activations
    mem_by_rank = []
    for r in range(p):
        states = states_of(r)[1]
        if lay.zero == 0:  # ddp's buckets: a flat copy of the rank's gradients, kept between steps
            states += stage_params[r] / t * e
        mem_by_rank.append((states + acts[r], states, acts[r], r))
    memory, states, activations, r_mem = max(mem_by_rank)
    step = pipe + dp_exposed + optimizer
    gb = setting.global_batch
    tokens = gb * work.tokens_per_sample
    workers = d * t * p * C
    mfu = gb * work.model_flops_per_sample() / step / (workers * cluster.peak(setting.dtype))
    return Prediction(lay, step, compute, tp_comm, bubble, pp_comm, dp_exposed, dp_total, optimizer, memory,
                      {"model_states": states, "activations": activations, "rank": r_mem,
                       "model_states_formula": est.total_formula.formula + (" + ddp's gradient buckets (Psi)"
                                                                            if lay.zero == 0 else "")},
                      fits=memory <= cluster.memory_gb * 1e9 * cluster.usable_fraction, simulated=simulated,
                      mfu=mfu, tokens_per_s=tokens / step, samples_per_s=gb / step, notes=notes, cp_comm=cp_comm,
                      memory_by_rank=[(st, a) for _, st, a, _ in mem_by_rank])


@lru_cache(maxsize=2 ** 16)
def model_states(params: int, shards: int, zero: int, pipelined: bool, optimizer: str, precision: str,
                 unit_max: int, t: int, e: int, microbatches: int = 2):
    """(estimate, peak bytes) of ``params``' model states on a rank, over the ``shards`` ranks that shard
    them (HSDP: a shard group). Under a pipeline ZeRO-2/3 accumulate whole gradients over the microbatches
    and ZeRO-3 holds the stage gathered for the step, so their peak is ZeRO-1's (plus ZeRO-3's own
    shard); with one microbatch its backward is the step's last, each unit's gradient reduced in it as it
    completes: ZeRO-2's peak, stepped after backward (plus ZeRO-3's shard). Cached: a search asks for the
    same stages many times."""
    stage = (min(zero, 1) if microbatches > 1 else min(zero, 2)) if pipelined else zero
    est = memory_per_worker(params, shards, stage, optimizer, precision, unit_parameters=unit_max if stage else None,
                            step_in_backward=stage >= 2 and not pipelined, model_parallel=t)
    shard = params / t / shards * e if pipelined and zero == 3 else 0.0
    return est, est.peak + shard


def cp_exposed(work: Workload, lay: Layout, b: int, e: int, link: tuple[float, float], rate: float) -> float:
    """One block's context-parallel communication left exposed per microbatch (forward + backward), from
    ``analysis/context.py``'s messages: the ring's sends go out while the block's attention computes (each
    hop overlaps one chunk's scores), Ulysses's all-to-alls are synchronous."""
    from ..context import cp_messages
    sh, C = work.shape, lay.cp
    msgs = cp_messages(b, sh["context"], sh["embed"], 1, C, lay.cp_method, lay.tp, e)
    gbps, lat = link
    if lay.cp_method == "ring":
        sends = sum(n for n, _ in msgs.values())
        kv = next(iter(msgs.values()))[1] / max(next(iter(msgs.values()))[0], 1)
        attention = 3 * 4.0 * sh["context"] ** 2 * sh["embed"] * b / (lay.tp * C) / rate  # forward + backward
        return max(sends * (kv / (gbps * 1e9 / 8) + lat) - attention, 0.0)
    return sum(calls * ((C - 1) / C * size / calls / (gbps * 1e9 / 8) + (C - 1) * lat)
               for calls, size in msgs.values())


@lru_cache(maxsize=64)
def _schedule(name: str, p: int, m: int, v: int):
    return build_schedule(name, p, m, v)


@lru_cache(maxsize=4096)
def makespan(name: str, p: int, m: int, v: int, F: tuple, B: tuple, transfer: float) -> float:
    """The simulated step of schedule ``name`` at per-stage forward and backward times ``F``, ``B`` (a
    zero-bubble schedule's backward split evenly into I and W), each transfer taking ``transfer`` seconds.
    Layouts that differ only outside the pipeline (ZeRO stage, data parallelism) share one simulation."""
    kw = dict(input_time=[x / 2 for x in B], weight_time=[x / 2 for x in B]) if spec_of(name).split_backward else {}
    timeline = simulate(_schedule(name, p, m, v), list(F), list(B), transfer, check=False, **kw)
    return max((x.t1 for row in timeline for x in row), default=0.0)
