"""The layouts a planner considers: dp x cp x tp x pp with everything each dimension adds.

A :class:`Layout` is one way to run the model on the workers, as paralab
composes it (``docs/architecture.md``): ``pp`` stages (a ``schedule`` of the
registry, ``virtual`` stages per rank for the interleaved one), each sharded
over ``tp`` (with or without sequence parallelism), each wrapped for data
parallelism over ``dp`` at a ZeRO ``zero`` stage (0 = ddp's buckets; 1-3 =
paralab's fsdp, under ``--tp`` and ``--pp`` too, and as HSDP over
``replicate`` groups); a step is
``microbatches`` microbatches of ``microbatch`` samples per replica; the
gpt's sequence may be split over ``cp`` ranks (``cp_method`` ring or
all-to-all; the context divides into 2 cp chunks, Ulysses's heads per tp
rank by cp; no sequence parallelism and ZeRO 0-1 beside it, as paralab's
``cp`` composes);
``recompute`` is none, selective or full (``--recompute``; planned from
Korthikanti et al.'s formulas, see docs/recompute.md for what paralab's gpt keeps).
A mixture of experts' experts may be split over ``ep`` of the dp replicas
(``--ep``: ep groups of consecutive replicas, so ep divides dp and the
experts, each expert held by dp / ep replicas, the ``edp`` group), as
paralab composes it (docs/experts.md): with ddp's buckets (ZeRO-0) or ZeRO-1
(``fsdp --zero-stage 1``, only under ``--ep``), tp and pp; never with cp,
sequence parallelism, recomputation, ZeRO-2/3 or HSDP, which paralab refuses
for a mixture of experts.

:func:`enumerate_layouts` yields every layout that divides the model and the
workers (fitting in memory is the predictor's question). Tensor parallelism
stays inside a node (its collectives are in every layer's critical path);
microbatches are of 1, 2, 4, ... samples (and the whole replica batch);
paralab's fsdp takes no gradient accumulation (one microbatch per step; ``fsdp
--accumulate`` is refused under ``--tp`` too).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass

from ...strategies.pipeline.schedules import REGISTRY, layout_problem
from .workload import RECOMPUTE, Workload

VIRTUAL = (2, 3, 4)  # stages per rank tried for the interleaved schedule


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 0
    sp: bool = False
    schedule: str | None = None
    virtual: int = 1
    microbatch: int = 1      # samples per microbatch (b)
    microbatches: int = 1    # per step and replica (m)
    recompute: str = "none"
    cp: int = 1              # context parallelism: each sequence split over cp ranks (the gpt's)
    cp_method: str = "ring"  # ring | all-to-all (Ulysses)
    replicate: int = 1       # HSDP: dp split into replicate groups x dp / replicate shard groups (fsdp)
    ep: int = 1              # expert parallelism: a MoE's experts split over ep of the dp replicas (ep divides dp)

    @property
    def devices(self) -> int:
        """The devices the layout lays out on: dp x cp x tp x pp (ep and hsdp split dp, virtual stages pp)."""
        return self.dp * self.cp * self.tp * self.pp

    def label(self) -> str:
        parts = [f"dp{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp} {'ring' if self.cp_method == 'ring' else 'a2a'}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp} {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1 else ""))
        parts.append(f"m{self.microbatches}xb{self.microbatch}")
        if self.zero:
            parts.append(f"zero{self.zero}" + (f" hsdp{self.replicate}x{self.dp // self.replicate}"
                                               if self.replicate > 1 else ""))
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        return " ".join(parts)

    def flavour(self) -> str:
        """What paralab runs for the data-parallel dimension."""
        if self.zero == 0:
            return "ddp"
        return f"fsdp --zero-stage {self.zero}"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """The layout a table row's label names (the inverse of :meth:`label`), e.g. ``dp64 tp8+sp pp16 1f1b
        m16xb1 zero1``; ValueError saying which word is wrong. Left out: ep, cp, tp, pp 1, ZeRO-0, no
        recomputation, ``m1xb1``."""
        words, values = text.split(), {}
        i = 0
        while i < len(words):
            w = words[i]
            nxt = words[i + 1] if i + 1 < len(words) else ""
            if m := re.fullmatch(r"(dp|ep|cp|tp|pp)(\d+)(\+sp)?", w):
                dim, n, sp = m.group(1), int(m.group(2)), bool(m.group(3))
                if sp and dim != "tp" or dim in values:
                    raise ValueError(f"layout {text!r}: {w!r} " + ("repeats a dimension" if dim in values else
                                                                  "(+sp belongs to tp)"))
                values[dim] = n
                values["sp"] = values.get("sp", False) or sp
                if dim == "cp" and nxt in ("ring", "a2a"):
                    values["cp_method"] = "ring" if nxt == "ring" else "all-to-all"
                    i += 1
                elif dim == "pp" and nxt in REGISTRY:
                    values["schedule"] = nxt
                    i += 1
                    if i + 1 < len(words) and (v := re.fullmatch(r"v(\d+)", words[i + 1])):
                        values["virtual"] = int(v.group(1))
                        i += 1
            elif m := re.fullmatch(r"m(\d+)xb(\d+)", w):
                values["microbatches"], values["microbatch"] = int(m.group(1)), int(m.group(2))
            elif m := re.fullmatch(r"zero([0-3])", w):
                values["zero"] = int(m.group(1))
                if h := re.fullmatch(r"hsdp(\d+)x(\d+)", nxt):
                    values["replicate"] = int(h.group(1))
                    i += 1
            elif m := re.fullmatch(r"rc-(none|selective|full)", w):
                values["recompute"] = m.group(1)
            else:
                raise ValueError(f"layout {text!r}: {w!r} is not a word of a layout (dpD epE cpC ring|a2a tpT[+sp] "
                                 f"ppP SCHEDULE [vV] mMxbB zeroZ [hsdpRxS] rc-R; schedules: {', '.join(REGISTRY)})")
            i += 1
        if "dp" not in values:
            raise ValueError(f"layout {text!r}: give the data-parallel degree (dpD, dp1 for none)")
        if values.get("pp", 1) > 1 and "schedule" not in values:
            raise ValueError(f"layout {text!r}: pp{values['pp']} needs its schedule after it "
                             f"({', '.join(REGISTRY)})")
        return cls(dp=values["dp"], tp=values.get("tp", 1), pp=values.get("pp", 1), zero=values.get("zero", 0),
                   sp=values["sp"], schedule=values.get("schedule"), virtual=values.get("virtual", 1),
                   microbatch=values.get("microbatch", 1), microbatches=values.get("microbatches", 1),
                   recompute=values.get("recompute", "none"), cp=values.get("cp", 1),
                   cp_method=values.get("cp_method", "ring"), replicate=values.get("replicate", 1),
                   ep=values.get("ep", 1))

    def pins(self) -> dict:
        """Every dimension of this layout as :func:`enumerate_layouts` pins them."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "cp_method": self.cp_method,
                "zero": self.zero, "sp": self.sp, "schedule": self.schedule, "virtual": self.virtual,
                "microbatch": self.microbatch, "recompute": self.recompute, "replicate": self.replicate,
                "ep": self.ep}

    def run_options(self, workers: int) -> dict:
        """The `paralab train` options (RunConfig's fields) that lay a run out as this layout; the command
        line is made from them by the run options' own declaration (``commands/plan.py``)."""
        values = {"strategy": self.flavour().split()[0], "workers": workers, "zero_stage": self.zero or None,
                  "replicate": self.replicate, "ep": self.ep, "tp": self.tp, "sequence_parallel": self.sp,
                  "cp": self.cp, "cp_method": self.cp_method, "pp": self.pp, "recompute": self.recompute}
        if self.pp > 1:
            values |= {"schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual}
        elif self.microbatches > 1:
            values["accumulate"] = self.microbatches
        return {k: v for k, v in values.items() if v is not None}

    def command(self, workers: int) -> str:
        """`paralab train` with this layout's flags alone (the model, shape and batch left to the caller;
        ``paralab plan`` prints the whole run's), spelled by the options' own declaration."""
        from ... import options
        from ...strategies.all_options import OPTION_CLASSES
        values = self.run_options(workers)
        strategy, workers = values.pop("strategy"), values.pop("workers")
        flags = options.to_argv(values, OPTION_CLASSES, first=("zero_stage",) if self.zero else ())
        return shlex.join(["paralab", "train", strategy, "--workers", str(workers), *flags])

    def to_dict(self) -> dict:
        return asdict(self) | {"label": self.label()}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_sizes(per_replica: int) -> list[int]:
    """1, 2, 4, ... dividing the replica's batch, and the whole batch."""
    out, b = [], 1
    while b <= per_replica:
        if per_replica % b == 0:
            out.append(b)
        b *= 2
    return sorted(set(out) | {per_replica})


def enumerate_layouts(work: Workload, workers: int, global_batch: int, devices_per_node: int, *,
                      fixed: dict | None = None) -> list[Layout]:
    """Every layout of ``work`` on ``workers`` that divides the model, the workers and the batch.

    ``fixed`` pins dimensions ({"tp": 8, "pp": 4, "dp": ..., "zero": 1, "schedule": "1f1b", "microbatch": 1,
    "recompute": "selective", "sp": True, "ep": 2}).
    """
    fixed = fixed or {}
    if moe_pins_problem(work, fixed):
        return []  # why_none says what
    pick = lambda key, options: [fixed[key]] if fixed.get(key) is not None else options  # noqa: E731
    moe = work.moe
    # a MoE layer records its routing in each forward: no recomputation (a pinned one is refused above)
    recompute = pick("recompute", ["none"] if moe else list(RECOMPUTE) if work.kind == "gpt" else ["none", "full"])
    out: list[Layout] = []
    tps = [t for t in work.tp_options() if workers % t == 0 and (t <= devices_per_node or "tp" in fixed)]
    for tp in pick("tp", tps):
        if tp not in work.tp_options():
            continue
        for pp, cp, method in _pp_cp(work, workers, tp, devices_per_node, fixed):
            dp = workers // (tp * pp * cp)
            if fixed.get("dp") is not None and fixed["dp"] != dp or global_batch % dp:
                continue
            if isinstance(work.cut(pp), str):
                continue
            per_replica = global_batch // dp
            zeros = [0, 1] if cp > 1 else [0, 1, 2, 3]  # fsdp composes with tp and pp, not with cp above ZeRO-1
            for zero, replicate, ep in _zero_replicate_ep(work, pick("zero", zeros if dp * cp > 1 else [0]), dp,
                                                          cp, devices_per_node // tp, fixed):
                for sp in pick("sp", [False, True] if tp > 1 and cp == 1 and not moe else [False]):
                    for schedule, v in _schedules(work, pp, fixed):
                        for b in pick("microbatch", microbatch_sizes(per_replica)):
                            if per_replica % b:
                                continue
                            m = per_replica // b
                            if pp == 1 and m > 1 and zero >= 1:
                                continue  # paralab's fsdp (alone, on tp slices, under ep): no --accumulate
                            if schedule and layout_problem(schedule, pp, m, v):
                                continue
                            for rc in recompute:
                                out.append(Layout(dp, tp, pp, zero, sp, schedule, v, b, m, rc, cp, method,
                                                  replicate, ep))
    return out


def _zero_replicate_ep(work: Workload, zeros: list[int], dp: int, cp: int, per_node: int,
                       fixed: dict) -> list[tuple[int, int, int]]:
    """(ZeRO stage, HSDP replica groups, ep): a dense model's as :func:`_zero_replicate` gives them; a
    mixture of experts' as paralab composes it: ddp (ZeRO-0) with any ep dividing dp and the experts,
    ZeRO-1 only under ep > 1 (it is the flavour used twice there; fsdp alone does not train a MoE), no
    ZeRO-2/3, no HSDP (paralab refuses them with a MoE), no cp."""
    moe = work.moe
    if not moe:
        return [(z, r, 1) for z, r in _zero_replicate(zeros, dp, cp, per_node, fixed)]
    if cp > 1:
        return []
    eps = [e for e in divisors(dp) if moe["experts"] % e == 0 and fixed.get("ep") in (None, e)]
    return [(z, 1, e) for z in zeros if z <= 1 for e in eps if z == 0 or e > 1]


def _zero_replicate(zeros: list[int], dp: int, cp: int, per_node: int, fixed: dict) -> list[tuple[int, int]]:
    """(ZeRO stage, HSDP replica groups): fsdp's dp may be split into R replica groups of dp / R shards
    (1 < R < dp; not beside cp), a shard group inside a node unless pinned (HSDP's point: the chatty
    gathers on the node's links, one all-reduce across)."""
    out = []
    for zero in zeros:
        groups = [1] + ([r for r in divisors(dp) if 1 < r < dp and (dp // r <= per_node or "replicate" in fixed)]
                        if zero and cp == 1 else [])
        out += [(zero, r) for r in groups if fixed.get("replicate") in (None, r)]
    return out


#: the fewest tokens a rank of a cp group larger than a node keeps for the search to list it (``--cp`` pinned
#: plans any): across nodes a ring step's transfer, a chunk's keys and values over the NIC, hides under the
#: step's attention arithmetic only for long chunks (the arithmetic grows as the chunk squared, the bytes as
#: the chunk), and listing every divisor of the workers priced thousands of layouts with chunks of a few
#: tokens (docs/plan.md, "Context parallelism across nodes")
CP_ACROSS_NODES_TOKENS = 1024


def _pp_cp(work: Workload, workers: int, tp: int, per_node: int, fixed: dict) -> list[tuple[int, int, str]]:
    """(pp, cp, cp method) dividing the workers over tp: cp for the gpt only, its balanced chunks dividing
    the context (2 cp of them), Ulysses's query and key/value heads per rank (a / tp, G / tp) too; a cp x tp
    group larger than a node only where each rank keeps ``CP_ACROSS_NODES_TOKENS`` tokens or more, unless
    pinned. No cp (cp 1) asks nothing of the context or of where tp's ranks sit."""
    out = []
    if workers % tp:
        return out
    for pp in ([fixed["pp"]] if fixed.get("pp") is not None else divisors(workers // tp)):
        if (workers // tp) % pp:
            continue
        cps = [1]
        if work.kind == "gpt" and not work.moe:  # paralab's cp does not compose with a mixture of experts
            cps += [c for c in divisors(workers // (tp * pp)) if c > 1 and work.shape["context"] % (2 * c) == 0
                    and (c * tp <= per_node or work.shape["context"] // c >= CP_ACROSS_NODES_TOKENS
                         or "cp" in fixed)]
        for cp in ([fixed["cp"]] if fixed.get("cp") is not None else cps):
            if cp not in cps:
                continue
            methods = ["ring"] if cp == 1 else ["ring"] + (
                ["all-to-all"] if all((a // tp) % cp == 0 for a in (work.shape["heads"],
                                                                    work.shape.get("kv_heads") or work.shape["heads"]))
                else [])
            out += [(pp, cp, m) for m in methods if fixed.get("cp_method") in (None, m) or cp == 1]
    return out


def _schedules(work: Workload, pp: int, fixed: dict) -> list[tuple[str | None, int]]:
    if pp == 1:
        return [(None, 1)]
    out = []
    for name, spec in REGISTRY.items():
        if fixed.get("schedule") not in (None, name):
            continue
        if spec.virtual:
            out += [(name, v) for v in ([fixed["virtual"]] if fixed.get("virtual") else VIRTUAL)
                    if not isinstance(work.cut(pp * v), str)]
        else:
            out.append((name, 1))
    return out


def devices_problem(layout: Layout, workers: int) -> str | None:
    """Why ``layout`` cannot run on ``workers`` devices by its product alone (None if it can): checked before
    anything is measured or searched."""
    if layout.devices == workers:
        return None
    return f"dp x cp x tp x pp = {layout.devices}, not the {workers} workers"


def why_none(work: Workload, workers: int, global_batch: int, devices_per_node: int, fixed: dict) -> str:
    """Why no layout divides this model on these workers, in words saying what to change."""
    tp, pp = fixed.get("tp"), fixed.get("pp")
    moe_problem = moe_pins_problem(work, fixed)
    if moe_problem:
        return moe_problem
    if tp and tp not in work.tp_options():
        return (f"--tp {tp} does not divide the model: tensor parallelism splits the {work.shape.get('heads')} heads"
                if work.kind == "gpt" else f"tensor parallelism is not planned for {work.name}: leave out --tp")
    if tp and workers % tp or pp and workers % pp or tp and pp and workers % (tp * pp):
        return f"--tp and --pp must divide the {workers} workers"
    if pp:
        problem = work.cut(pp)
        if isinstance(problem, str):
            return f"--pp {pp}: {problem}"
    if fixed.get("dp") and workers % fixed["dp"]:
        return f"--dp {fixed['dp']} must divide the {workers} workers"
    b = fixed.get("microbatch")
    if b and not any(global_batch % dp == 0 and (global_batch // dp) % b == 0 for dp in divisors(workers)):
        return (f"--microbatch {b} divides no replica's batch (global batch {global_batch} / dp, dp dividing the "
                f"{workers} workers): change --microbatch or --global-batch")
    if fixed.get("ep"):
        return (f"--ep {fixed['ep']} must divide the data-parallel replicas (workers / (tp x pp)) of some layout "
                f"that divides the global batch {global_batch}: change --ep, --workers, --tp or --pp")
    return (f"no layout of dp x tp x pp = {workers} divides the model and the global batch {global_batch} "
            "(the data-parallel degree must divide the global batch): change --workers, --global-batch or "
            "the pinned dimensions")


def moe_pins_problem(work: Workload, fixed: dict) -> str | None:
    """What paralab refuses in the pinned dimensions for this model's experts (or their absence), in words
    saying what to change; None if nothing."""
    moe, ep = work.moe, fixed.get("ep")
    if not moe:
        return (f"--ep {ep} splits a mixture of experts' experts: add --experts E (a gpt)" if ep not in (None, 1)
                else None)
    E = moe["experts"]
    if ep and E % ep:
        return f"--ep {ep} must divide the {E} experts (each rank holds experts / ep of them): change --ep"
    refused = [(fixed.get("cp", 1) > 1, f"--cp {fixed.get('cp')}: paralab's cp does not compose with a mixture "
                                        "of experts"),
               (bool(fixed.get("sp")), "sequence parallelism: each tp rank would route only its sequence shard"),
               (fixed.get("recompute") not in (None, "none"),
                f"--recompute {fixed.get('recompute')}: a MoE layer records its routing in each forward, which a "
                "recompute would repeat"),
               (fixed.get("zero") in (2, 3), f"--zero {fixed.get('zero')}: ZeRO-2/3 shard the parameters unit by "
                                            "unit and cannot be split into expert and non-expert sets (ZeRO-0 or 1)"),
               (fixed.get("zero") == 1 and ep == 1, "--zero 1 with --ep 1: paralab's fsdp trains a mixture of "
                                                    "experts only under --ep (as the flavour of each parameter set)")]
    for bad, why in refused:
        if bad:
            return f"{why}; paralab refuses it with --experts (docs/experts.md): drop that pin"
    return None
