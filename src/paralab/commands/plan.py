"""Choose a layout for a model on a cluster: every layout that fits, predicted and ranked.

For a model (any gpt shape, dense or a mixture of experts, or a course CNN),
a global batch and a cluster (a preset, a JSON/TOML file, or this-machine,
measured here in seconds and cached), paralab plan enumerates the layouts
that divide the model and the workers (dp x cp x tp x pp; ZeRO stage 0-3;
sequence parallelism; ring or all-to-all context parallelism; expert
parallelism of a mixture of experts; pipeline schedule, microbatches and
virtual stages; recomputation none/selective/full, planned from
Korthikanti et al.'s formulas), predicts
each one's step time (compute: matmuls at the device's rate, elementwise
kernels at its memory bandwidth; tensor-parallel, pipeline and data-parallel
communication with what paralab overlaps; the bubble from the schedule
simulator on per-stage times; the optimizer step) and peak memory per
device, and prints the fastest that fit, with MFU, tokens/s and why the
first beats the second. How to read it and the cost model's assumptions:
docs/plan.md.

examples:
  paralab plan --model gpt --layers 96 --embed 12288 --heads 96 --context 2048 --vocab 50257 \\
      --workers 1024 --cluster h100-sxm --global-batch 1536
  paralab plan --model gpt --workers 4 --cluster this-machine
  paralab plan --model vgg11 --workers 8 --cluster a100-sxm --global-batch 256 --json
  paralab plan --model gpt --layers 32 --embed 4096 --heads 32 --context 4096 --vocab 32000 --experts 8 \\
      --top-k 2 --expert-hidden 21504 --activations paralab --workers 64 --cluster h100-sxm --global-batch 256
  paralab plan --model gpt --layers 24 --embed 2048 --heads 16 --context 2048 --vocab 50257 --workers 64 \\
      --cluster my-cluster.toml --tp 4 --top 5
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..analysis.memory import OPTIMIZERS
from ..errors import UsageError
from ..models import MODELS, GPTOptions, ModelOptions, MoEOptions
from ..options import add_flags, check, flag, name_of, option, option_fields, integer
from ..progress import Progress
from ..strategies.pipeline.schedules import SCHEDULES

HELP = "choose a layout: every dp/ZeRO/tp/pp/schedule/recompute layout that fits, predicted and ranked"


@dataclass
class PlanOptions:
    """plan: the workers, the batch, the cluster, what to pin, how to print"""
    workers: int = option(None, "devices (workers) to lay the model out on", type=integer, positive=True)
    global_batch: int = option(32, "samples (sequences or images) per step over all replicas", positive=True)
    vocab: int = option(256, "gpt vocabulary V (256: paralab's byte tokens; 50257 for GPT-2/GPT-3)", positive=True)
    cluster: str = option("this-machine", "a preset (a100-sxm, a100-sxm-datasheet, a100-40gb, h100-sxm, h800, h200, cpu), this-machine (measured and "
                                          "cached), or a JSON/TOML cluster file", metavar="CLUSTER")
    precision: str = option(None, "fp32 | mixed (16-bit parameters, gradients and activations, fp32 optimizer "
                                  "state; default: mixed where the cluster has a bf16 peak, else fp32)", type=str,
                            choices=("fp32", "mixed"))
    optimizer: str = option("adam", "optimizer whose state the memory model counts", choices=OPTIMIZERS)
    tp: int = option(None, "pin the tensor-parallel degree", type=integer, positive=True)
    pp: int = option(None, "pin the pipeline stages", type=integer, positive=True)
    dp: int = option(None, "pin the data-parallel degree", type=integer, positive=True)
    zero: int = option(None, "pin the ZeRO stage (0 = ddp)", type=integer, choices=(0, 1, 2, 3))
    schedule: str = option(None, "pin the pipeline schedule", type=str, choices=SCHEDULES)
    microbatch: int = option(None, "pin the samples per microbatch", type=integer, positive=True)
    cp: int = option(None, "pin context parallelism (the gpt's sequence split over this many ranks)", type=integer,
                     positive=True)
    cp_method: str = option(None, "pin the context-parallel method", type=str, choices=("ring", "all-to-all"))
    ep: int = option(None, "pin expert parallelism (a mixture of experts, --experts: its experts split over this "
                           "many of the data-parallel replicas; it divides dp and the experts)", type=integer,
                     positive=True)
    recompute: str = option(None, "pin recomputation (planned from formulas only)", type=str,
                            choices=("none", "selective", "full"))
    activations: str = option("auto", "what a gpt block keeps for backward: paralab (paralab's gpt: no dropout, a "
                                      "fused attention), published (Korthikanti et al.'s Megatron block, for "
                                      "comparing with papers), auto (paralab on this-machine, else published)",
                              choices=("auto", "paralab", "published"))
    layout: str = option(None, "evaluate this one layout, as the table writes it (e.g. 'dp64 tp8+sp pp16 1f1b "
                               "m16xb1 zero1'): its prediction even if it does not fit (the memory it needs against "
                               "the device's) and its place among the searched layouts", type=str, metavar="LAYOUT")
    top: int = option(10, "rows to show", positive=True)
    json: bool = option(False, "print the plan as JSON (for scripts)")
    report: str = option(None, "also write the plan's page to this new directory: plan.json, report.html, "
                               "report.md and the figures (step terms and memory per layout)", type=str,
                         metavar="DIR")
    calibration: str = option(None, "this-machine's calibration file (default ~/.cache/paralab/"
                                    "calibration-<host>.json)", type=str, metavar="FILE")
    recalibrate: bool = option(False, "this-machine: measure again even if a calibration is cached")


@dataclass
class ShapeOptions:
    """plan: the gpt's shape beyond what paralab's gpt builds (the planner counts it; `paralab train` builds the
    default of each: a GELU MLP of 4 x --embed, as many key/value heads as heads)"""
    ffn_hidden: int = option(None, "the MLP's hidden width F (default 4 x --embed)", type=integer, positive=True)
    kv_heads: int = option(None, "key/value heads G (grouped-query attention: --heads divisible by it; 1: "
                                 "multi-query; default --heads)", type=integer, positive=True)
    mlp: str = option("gelu", "gelu (two h x F matrices) or swiglu (three: gate, up, down; Llama's)",
                      choices=("gelu", "swiglu"))
    attention: str = option("eager", "what attention keeps for backward: eager (the s x s scores, softmax and "
                                     "dropout masks, Korthikanti et al.'s count) or flash (a log-sum-exp per token "
                                     "and head; FlashAttention)", choices=("eager", "flash"))
    shared_experts: int = option(0, "a mixture of experts' shared experts S (DeepSeekMoE's: every token runs them "
                                    "beside its --top-k routed ones; each of --expert-hidden; needs --experts)",
                                 minimum=0)
    tied_embeddings: bool = option(False, "the output layer is the token table's matrix (GPT-2's, GPT-3's, BLOOM's, "
                                          "Megatron-LM's default): counted once; under pipeline stages the last "
                                          "keeps a copy, its gradient all-reduced with the first stage's each step")


#: why a plan of a shape paralab's gpt does not build prints no command (Workload.shape_extras names the shape)
NOT_BUILT = ("paralab's gpt builds a GELU MLP of 4 x --embed with as many key/value heads as heads, eager "
             "attention, no shared experts and an output layer of its own (untied)")


#: the shape flags, as a sentence (for the errors that name them all)
SHAPE_FLAGS = " and ".join([", ".join(flag(f.name) for f in option_fields(ShapeOptions)[:-1]),
                           flag(option_fields(ShapeOptions)[-1].name)])


PINS = ("tp", "pp", "dp", "zero", "schedule", "microbatch", "recompute", "cp", "cp_method", "ep")
MOE = ("--experts", "--top-k", "--expert-hidden", "--capacity-factor")  # the mixture of experts' shape


def add_arguments(p) -> None:
    add_flags(p, ModelOptions, only=("--model", "--width"), defaults=dict(model="gpt"))
    add_flags(p, GPTOptions, only=("--layers", "--embed", "--heads", "--context"))
    add_flags(p, MoEOptions, only=MOE)
    add_flags(p, ShapeOptions)
    add_flags(p, PlanOptions)


def run(args) -> int:
    from ..analysis.plan import NoLayout, Setting, make_plan
    from ..analysis.plan.cluster import PRESETS
    if args.workers is None:
        raise UsageError("--workers is required: how many devices to lay the model out on")
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    check(args, PlanOptions)
    check(args, GPTOptions)
    check(args, ShapeOptions)
    if args.report and Path(args.report).exists():
        raise UsageError(f"--report {args.report} already exists; name a new directory (or remove it)")
    work = _workload(args)
    layout = _layout(args.layout, args.workers) if args.layout is not None else None  # before any cluster
    cluster, where = _cluster(args, PRESETS)
    precision = args.precision or ("mixed" if "bf16" in cluster.peak_tflops else "fp32")
    setting = Setting(args.global_batch, precision, args.optimizer)
    fixed = {k: getattr(args, k) for k in PINS if getattr(args, k) is not None}
    if layout is not None:
        return evaluate_one(args, work, cluster, where, setting, fixed, layout)
    bar = Progress(1, "plan", enabled=sys.stderr.isatty())  # a 1,024-device search takes tens of seconds

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done)

    try:
        plan = make_plan(work, cluster, setting, args.workers, fixed=fixed, top=args.top, progress=progress)
    except NoLayout as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # a cluster without the precision's peak, and the like
        raise UsageError(str(exc)) from None
    finally:
        bar.clear()
    command = layout_command(args, work, plan.ranked[0].layout, plan.workers)
    if args.json:
        print(json.dumps(to_json(plan, where, command), indent=1))
    else:
        show(plan, where, command)
        if args.model == "gpt" and args.vocab != BYTES:
            print(f"(the plan counts a {args.vocab}-token vocabulary; paralab's gpt reads bytes: {BYTES} tokens)")
    if args.report:
        page = write_report(to_json(plan, where, command), Path(args.report))
        print(f"plan page: {page}", file=sys.stderr if args.json else sys.stdout)
    return 0


def evaluate_one(args, work, cluster, where: str, setting, fixed: dict, layout) -> int:
    """``--layout``: that layout's row (fitting or not), whether it fits and by how much, its place in the search,
    and its command."""
    from ..analysis.plan import NoLayout, evaluate
    if fixed or args.report:
        given = ", ".join("--" + k.replace("_", "-") for k in fixed) or "--report"
        raise UsageError(f"--layout names every dimension of one layout; {given} would pin or report a search: drop "
                         "one of them")
    try:
        got = evaluate(work, cluster, setting, args.workers, layout)
    except (NoLayout, ValueError) as exc:
        raise UsageError(str(exc)) from None
    x, usable = got.prediction, cluster.memory_gb * 1e9 * cluster.usable_fraction
    parts = x.memory_parts
    fit = (f"fits: {x.memory / 1e9:.4g} GB of the {usable / 1e9:.4g} GB usable per device" if x.fits else
           f"does not fit: needs {x.memory / 1e9:.4g} GB per device (model states {parts['model_states'] / 1e9:.4g}"
           f" GB, activations {parts['activations'] / 1e9:.4g} GB), {(x.memory - usable) / 1e9:.4g} GB more than "
           f"the {usable / 1e9:.4g} GB usable ({cluster.memory_gb:g} GB x {cluster.usable_fraction:g})")
    command = layout_command(args, work, x.layout, args.workers)
    if args.json:
        print(json.dumps({"model": work.describe(), "workers": args.workers, "cluster": cluster.to_dict()
                          | {"from": where}, "evaluated": x.to_dict(), "fits": x.fits, "rank": got.rank,
                          "rank_all": got.rank_all, "fitting": got.plan.fitting if got.plan else 0,
                          "searched": len(got.plan.ranked) if got.plan else 0, "where": got.where(),
                          "command": command}, indent=1))
        return 0
    print(f"{work.describe()}; global batch {setting.global_batch}, {setting.precision} precision, "
          f"{setting.optimizer}; cluster {cluster.name}, {args.workers} devices (times in ms per step):\n")
    print(table([x], work))
    uneven = work.stages_note(x.layout.pp * x.layout.virtual)
    print(f"\n{fit}\nplace: {got.where()}\nrun it: {command}" + (f"\nstages: {uneven}" if uneven else ""))
    return 0


def write_report(plan: dict, out: Path) -> Path:
    """``out``/plan.json, report.html, report.md and plots/, written beside ``out`` and renamed into place
    at the end, so a failure leaves nothing half-written."""
    from ..report.plan_page import build_plan_report
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (tmp / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
        build_plan_report(plan, tmp).write(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "report.html"


def _given_shape(args) -> ShapeOptions:
    """The shape options as given, unchecked (each read by its declared name)."""
    return ShapeOptions(**{f.name: getattr(args, f.name) for f in option_fields(ShapeOptions)})


def _shape(args) -> ShapeOptions:
    """The gpt's shape options, checked against the heads (exit 2 saying what to change)."""
    shape = _given_shape(args)
    if shape.shared_experts and not args.experts:
        raise UsageError(f"--shared-experts {shape.shared_experts} are a mixture of experts' (every token runs them "
                         "beside its routed experts): give --experts E --top-k K too, or drop --shared-experts")
    if shape.kv_heads is not None and args.heads % shape.kv_heads:
        raise UsageError(f"--kv-heads {shape.kv_heads} must divide --heads {args.heads} (each key/value head serves "
                         "heads / kv-heads query heads)")
    if args.experts and shape.ffn_hidden is not None:
        raise UsageError("--ffn-hidden is the dense MLP's width; with --experts every block's MLP is the experts: "
                         "give their width with --expert-hidden")
    return shape


def _moe(args) -> dict:
    """The mixture-of-experts options, checked as ``paralab train`` checks them (exit 2 saying what to change)."""
    import dataclasses

    from ..models.moe import check_shape
    names = [name_of(x) for x in MOE]
    given = {n: getattr(args, n) for n in names}
    check(dataclasses.replace(MoEOptions(), **given), MoEOptions)
    changed = [flag(n) for n in names if given[n] != MoEOptions.__dataclass_fields__[n].default]
    check_shape(changed, args.model, args.model == "gpt", args.experts, args.top_k)
    return given if args.experts else {}


def _workload(args):
    from ..analysis.plan import cnn_workload, gpt_workload
    moe = _moe(args)
    if args.model == "gpt":
        if args.embed % args.heads:
            raise UsageError(f"--embed {args.embed} must be divisible by --heads {args.heads}")
        activations = args.activations if args.activations != "auto" else (
            "paralab" if args.cluster == "this-machine" else "published")
        shape = _shape(args)
        work = gpt_workload(args.layers, args.embed, args.heads, args.context, args.vocab, activations, **moe,
                            ffn_hidden=shape.ffn_hidden or 0, kv_heads=shape.kv_heads or 0, mlp=shape.mlp,
                            attention=shape.attention, shared_experts=shape.shared_experts,
                            tied_embeddings=shape.tied_embeddings)
        if activations == "paralab" and work.shape_extras():
            raise UsageError(f"--activations paralab counts what paralab's gpt keeps, and {NOT_BUILT}: drop "
                             f"{SHAPE_FLAGS}, or use --activations published (a cluster preset or file takes it by "
                             "default)")
        return work
    if _given_shape(args) != ShapeOptions():
        raise UsageError(f"{SHAPE_FLAGS} shape a gpt; --model {args.model} has none: use --model gpt or leave them "
                         "out")
    if args.ep not in (None, 1):
        raise UsageError(f"--ep {args.ep} splits a mixture of experts' experts; --model {args.model} has none: "
                         "use --model gpt --experts E or drop --ep")
    if args.tp not in (None, 1):
        raise UsageError(f"--tp {args.tp}: tensor parallelism is planned for the gpt only; leave out --tp")
    return cnn_workload(args.model, args.width)


def _layout(text: str, workers: int):
    """``--layout`` parsed, its words and its devices checked before a cluster is read or measured."""
    from ..analysis.plan.layouts import Layout, devices_problem
    try:
        layout = Layout.parse(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    problem = devices_problem(layout, workers)
    if problem:
        raise UsageError(f"--layout {text!r}: {problem}: change the layout's degrees or --workers")
    return layout


def _cluster(args, presets):
    from ..analysis.plan import load_cluster
    if args.cluster in presets:
        return presets[args.cluster], "preset"
    if args.cluster == "this-machine":
        from ..analysis.plan.calibrate import calibration, is_calibration, this_machine
        given = Path(args.calibration) if args.calibration else None
        if given is not None and (given.is_dir() or given.exists() and not is_calibration(given)):
            raise UsageError(f"--calibration {given} is not a calibration file paralab wrote, and measuring would "
                             "replace it: name a new file (or one `paralab plan --cluster this-machine` wrote)")
        dtype = "bf16" if args.precision == "mixed" else "fp32"
        cal, where = calibration(dtype, Path(args.calibration) if args.calibration else None, args.recalibrate,
                                 progress=not args.json, workers=args.workers)
        return this_machine(cal, args.workers, where), where
    return load_cluster(args.cluster), f"file {args.cluster}"


BYTES = 256  # paralab's gpt's vocabulary: byte tokens

#: the plan's --optimizer (the memory model's names) as `paralab train` spells it
TRAIN_OPTIMIZER = {"adam": {"optimizer": "adam"}, "sgd-momentum": {"optimizer": "sgd"},
                   "sgd": {"optimizer": "sgd", "momentum": 0.0}}


def layout_config(args, layout, workers: int):
    """The `paralab train` run of ``layout``: the planned model with its shape (and experts), the global batch,
    the optimizer whose state the plan counted, and every dimension, as RunConfig fields."""
    from ..run.config import RunConfig
    model = {"model": args.model, "width": args.width}
    if args.model == "gpt":
        model |= {k: getattr(args, k) for k in ("layers", "embed", "heads", "context")}
        model |= {name_of(x): getattr(args, name_of(x)) for x in MOE} if args.experts else {}
    return RunConfig(**model, **layout.run_options(workers), batch_size=args.global_batch,
                     **TRAIN_OPTIMIZER[args.optimizer])


def layout_command(args, work, layout, workers: int) -> str:
    """The command line of :func:`layout_config`, from the run options' own declaration (``to_argv``); a shape
    paralab's gpt does not build (``work.shape_extras()``) has none, and the line says why."""
    if work.shape_extras():
        return f"none: {NOT_BUILT}; this plan counts{work.shape_extras()}"
    from ..run.config import train_command
    return train_command(layout_config(args, layout, workers),
                         first=("workers", "model", "batch_size") + (("zero_stage",) if layout.zero else ()))


def _ms(x: float) -> str:
    return f"{x * 1e3:.4g}"


def table(predictions, work) -> str:
    """The plan's table: a row per prediction, its step's terms in ms, memory, MFU and throughput."""
    from ..report.page import text_table
    rows, moe = [], work.moe is not None
    for i, x in enumerate(predictions, 1):
        rows.append([i, x.layout.label(), _ms(x.step), _ms(x.compute), _ms(x.tp_comm), _ms(x.cp_comm)]
                    + ([_ms(x.ep_comm)] if moe else [])
                    + [_ms(x.bubble), _ms(x.pp_comm), _ms(x.dp_comm), _ms(x.optimizer), f"{x.memory / 1e9:.4g}",
                       f"{100 * x.mfu:.1f}", f"{x.tokens_per_s:.4g}"])
    per = "tokens/s" if work.kind == "gpt" else "samples/s"
    return text_table(["#", "layout", "step", "compute", "tp comm", "cp comm"] + (["ep comm"] if moe else [])
                      + ["bubble", "pp comm", "dp comm", "optim", "mem GB", "MFU %", per], rows)


def show(plan, where: str, command: str) -> None:
    from ..analysis.plan import why_first
    c, s = plan.cluster, plan.setting
    print(f"{plan.work.describe()}; global batch {s.global_batch}, {s.precision} precision, {s.optimizer}")
    print(f"cluster {c.name}" + ("" if where in c.source else f" ({where})") + f": {plan.workers} devices, {c.devices_per_node} per node, "
          f"{c.peak_tflops[s.dtype]:.4g} TFLOP/s peak {s.dtype} x efficiency {c.efficiency:.3g}"
          + (f" (the gpt's weight matmuls: a ramp, {min(e for _, e in c.ramp(s.dtype)):.3g} to "
             f"{max(e for _, e in c.ramp(s.dtype)):.3g} by size)" if c.ramp(s.dtype) else "") + f", {c.memory_gb:.4g} GB "
          f"({c.usable_fraction:g} usable), links {c.intra_gbps:.4g} Gb/s in a node, {c.inter_gbps:.4g} Gb/s between")
    print(f"  source: {c.source}")
    print(f"{plan.considered} layouts divide the model and the workers, {plan.fitting} fit in memory; the fastest "
          f"{len(plan.ranked)}, their bubbles from the schedule simulator (times in ms per step):\n")
    moe = plan.work.moe is not None
    print(table(plan.ranked, plan.work))
    best = plan.ranked[0]
    if len(plan.ranked) > 1:
        print("\nwhy: " + why_first(best, plan.ranked[1]))
    print(f"\nrun the first: {command}" + (f" (recomputation: {best.notes[0]})" if best.notes else ""))
    uneven = plan.work.stages_note(best.layout.pp * best.layout.virtual)
    if uneven:
        print(f"stages: {uneven}")
    print("columns: compute = the busiest rank's arithmetic; tp comm = tensor-parallel collectives (never "
          "overlapped); cp comm = context-parallel messages left exposed; " + ("ep comm = expert parallelism's token "
          "all-to-alls (synchronous); MFU counts the active FLOPs (top-k experts); " if moe else "") + "bubble = pipeline idle (simulated); pp comm = what transfers add; dp comm = data-parallel "
          "communication left exposed; mem = peak per device (model states + activations). docs/plan.md")


def to_json(plan, where: str, command: str) -> dict:
    from dataclasses import asdict

    from ..analysis.plan import why_first
    return {"model": plan.work.describe(), "shape": plan.work.shape, "workers": plan.workers,
            "cluster": plan.cluster.to_dict() | {"from": where}, "setting": asdict(plan.setting),
            "considered": plan.considered, "fitting": plan.fitting,
            "ranked": [x.to_dict() for x in plan.ranked],
            "why": why_first(plan.ranked[0], plan.ranked[1]) if len(plan.ranked) > 1 else "",
            "command": command}
