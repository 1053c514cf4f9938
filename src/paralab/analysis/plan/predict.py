"""One layout's predicted step: compute, communication (what is exposed), bubble, memory.

Per step on the busiest device (all times in seconds):

- **compute**: each stage's forward of one microbatch is its units' FLOPs
  x b / tp at the cluster's achievable rate (where a cluster file gives a
  matmul ramp measured on the device, each weight matmul at the fraction of
  the peak its size reached: :func:`arithmetic_seconds`), plus, on a preset or a cluster
  file, the bytes its blocks' elementwise kernels move at the device's
  memory bandwidth (``workload.block_elementwise``: LayerNorms, residual
  adds, the MLP's activation, eager attention's softmax and dropout; a
  measured ``this-machine`` rate holds them already), plus the cluster's
  fixed cost per unit (launches: what makes tiny microbatches slow); its
  backward twice that, plus what recomputation runs again
  (``Workload.recompute_flops``, and the elementwise bytes it moves again).
  On a device that runs kernels behind its host (``launch_us``: a GPU
  fed by Python), a pass takes at least the host's time to launch it, its
  tp collectives included: a unit's forward ``launch_us``, its backward
  twice that, a full recomputation's forward once more. Small microbatches
  are bound by it (docs/plan.md, "Calibrated on measured runs").
- **tensor parallelism** (synchronous in paralab, in every layer's critical
  path): per block two activation all-reduces forward and two backward
  (``b s h e`` bytes, ring over the tp group; sequence parallelism's
  all-gather + reduce-scatter move the same bytes), one more at each end;
  full recomputation repeats the forward's two. Added to the stage's times.
- **context parallelism** (``cp`` ranks each hold ``s / cp`` tokens: the
  compute, the activations and the tp and pp messages divide by cp): the
  messages of ``analysis/context.py``; the ring's sends go out while the
  block's attention computes, so only what outlasts it is exposed, with
  each send's and receive's processor time (``p2p_overhead_us``);
  Ulysses's all-to-alls are synchronous. Gradients are averaged over dp x cp.
- **pipeline**: the schedule is run by the simulator
  (``strategies/pipeline/simulate.py``) on these per-stage times, with each
  boundary transfer (``b s h e`` bytes, ``/ tp`` under sequence parallelism)
  as its message delay: paralab's executor sends without blocking and posts
  its receives ahead, so a transfer only delays the receiver, but a
  sender's link carries one message at a time (its bytes over the link's
  bandwidth: the next waits for it). Each send and
  receive also costs its rank the cluster's ``p2p_overhead_us`` of
  processor (the executor's work around a transfer; measured on
  ``this-machine``, 0 for presets). ``bubble`` is the makespan less the
  busiest rank's work at free transfers, ``pp comm`` what the transfers and
  their processor time add on top. A zero-bubble schedule's split backward
  costs 1.5 whole ones (:func:`split_backward`: ``W`` walks the activation
  gradients again). Tied embeddings add one all-reduce to ``pp comm``:
  the last stage's copy of the token table (``V h / tp``) with the first
  stage's, after the pipeline drains, every step (Megatron-LM's embedding
  group).
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
- **expert parallelism** (a mixture of experts under ``--ep``, functions at
  the end): each MoE layer's token all-to-alls, synchronous, in the stage's
  time; the experts' gradients over edp = dp / ep; their states over ep.
- **memory** (busiest device): model states from ``analysis/memory.py``
  (the stage's parameters over ``tp``, sharded over ``dp`` at the ZeRO stage;
  the working set of the rank's largest unit, its flat gradient copy at
  ZeRO-1; fsdp's step in backward at stages 2-3), plus each
  stage's activations for one microbatch x the schedule's peak microbatches
  alive on that rank (registry), one microbatch without a pipeline, plus,
  under recomputation, what one recomputed block holds from its
  recomputation through its backward (``Workload.recompute_transient``: at
  long context, eager attention's s x s scores).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from ...strategies.pipeline.schedules import build_schedule, spec_of
from ...strategies.pipeline.simulate import finish_times
from ..memory import memory_per_worker
from .cluster import Cluster
from .layouts import Layout
from .shared_cores import simulate_shared
from .workload import Workload

BUCKET_BYTES = 25 * 2 ** 20  # ddp's default --bucket-mb
FIRST_BUCKET = 2 ** 20       # ddp's first bucket closes at 1 MiB
REWALK = 0.5                 # a split backward's W walks the activation gradients again: 1.5 whole backwards


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
    bounded: bool = False     # the first pass's pipeline is a lower bound: no closed form holds (make_plan
    #                           shortlists these apart)
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    notes: list = field(default_factory=list)
    cp_comm: float = 0.0      # context-parallel messages left exposed (the ring's hidden behind attention)
    ep_comm: float = 0.0      # expert parallelism's token all-to-alls (synchronous)
    memory_by_rank: list = field(default_factory=list)  # per pipeline rank: (model states, activations) bytes

    def to_dict(self) -> dict:
        keys = ("step", "compute", "tp_comm", "cp_comm", "ep_comm", "bubble", "pp_comm", "dp_comm", "dp_total", "optimizer", "memory",
                "fits", "simulated", "mfu", "tokens_per_s", "samples_per_s")
        return {"layout": self.layout.to_dict(), **{k: getattr(self, k) for k in keys},
                "memory_parts": self.memory_parts, "notes": self.notes}


def buckets_of(grad_bytes: float) -> list[tuple[int, float]]:
    """ddp's buckets in launch order (backward fills them from the last layer) as (count, bytes) runs: the
    first closes at 1 MiB, the next ones at --bucket-mb, the last holds what is left."""
    first = min(FIRST_BUCKET, grad_bytes)
    full, rest = divmod(max(grad_bytes - first, 0.0), BUCKET_BYTES)
    return [(n, size) for n, size in ((1, first), (int(full), BUCKET_BYTES), (1, rest)) if n and size > 0]


def ddp_exposed(runs: list[tuple[int, float]], seconds: list[float], backward: float) -> float:
    """What ddp's all-reduces add after the last microbatch's backward (``backward`` seconds, its gradients
    ready at an even pace), each bucket starting when it is full and the one before it is done: the last
    ends at the latest of (a bucket ready + its own and every later bucket's time), which within a run of
    equal buckets is reached at one of its ends."""
    total = sum(n * size for n, size in runs)
    end, before = 0.0, 0.0
    for k, (n, size) in enumerate(runs):
        after = sum(m * t for (m, _), t in zip(runs[k + 1:], seconds[k + 1:]))
        for j in {0, n - 1}:
            end = max(end, backward * (before + (j + 1) * size) / total + (n - j) * seconds[k] + after)
        before += n * size
    return max(end - backward, 0.0)


def stage_of_rank(layout: Layout) -> list[list[int]]:
    """The stages each pipeline rank holds (one, or v interleaved: stage s on rank s mod p)."""
    p, v = layout.pp, layout.virtual
    return [list(range(r, p * v, p)) for r in range(p)]


def predict(work: Workload, lay: Layout, cluster: Cluster, setting: Setting, simulate_pipeline: bool = True,
            cut: list[tuple[int, int]] | None = None, memo: dict | None = None) -> Prediction:
    """``lay``'s predicted step and memory (``cut``: the stages' units, where a run chose its own).

    ``memo``: a dict a caller keeps across layouts of one workload, cluster and setting (a search's first
    pass): layouts that differ only in ZeRO stage and HSDP replication share their stages and pipeline
    (:class:`Pipeline`), worked out once."""
    if memo is None or cut is not None:
        pipeline = _pipeline(work, lay, cluster, setting, simulate_pipeline, cut)
    else:
        key = (replace(lay, zero=0, replicate=1), simulate_pipeline)
        pipeline = memo.get(key)
        if pipeline is None:
            pipeline = memo[key] = _pipeline(work, lay, cluster, setting, simulate_pipeline, cut)
    return _with_data_parallelism(work, lay, cluster, setting, pipeline)


@dataclass
class Pipeline:
    """What a layout's stages and schedule give, whatever its ZeRO stage and HSDP replication: the busiest
    pipeline rank's times over the step, the pipeline's makespan, and what each rank holds."""
    stages: list              # (first unit, end) of each stage
    ranks: list               # the stages each pipeline rank holds
    kinds: list               # per rank: the kind of its stages (alike ranks: alike work and memory)
    first: dict               # one rank of each kind
    r_max: int                # the busiest pipeline rank
    compute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    bubble: float
    pp_comm: float
    pipe: float               # the pipeline's step: makespan with transfers (the busiest rank's work at p = 1)
    simulated: bool
    bounded: bool
    stage_params: list        # per rank: the parameters of its stages
    moe_held: list | None     # per rank, a mixture of experts': (the rest, experts) held
    units_of: list            # per rank: its units with parameters
    acts: list                # per rank: activation bytes at its peak (per microbatch x alive + transient)
    last_backward: float      # the busiest rank's last microbatch's backward (what ddp's buckets overlap)
    first_forward: float      # and its first forward (what fsdp's asynchronous all-gather hides behind)


def _pipeline(work: Workload, lay: Layout, cluster: Cluster, setting: Setting, simulate_pipeline: bool,
              cut: list[tuple[int, int]] | None) -> Pipeline:
    """``lay``'s stages timed, and its pipeline scheduled (the per-stage times, pipeline and activations
    sections of the module docstring)."""
    e, rate = setting.element, cluster.rate(setting.dtype)
    t, p, v, d, b, m = lay.tp, lay.pp, lay.virtual, lay.dp, lay.microbatch, lay.microbatches
    C = lay.cp
    stages = [tuple(c) for c in cut] if cut is not None else work.cut(p * v)
    if isinstance(stages, str):
        raise ValueError(stages)
    tp_link = cluster.link(t)
    cp_link = cluster.link(t * C)
    pp_link = cluster.link(t * C * d * p)
    # ---------------------------------------------------------------- per-stage times
    fwd, bwd, tpc, cpc, epc = [], [], [], [], []  # tpc: a stage's tp, cp and ep communication per microbatch
    s_tok = work.tokens_per_sample
    act_msg = b * s_tok * work.shape.get("embed", 0) * e / C  # a rank's tokens
    overhead = cluster.unit_overhead_us * 1e-6
    per = 0.0  # one tp collective point (an all-reduce, or sp's all-gather + reduce-scatter)
    if t > 1:
        per = (cluster.collective("all_gather", act_msg, t, tp_link)
               + cluster.collective("reduce_scatter", act_msg, t, tp_link)) if lay.sp else \
            cluster.collective("all_reduce", act_msg, t, tp_link)
    split = p > 1 and spec_of(lay.schedule).split_backward  # zero bubble: I, then W walks the units again
    cp_block = cp_exposed(work, lay, b, e, cp_link, cluster, rate, split) if C > 1 else 0.0
    ep_block = ep_exposed(work, lay, b, e, cluster, cluster.link(t * lay.ep), split) if lay.ep > 1 else 0.0
    bandwidth = cluster.memory_gbs * 1e9  # the elementwise kernels' bytes move at it (0: in the measured rate)
    def stage_times(lo: int, hi: int) -> tuple[float, float, float, float, float]:
        """Units ``lo..hi-1``' forward and backward of one microbatch, and their tp, cp and ep communication."""
        moved, scores = work.elementwise_bytes(lo, hi, t, C, lay.sp, e) if cluster.elementwise else (0.0, 0.0)
        flops = b * work.rank_flops(lo, hi, t, C)
        arithmetic = arithmetic_seconds(work, cluster, lo, hi, t, C, b, flops, rate, setting.dtype)
        f = arithmetic + b * moved / bandwidth + overhead * (hi - lo)
        again = {"full": moved, "selective": scores}.get(lay.recompute, 0.0)
        per_flop = arithmetic / flops if lay.recompute == "full" and flops else 1 / rate  # full: the forward again
        extra = work.recompute_flops(lo, hi, b, lay.recompute) / (t * C) * per_flop + b * again / bandwidth
        blocks = work.blocks_in(lo, hi)
        comm = 0.0
        if t > 1:
            ends = (lo == 0) + (hi == len(work.units))
            comm = (work.tp_collectives(blocks) + 2 * ends + (2 * blocks if lay.recompute == "full" else 0)) * per
            if lay.sp:  # replicated parameters applied to a rank's tokens only: their gradients summed
                comm += replicated_sums(work, lo, hi, cluster, t, tp_link, e)
        cp, ep = blocks * cp_block, blocks * ep_block
        # the host launches a pass's kernels ahead of the device (launch_us a unit's forward; its backward
        # twice that, and a full recomputation's forward once more): the device, busy or waiting for them,
        # spends at least that long on the pass, its collectives included
        launch = cluster.launch_us * 1e-6 * (hi - lo)
        back = max(2 * f + extra, launch * (2 + (lay.recompute == "full")) - comm / 2)
        f = max(f, launch - comm / 2)
        return f, back * (1 + REWALK if split else 1), comm + cp + ep, cp, ep

    # a gpt's blocks are alike: stages with the same ends and as many blocks are the same work, timed once
    # (and ranks holding such stages keep the same memory, counted once below)
    kind_of = (lambda lo, hi: (lo == 0, hi == len(work.units), hi - lo)) if work.kind == "gpt" else \
        (lambda lo, hi: (lo, hi))
    alike: dict[tuple, tuple] = {}
    stage_kinds = [kind_of(lo, hi) for lo, hi in stages]
    for (lo, hi), kind in zip(stages, stage_kinds):
        if kind not in alike:
            alike[kind] = stage_times(lo, hi)
        f, back, comm, cp, ep = alike[kind]
        fwd.append(f)
        bwd.append(back)
        tpc.append(comm)
        cpc.append(cp)
        epc.append(ep)
    ranks = stage_of_rank(lay)
    kinds = [tuple(map(stage_kinds.__getitem__, held)) for held in ranks]
    first = {}  # one rank of each kind: what depends on a rank's stages alone is worked out for it, once
    for r, k in enumerate(kinds):
        first.setdefault(k, r)

    def by_kind(f) -> list:
        return _by_kind(kinds, first, f)
    busy = by_kind(lambda r: sum(m * (fwd[s] + bwd[s] + tpc[s]) for s in ranks[r]))
    r_max = max(range(p), key=lambda r: busy[r])
    compute = sum(m * (fwd[s] + bwd[s]) for s in ranks[r_max])
    cp_comm = sum(m * cpc[s] for s in ranks[r_max])
    ep_comm = sum(m * epc[s] for s in ranks[r_max])
    tp_comm = sum(m * tpc[s] for s in ranks[r_max]) - cp_comm - ep_comm
    # ---------------------------------------------------------------- pipeline
    bubble = pp_comm = 0.0
    simulated = bounded = False
    if p > 1:
        boundary = max(work.units[hi - 1].output_elements for lo, hi in stages[:-1]) * b * e / (t if lay.sp else 1) / C
        transfer = cluster.collective("send", boundary, 2, pp_link)
        wire = boundary / (pp_link[0] * 1e9 / 8)  # what of it holds the sender's link
        F = [fwd[s] + tpc[s] / 2 for s in range(p * v)]
        B = [bwd[s] + tpc[s] / 2 for s in range(p * v)]
        spec = spec_of(lay.schedule)
        host = cluster.p2p_overhead_us * 1e-6
        ends = [(s > 0) + (s < p * v - 1) for s in range(p * v)]  # a stage's receive and send around each pass
        hosted = ([f + host * n for f, n in zip(F, ends)], [b_ + host * n for b_, n in zip(B, ends)])

        def slowest(F, B) -> tuple[float, float]:  # the slowest rank's forward and backward (its stages summed)
            held = [ranks[r] for r in first.values()]  # alike ranks hold alike stages: one of each kind
            return max(sum(F[s] for s in h) for h in held), max(sum(B[s] for s in h) for h in held)
        if simulate_pipeline and cluster.crowding:  # workers sharing cores: stages take turns (shared_cores.py)
            free, real, compute = shared_makespans(lay.schedule, p, m, v, tuple(fwd), tuple(bwd), tuple(tpc),
                                                   transfer, cluster.crowding, host, wire)
            busy[r_max] = compute + tp_comm + cp_comm + ep_comm
            simulated = True
        elif simulate_pipeline:  # each send and receive also costs its rank the host's time, on its clock
            free = makespan(lay.schedule, p, m, v, tuple(F), tuple(B), 0.0)
            real = makespan(lay.schedule, p, m, v, *map(tuple, hosted), transfer, wire)
            simulated = True
        else:  # the first pass, only to shortlist: the schedule's closed form on the slowest rank's times, or
            #    where its law does not hold (zero bubble with fewer microbatches than stages) a lower bound,
            #    which make_plan shortlists apart (a bound from above kept the best of them off the shortlist)
            f_r, b_r = slowest(F, B)
            bounded = not spec.idle.holds(p, m, v, f_r, *split_backward(b_r))

            def closed(F, B, transfer: float) -> float:
                if bounded:  # the last stage waits for the first microbatch's forwards, then does all its work;
                    #        the first stage's last W waits for the last microbatch to go down and its input
                    #        gradient to come back; no rank does less than its own work (v = 1 here)
                    I = [split_backward(b_)[0] for b_ in B]
                    return max(sum(F[:-1]) + (p - 1) * transfer + m * (F[-1] + B[-1]),
                               m * F[0] + sum(F[1:]) + sum(I) + split_backward(B[0])[1] + 2 * (p - 1) * transfer,
                               max(m * (f + b_) for f, b_ in zip(F, B)))
                f_r, b_r = slowest(F, B)
                return m * (f_r + b_r) + spec.idle.bounded(p, m, v, f_r, *split_backward(b_r)) + 2 * (p - 1) * transfer
            free = closed(F, B, 0.0)
            real = closed(*hosted, transfer)
        bubble = max(free - busy[r_max], 0.0)
        # tied embeddings: the last stage's copy of the token table, its gradient summed with the first stage's
        tied = cluster.collective("all_reduce", work.tied_parameters / t * e, 2, pp_link) if work.tied_parameters else 0
        pp_comm = max(real - free, 0.0) + tied
        pipe = real + tied
    else:
        pipe = busy[0]
    stage_params = by_kind(lambda r: sum(work.parameters_in(*stages[s]) for s in ranks[r]))
    # a mixture of experts: per rank (the rest, experts) held; the MoE layers whole over tp, experts over ep
    moe_held = by_kind(lambda r: tuple(map(sum, zip(*(work.held_parameters(*stages[s], t, lay.ep)
                                                       for s in ranks[r]))))) if work.moe else None
    units_of = by_kind(lambda r: sum(work.units_with_parameters(*stages[s]) for s in ranks[r]))
    alive = spec_of(lay.schedule).alive(p, m, v) if p > 1 else [1]
    acts = []
    kept = by_kind(lambda r: (  # per microbatch alive, and a recomputation's transient
        sum(work.activation_bytes(*stages[s], b, t, lay.sp, lay.recompute, e, lay.ep) for s in ranks[r]) / len(ranks[r]) / C,
        max(work.recompute_transient(*stages[s], b, t, lay.sp, lay.recompute, e) for s in ranks[r]) / C))
    for r, (per_mb, again) in enumerate(kept):
        acts.append(per_mb * alive[r] + again)
    return Pipeline(stages, ranks, kinds, first, r_max, compute, tp_comm, cp_comm, ep_comm, bubble, pp_comm, pipe,
                    simulated, bounded, stage_params, moe_held, units_of, acts,
                    last_backward=sum(bwd[s] + tpc[s] / 2 for s in ranks[r_max]),
                    first_forward=sum(fwd[s] + tpc[s] / 2 for s in ranks[r_max]))


def _by_kind(kinds: list, first: dict, f) -> list:
    """``f(rank)`` for every pipeline rank, worked out for one rank of each kind (``first``) and shared by the
    ranks of that kind (``kinds``: each rank's)."""
    done = {k: f(r) for k, r in first.items()}
    return [done[k] for k in kinds]


def _with_data_parallelism(work: Workload, lay: Layout, cluster: Cluster, setting: Setting, pl: Pipeline
                           ) -> Prediction:
    """``pl`` with the data-parallel communication, the optimizer step and the memory of ``lay``'s ZeRO stage
    and replication (the data parallelism, optimizer and memory sections of the module docstring)."""
    e = setting.element
    t, p, d, m, C = lay.tp, lay.pp, lay.dp, lay.microbatches, lay.cp  # gradients averaged over dp x cp (dpcp)
    dp_link = cluster.link(t * C * d)
    stages, ranks, r_max, stage_params, moe_held, units_of = (pl.stages, pl.ranks, pl.r_max, pl.stage_params,
                                                              pl.moe_held, pl.units_of)
    last_backward, first_forward, acts = pl.last_backward, pl.first_forward, pl.acts
    def by_kind(f) -> list:
        return _by_kind(pl.kinds, pl.first, f)
    notes = []
    # ---------------------------------------------------------------- data parallelism
    local = stage_params[r_max] / t if moe_held is None else sum(moe_held[r_max])
    grad_bytes = local * e
    dp_total = dp_exposed = 0.0
    units_with_params = units_of[r_max]
    R = lay.replicate  # HSDP: shards over d / R, the shard all-reduced over R
    if d * C > 1:
        d_all = d * C  # the ranks that average each gradient
        if lay.ep > 1:  # the experts' gradients over edp only (two flavours)
            dp_total, dp_exposed = expert_data_parallel(lay, cluster, dp_link, *moe_held[r_max], e, last_backward)
        elif R > 1:
            S = d // R
            shard_link = cluster.link(t * S)
            rs = cluster.collective("reduce_scatter", grad_bytes, S, shard_link, calls=units_with_params)
            ag = cluster.collective("all_gather", local * e, S, shard_link, calls=units_with_params)
            across = cluster.collective("all_reduce", grad_bytes / S, R, dp_link, calls=units_with_params)
            gathers = 2 * ag if lay.zero == 3 and p == 1 else ag
            dp_total = rs + across + gathers
            dp_exposed = rs + across + (max(ag - first_forward, 0.0) if p == 1 and t == 1 else ag)
        elif lay.zero == 0:
            runs = buckets_of(grad_bytes)
            calls = [cluster.collective("all_reduce", size, d_all, dp_link) for _, size in runs]
            dp_total = sum(n * t for (n, _), t in zip(runs, calls))
            dp_exposed = ddp_exposed(runs, calls, last_backward)
        else:
            rs = cluster.collective("reduce_scatter", grad_bytes, d_all, dp_link, calls=units_with_params)
            ag = cluster.collective("all_gather", local * e, d_all, dp_link, calls=units_with_params)
            if lay.zero == 3 and p == 1:  # under a pipeline the stage is gathered once per step
                dp_total = 2 * ag + rs
                dp_exposed = rs + max(ag - first_forward, 0.0) + max(ag - last_backward, 0.0)
            else:
                dp_total = rs + ag
                hidden_gather = p == 1 and (lay.zero == 2 or t == 1 and C == 1)  # fsdp's asynchronous all-gather
                dp_exposed = rs + (max(ag - first_forward, 0.0) if hidden_gather else ag)
            if p > 1 and lay.zero >= 2:
                # each stage reduce-scatters inside its last backward, before it sends the gradient on: the
                # pipeline's drain waits for every stage's in turn
                dp_exposed += sum(cluster.collective("reduce_scatter", stage_params[r] / t * e, d_all, dp_link,
                                                     calls=units_of[r]) for r in range(p) if r != r_max)
    # ---------------------------------------------------------------- memory and optimizer
    def states_of(r: int):  # the working set is that of the rank's own largest unit
        unit_max = max((work.largest_unit(*stages[s]) for s in ranks[r]), default=0)
        return model_states(stage_params[r], d * C // R, lay.zero, p > 1, setting.optimizer, setting.precision,
                            unit_max, t, e, m)
    moe_states = by_kind(lambda r: expert_states(lay, setting, *moe_held[r], e)) if moe_held else None
    if moe_states:  # a mixture of experts: its two parameter sets' states, ddp's buckets included
        optimizer = 2 * moe_states[r_max][0] / (cluster.memory_gbs * 1e9)
    else:
        states_by_rank = by_kind(states_of)
        est = states_by_rank[r_max][0]
        optimizer = 2 * est.total / (cluster.memory_gbs * 1e9)
    # the busiest device for memory: model states of its stages + its activations
    mem_by_rank = []
    for r in range(p):
        if moe_states:
            states = moe_states[r][1]
        else:
            states = states_by_rank[r][1]
            if lay.zero == 0:  # ddp's buckets: a flat copy of the rank's gradients, kept between steps
                states += stage_params[r] / t * e
        mem_by_rank.append((states + acts[r], states, acts[r], r))
    memory, states, activations, r_mem = max(mem_by_rank)
    step = pl.pipe + dp_exposed + optimizer
    gb = setting.global_batch
    tokens = gb * work.tokens_per_sample
    workers = d * t * p * C
    mfu = gb * work.model_flops_per_sample() / step / (workers * cluster.peak(setting.dtype))
    return Prediction(lay, step, pl.compute, pl.tp_comm, pl.bubble, pl.pp_comm, dp_exposed, dp_total, optimizer,
                      memory,
                      {"model_states": states, "activations": activations, "rank": r_mem,
                       "model_states_formula": moe_states[r_mem][2] if moe_states else est.total_formula.formula
                       + (" + ddp's gradient buckets (Psi)" if lay.zero == 0 else "")},
                      fits=memory <= cluster.memory_gb * 1e9 * cluster.usable_fraction, simulated=pl.simulated,
                      mfu=mfu, tokens_per_s=tokens / step, samples_per_s=gb / step, notes=notes,
                      cp_comm=pl.cp_comm, ep_comm=pl.ep_comm, bounded=pl.bounded,
                      memory_by_rank=[(st, a) for _, st, a, _ in mem_by_rank])


def arithmetic_seconds(work: Workload, cluster: Cluster, lo: int, hi: int, t: int, C: int, b: int, flops: float,
                       rate: float, dtype: str) -> float:
    """Seconds of a stage's ``flops`` of one microbatch's forward on a rank: all at ``rate`` (the cluster's
    one efficiency), or, where the cluster has a matmul ramp (16-bit, as it was measured or published) and
    the run's matmuls are 16-bit, each weight matmul (``Workload.matmuls``) at the fraction of the peak its
    size reaches and the rest at ``rate``."""
    if not cluster.ramp(dtype):
        return flops / rate
    calls = work.matmuls(lo, hi, t, C, b)
    named = sum(f * n for f, n in calls)
    peak = cluster.peak(dtype)
    return (flops - named) / rate + sum(f * n / (peak * cluster.matmul_efficiency(f)) for f, n in calls)


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


def cp_exposed(work: Workload, lay: Layout, b: int, e: int, link: tuple[float, float], cluster: Cluster,
               rate: float, split: bool = False) -> float:
    """One block's context-parallel communication left exposed per microbatch (forward + backward), from
    ``analysis/context.py``'s messages (keys and values at the grouped-query width, ``h G / a``): the ring's
    sends go out while the block's attention computes (each
    hop overlaps one chunk's scores; its send and receive cost the processor ``p2p_overhead_us`` each, which
    nothing hides), Ulysses's all-to-alls are synchronous. Under a split backward
    (``split``: zero bubble) both its passes walk back through the attention: the backward's messages and
    the attention's backward happen twice. ``rate``: the arithmetic's FLOP/s (forward + backward)."""
    from ..context import cp_messages
    sh, C = work.shape, lay.cp
    kv_width = sh["embed"] * sh["kv_heads"] // sh["heads"]  # grouped-query: G of the a heads (as Workload.matmuls)
    msgs = cp_messages(b, sh["context"], sh["embed"], 1, C, lay.cp_method, lay.tp, e, kv=kv_width)
    times = {name: 2 if split and name.endswith("_backward") else 1 for name in msgs}
    if lay.cp_method == "ring":
        sends = sum(times[name] * n for name, (n, _) in msgs.items())
        kv = next(iter(msgs.values()))[1] / max(next(iter(msgs.values()))[0], 1)
        attention = (1 + 2 * (2 if split else 1)) * 4.0 * sh["context"] ** 2 * sh["embed"] * b / (lay.tp * C) / rate
        gbps, lat = link  # the hops overlap the attention: their wire time, not a measured call
        # each hop's send and receive cost the rank processor time, every rank at once (at the crowded rate)
        host = sends * 2 * cluster.p2p_overhead_us * 1e-6 * max(1.0, cluster.crowding)
        return max(sends * (kv / (gbps * 1e9 / 8) + lat) - attention, 0.0) + host
    return sum(times[name] * cluster.collective("all_to_all", size, C, link, calls=calls)
               for name, (calls, size) in msgs.items())


def replicated_sums(work: Workload, lo: int, hi: int, cluster: Cluster, t: int, link: tuple[float, float],
                    e: int) -> float:
    """Under sequence parallelism, per microbatch: the all-reduces of the parameters every tp rank holds whole
    but applies to its own tokens (``TPGroup.replicated``: each block's two LayerNorms' weight and bias and
    its two row-parallel biases, the head's LayerNorm, the first stage's position table), each summed in
    backward as its own call, one right after another (``all_reduce_burst`` where measured)."""
    h = work.shape.get("embed", 0)
    blocks = work.blocks_in(lo, hi)
    calls = 6 * blocks + 2 * (hi == len(work.units))
    total = cluster.collective("all_reduce_burst", calls * h * e, t, link, calls=calls) if calls else 0.0
    if lo == 0:
        total += cluster.collective("all_reduce", work.shape.get("context", 0) * h * e, t, link)
    return total


def split_backward(b: float) -> tuple[float, float]:
    """(I, W) of a split backward that takes ``b`` in all: paralab's ``W`` is ``torch.autograd.backward`` of
    each unit's output limited to its parameters, so it walks the unit's activation gradients again (the
    weights' gradients need them): of a whole backward's two halves (activation gradients, weight gradients)
    ``I`` is one and ``W`` both, and ``b`` is (1 + REWALK) whole backwards."""
    whole = b / (1 + REWALK)
    return whole / 2, whole / 2 + REWALK * whole


def _split(name: str, B) -> dict:
    """A zero-bubble schedule's ``input_time`` and ``weight_time`` per stage (:func:`split_backward` of each
    whole backward in ``B``); nothing for the others."""
    if not spec_of(name).split_backward:
        return {}
    inputs, weights = zip(*map(split_backward, B))
    return dict(input_time=list(inputs), weight_time=list(weights))


@lru_cache(maxsize=64)
def _schedule(name: str, p: int, m: int, v: int):
    return build_schedule(name, p, m, v)


@lru_cache(maxsize=4096)
def makespan(name: str, p: int, m: int, v: int, F: tuple, B: tuple, transfer: float, wire: float = 0.0) -> float:
    """The simulated step of schedule ``name`` at per-stage forward and backward times ``F``, ``B`` (a
    zero-bubble schedule's backward split as :func:`split_backward` says), each transfer taking ``transfer`` s,
    ``wire`` of them on its sender's link. Layouts that differ only outside the pipeline (ZeRO stage, data
    parallelism) share one simulation."""
    return max(finish_times(_schedule(name, p, m, v), list(F), list(B), transfer, check=False, wire_time=wire,
                            **_split(name, B)), default=0.0)


@lru_cache(maxsize=4096)
def shared_makespans(name: str, p: int, m: int, v: int, fwd: tuple, bwd: tuple, comm: tuple, transfer: float,
                     crowding: float, host: float = 0.0, wire: float = 0.0) -> tuple[float, float, float]:
    """(step at free transfers, step, the busiest rank's compute) of schedule ``name`` on workers that share
    cores (``shared_cores.py``): ``fwd``, ``bwd`` a stage's compute at the all-at-once rate, ``comm`` its tp,
    cp and ep communication (half in forward, half in backward), which leaves the cores to the others;
    ``host`` each send's and receive's processor time, counted in the step, not at free transfers."""
    half = [c / 2 for c in comm]
    kw = _split(name, bwd)
    free, busy = simulate_shared(_schedule(name, p, m, v), list(fwd), list(bwd), half, half, 0.0, crowding, **kw)
    real, _ = simulate_shared(_schedule(name, p, m, v), list(fwd), list(bwd), half, half, transfer, crowding,
                              host=host, wire=wire, **kw)
    return free, real, max(busy)


# ---------------------------------------------------------------- a mixture of experts, expert parallelism
def ep_exposed(work: Workload, lay: Layout, b: int, e: int, cluster: Cluster, link: tuple[float, float],
               split: bool = False) -> float:
    """One MoE layer's expert-parallel all-to-alls per microbatch, forward + backward, at an even load (all
    synchronous in paralab): forward the counts (E integers), the dispatch and the combine of the kept
    choices' rows (``analysis/moe.step_volume``: choices x h x e bytes each way), backward both token
    all-to-alls again, twice under a zero-bubble schedule (its input- and weight-gradient passes each walk
    back through them, docs/experts.md). Each moves (ep - 1) / ep of its bytes off the rank."""
    from ..moe import step_volume
    moe, ep = work.moe, lay.ep
    sh = work.shape
    one = step_volume(b * sh["context"], moe["top_k"], moe["experts"], sh["embed"], 1, ep, e,
                      moe["capacity_factor"])["per_transfer"]
    backward = 2 * (2 if split else 1)
    return (cluster.collective("all_to_all", 8 * moe["experts"], ep, link)
            + (2 + backward) * cluster.collective("all_to_all", one, ep, link))


def expert_data_parallel(lay: Layout, cluster: Cluster, link: tuple[float, float], rest: float, experts: float,
                         e: int, last_backward: float) -> tuple[float, float]:
    """(in flight, exposed) data-parallel communication under ``--ep``: the named flavour twice, over the
    rank's other parameters on dp and over its experts on edp (dp / ep ranks holding the same experts).
    ddp: two sets of buckets, overlapping the last backward (the other parameters' last bucket exposed at
    least); ZeRO-1: one flat unit per set, reduce-scattered after backward, all-gathered after the step and
    waited for before the next step's forwards: all exposed."""
    sets = [(size, n) for size, n in ((rest * e, lay.dp), (experts * e, lay.dp // lay.ep)) if size]  # a stage
    if lay.zero == 0:  # without a MoE layer has no experts' flavour
        parts = []
        for size, n in sets:
            runs = buckets_of(size)
            parts.append((sum(k * cluster.collective("all_reduce", b, n, link) for k, b in runs), runs))
        total = sum(x for x, _ in parts)
        return total, max(total - last_backward, cluster.collective("all_reduce", parts[0][1][-1][1], sets[0][1], link))
    total = sum(cluster.collective("reduce_scatter", size, n, link) + cluster.collective("all_gather", size, n, link)
                for size, n in sets)
    return total, total


def expert_states(lay: Layout, setting: Setting, rest: float, experts: float, e: int) -> tuple[float, float, str]:
    """(model states, their peak, formula) of a rank holding ``rest`` parameters beside ``experts`` expert
    parameters of a mixture of experts (``Workload.held_parameters``). ZeRO-0: both whole, plus ddp's
    buckets (a flat copy of their gradients); ZeRO-1 (under ep): the rest's optimizer state sharded over
    dp, the experts' over edp = dp / ep, and at the peak the flat copy of the rest's gradients (each set is
    one flat unit, ``strategies/expert/replicas.py``; the rest's is reduced first, while every gradient is
    still alive)."""
    total = memory_per_worker(rest + experts, 1, 0, setting.optimizer, setting.precision)
    if lay.zero == 0:
        return total.total, total.total + (rest + experts) * e, \
            "(p + g + K) (Psi_rest + Psi_experts / ep) + ddp's gradient buckets (Psi_rest + Psi_experts / ep)"
    one = [memory_per_worker(x, n, 1, setting.optimizer, setting.precision) for x, n in
           ((rest, lay.dp), (experts, lay.dp // lay.ep))]
    states = one[0].total + one[1].total
    return states, states + rest * e, \
        ("(p + g) (Psi_rest + Psi_experts / ep) + K (Psi_rest / dp + Psi_experts / ep / edp) "
         "+ g Psi_rest (its flat copy while reduced)")
