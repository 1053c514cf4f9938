"""The cost model, with the arithmetic shown: each formula, the numbers substituted, the result.

  memory      model-state bytes per worker: DDP and ZeRO stages 1, 2, 3 [--fp32-grads] [--offload optimizer]
              [--mp M]
  allreduce   gradient synchronisation time: ring all-reduce and gather/scatter through a root
  bubble      pipeline bubble (p-1)/(m+p-1) and microbatches alive, GPipe and 1F1B; --schedule zb-h1 |
              zb-h2 | interleaved-1f1b [--virtual-stages v]: that schedule's formulas and source;
              --forward-ms/--backward-ms [--weight-ms]: its step time and bubble at those times
  tp          tensor parallelism on the gpt: collectives, activation memory (by recomputation), FLOPs, MFU
  cp          context parallelism on the gpt: ring or all-to-all messages, causal work per rank (a run's
              recorded messages and attention time per rank beside them)
  moe         a mixture-of-experts gpt: parameters and FLOPs active vs total, expert parallelism's all-to-all
              bytes (an even load, or a run's measured one) and model-state memory per rank
  comm        model/pipeline traffic at the partition boundaries (the real partition)
  run         from a run directory: achieved bandwidth and utilisation (HPML Lab 4 Q3.2),
              predicted vs measured communication time, measured vs predicted bubble

Units: bytes with 1 GB = 10^9 B; --bandwidth in gigabits per second (Gb/s);
--latency in microseconds.

examples:
  paralab calc memory --parameters 7.5e9 --workers 64 --optimizer adam --precision mixed
  paralab calc memory --model vgg11 --workers 4
  paralab calc allreduce --parameters 10e9 --precision fp16 --workers 8 --bandwidth 100
  paralab calc allreduce --model vgg11 --workers 4 --bandwidth 10 --latency 50 --per-tensor
  paralab calc bubble --stages 4 --microbatches 1,4,8,32
  paralab calc bubble --schedule interleaved-1f1b --stages 4 --microbatches 8 --virtual-stages 2
  paralab calc comm --model vgg11 --workers 4 --batch-size 256
  paralab calc moe --experts 8 --top-k 2 --ep 4 --tokens 2048
  paralab calc cp --cp 4 --context 4096 --embed 768 --heads 12 --layers 12 --batch-size 1
  paralab calc run runs/ddp-w2-20250101-120000 --bandwidth 10
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UsageError
from ..models import GPTOptions, ModelOptions, MoEOptions
from ..options import add_flags, finite_float, flag, integer

HELP = "the cost model with the arithmetic shown: memory, allreduce, bubble, comm, run"

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _parent_parser(p):
    return type(p)


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT", parser_class=_parent_parser(p))

    q = sub.add_parser("memory", help="model-state bytes per worker: DDP and ZeRO 1/2/3",
                       description="Bytes per worker of parameters, gradients and optimizer state for DDP and "
                                   "ZeRO stages 1, 2, 3 (Rajbhandari et al. 2020). With a RUN directory instead: "
                                   "each rank's measured memory (model states and the peak of saved activations) "
                                   "beside the planner's prediction for the run's layout, which knows tp, pp, cp, "
                                   "HSDP and recomputation (docs/plan.md).")
    q.add_argument("run", nargs="?", metavar="RUN", help="a finished run directory (then no other option)")
    _size_options(q, bytes_option=False, required=False)
    q.add_argument("--workers", type=integer, help="data-parallel workers N")
    q.add_argument("--optimizer", default="sgd-momentum", help="sgd | sgd-momentum | adam (default %(default)s)")
    q.add_argument("--precision", default="fp32",
                   help="fp32 | mixed (fp16/bf16 parameters and gradients, fp32 optimizer state and master "
                        "weights) (default %(default)s)")
    q.add_argument("--stage", help="only these stages, e.g. 0,3 (0 = DDP; default all)")
    q.add_argument("--unit-parameters", type=finite_float,
                   help="the largest unit's parameter count, for the working set and peak of stages 1-3 "
                        "(default with --model: its largest unit)")
    q.add_argument("--step-in-backward", action="store_true",
                   help="stages 2-3 step each unit's shard in backward (paralab fsdp's default): one "
                        "gradient shard held at a time")
    q.add_argument("--fp32-grads", action="store_true",
                   help="with --precision mixed: an fp32 copy of the gradients beside the optimizer state, as "
                        "DeepSpeed's estimators count it (4 Psi/N at stages 1-2; at stage 3 it replaces the 16-bit "
                        "gradient shard: +2 Psi/N)")
    q.add_argument("--offload", metavar="optimizer",
                   help="optimizer: the optimizer state (and any fp32 gradients) on the host (ZeRO-Offload): "
                        "prints the device's bytes (parameters and gradients) and the host's")
    q.add_argument("--mp", type=integer, default=1,
                   help="model-parallel degree M (tensor or pipeline): each device holds Psi/M parameters before "
                        "the data-parallel sharding over --workers N (N x M devices; default %(default)s)")
    q.add_argument("--replicate", type=integer, default=1,
                   help="HSDP: the N workers as R replica groups of N/R, each sharding the model states over its "
                        "N/R (ZeRO stages then divide by N/R, not N; default %(default)s: plain sharding)")
    q.add_argument("--json", action="store_true", help="print JSON instead of the arithmetic")
    q.set_defaults(calc=calc_memory)

    q = sub.add_parser("allreduce", help="gradient synchronisation time: ring and gather/scatter",
                       description="Time to average S bytes of gradients over N workers: ring all-reduce "
                                   "2(N-1)/N x S/B + 2(N-1) x latency, and gather/scatter through a root.")
    _size_options(q, bytes_option=True)
    q.add_argument("--precision", default="fp32", help="gradient precision: fp32 | fp16 | bf16 (default %(default)s)")
    q.add_argument("--workers", type=integer, required=True, help="workers N")
    q.add_argument("--bandwidth", type=finite_float, required=True, help="link bandwidth B in Gb/s (gigabits per second)")
    q.add_argument("--latency", type=finite_float, default=0.0, help="per-message latency in microseconds (default 0)")
    q.add_argument("--messages", type=integer, default=1,
                   help="separate all-reduce calls (one per tensor or bucket), each paying the latency")
    q.add_argument("--per-tensor", action="store_true",
                   help="with --model: one call per parameter tensor (as the allreduce strategy does)")
    q.set_defaults(calc=calc_allreduce)

    q = sub.add_parser("bubble", help="pipeline bubble and microbatches alive (GPipe, 1F1B)",
                       description="Idle fraction of a p-stage pipeline with m microbatches, (p-1)/(m+p-1), "
                                   "and the microbatches each stage keeps alive under GPipe and 1F1B.")
    q.add_argument("--stages", "--workers", dest="stages", type=integer, required=True, help="pipeline stages p")
    q.add_argument("--microbatches", default="4", help="m, or a comma list such as 1,2,4,8 (default %(default)s)")
    q.add_argument("--forward-ms", type=finite_float,
                   help="T_F: one stage's forward of one microbatch (ms; with --schedule, one rank's over all its "
                        "stages): adds the ideal step time, and with --schedule the bubble at these times")
    q.add_argument("--backward-ms", type=finite_float,
                   help="T_B: one stage's backward of one microbatch (ms, default 2 x forward; a zero-bubble "
                        "schedule splits it evenly into T_I and T_W); with --weight-ms, T_I alone")
    q.add_argument("--weight-ms", type=finite_float,
                   help="T_W: the weight-gradient part of the backward (ms); --backward-ms is then T_I, the "
                        "input-gradient part (zero bubble, Qi et al. 2024); a schedule that runs the backward "
                        "whole takes T_B = T_I + T_W")
    q.add_argument("--schedule", help="one schedule's bubble and peak activation memory, with its source: "
                                      "gpipe | 1f1b | zb-h1 | zb-h2 | interleaved-1f1b (default: GPipe and 1F1B)")
    q.add_argument("--virtual-stages", type=integer, default=None,
                   help="interleaved-1f1b: stages per rank v (default 2)")
    q.set_defaults(calc=calc_bubble)

    q = sub.add_parser("tp", help="tensor parallelism on the gpt: communication, activation memory, FLOPs, MFU",
                       description="Per microbatch: every tensor-parallel collective (calls and bytes), activation "
                                   "memory per block with and without sequence parallelism and over the model "
                                   "with none, selective or full recomputation (Korthikanti et al. 2022, Table 2, "
                                   "sec. 4.3), training FLOPs per token (6N + 12 L h s, N without the embedding "
                                   "tables: Kaplan et al. 2020, Narayanan et al. 2021). The parameters are counted "
                                   "from the shape, so a published shape runs in no time. With RUN: the shape from the "
                                   "run, the collectives it recorded per step beside the prediction, and its MFU.")
    q.add_argument("run", nargs="?", help="a run directory of --model gpt with --tp (optional)")
    add_flags(q, GPTOptions, only=("--layers", "--embed", "--heads", "--context"))
    q.add_argument("--vocab", type=integer, default=256,
                   help="vocabulary V (default %(default)s: paralab's byte tokens; 50257 for GPT-2/GPT-3)")
    q.add_argument("--batch-size", type=integer, default=8, help="sequences per microbatch b")
    q.add_argument("--tp", type=integer, default=2)
    q.add_argument("--sequence-parallel", action="store_true")
    q.add_argument("--peak-tflops", type=finite_float,
                   help="peak FLOP/s for MFU (default with RUN: this machine's measured fp32 matmul rate per "
                        "core, times the run's workers; stated as such)")
    q.set_defaults(calc=calc_tp)

    q = sub.add_parser("cp", help="context parallelism on the gpt: ring / all-to-all messages, work per rank",
                       description="Per microbatch: every context-parallel message (sends, or all-to-alls, and "
                                   "bytes) of ring attention or Ulysses, and the causal attention work per cp rank "
                                   "with and without load balancing. With RUN: the shape from the run, the "
                                   "messages it recorded per step beside the prediction, and each cp rank's "
                                   "measured attention time.")
    q.add_argument("run", nargs="?", help="a run directory of --model gpt with --cp (optional)")
    add_flags(q, GPTOptions, only=("--layers", "--embed", "--heads", "--context"))
    q.add_argument("--batch-size", type=integer, default=8, help="sequences per microbatch b")
    q.add_argument("--cp", type=integer, default=2)
    q.add_argument("--tp", type=integer, default=1)
    q.add_argument("--cp-method", default="ring", choices=("ring", "all-to-all"))
    q.add_argument("--precision", default="fp32", choices=("fp32", "fp64"))
    q.set_defaults(calc=calc_cp)

    q = sub.add_parser("moe", help="a mixture-of-experts gpt: active vs total, all-to-all bytes, memory per rank",
                       description="Parameters and training FLOPs per token, active (top-k experts) vs total; "
                                   "under --ep the token all-to-all's bytes per rank and step (dispatch and "
                                   "combine, forward and backward) under an even load, and the model-state "
                                   "bytes a rank holds. With RUN: its shape, and the bytes its measured load "
                                   "predicts beside those it recorded.")
    q.add_argument("run", nargs="?", help="a run directory of --model gpt --experts E (optional)")
    add_flags(q, GPTOptions, only=("--layers", "--embed", "--context"))
    add_flags(q, MoEOptions, only=("--experts", "--top-k", "--expert-hidden", "--capacity-factor"),
              defaults=dict(experts=8))
    q.add_argument("--ep", type=integer, default=2, help="expert-parallel ranks (default %(default)s)")
    q.add_argument("--tokens", type=integer, default=2048, help="tokens per rank and forward (default %(default)s)")
    q.add_argument("--precision", default="fp32", choices=("fp32", "fp64"))
    q.add_argument("--optimizer", default="sgd-momentum", choices=("sgd", "sgd-momentum", "adam"))
    q.set_defaults(calc=calc_moe)

    q = sub.add_parser("comm", help="bytes crossing the partition boundaries per step (model / pipeline)",
                       description="Cut the model as `paralab train model|pipeline` would and count the "
                                   "activations sent forward and gradients sent back at each boundary.")
    add_flags(q, ModelOptions, only=("--model", "--width", "--norm"))
    q.add_argument("--workers", type=integer, required=True, help="stages (one per worker)")
    q.add_argument("--batch-size", type=integer, default=256, help="global batch (default %(default)s)")
    q.add_argument("--microbatches", type=integer, default=1, help="microbatches per step (messages, not bytes)")
    q.add_argument("--partition", default="params",
                   help="balanced (measures unit times here) | params | counts such as 2,3,8 "
                        "(default %(default)s: deterministic; a run's own cut is in its summary)")
    q.add_argument("--bandwidth", type=finite_float, help="link bandwidth in Gb/s: adds the transfer time")
    q.set_defaults(calc=calc_comm)

    q = sub.add_parser("run", help="bandwidth utilisation and predicted vs measured comm of a run",
                       description="From a run directory: bytes and time of each communication operation, "
                                   "achieved bandwidth, HPML Lab 4 Q3.2's bandwidth utilisation, the ring "
                                   "all-reduce prediction beside the measurement, and a pipeline's bubble.")
    q.add_argument("run", help="run directory written by `paralab train`")
    q.add_argument("--bandwidth", type=finite_float, help="link bandwidth in Gb/s: adds predictions and link share "
                   "(default: the link rate of a run made with --network)")
    q.add_argument("--latency", type=finite_float, default=0.0, help="per-message latency in microseconds (default 0)")
    q.set_defaults(calc=calc_run)


def calc_memory_run(run_dir: Path, as_json: bool) -> int:
    """Each rank's measured memory (``run/held.py``) beside the planner's prediction (``from_run.py``)."""
    from ..analysis.runs import load_run
    from ..report.page import text_table
    run = load_run(run_dir)
    rows, out = [], []
    for rank in sorted(run.details, key=int):
        held = (run.details[rank] or {}).get("held")
        if not held:
            continue
        measured = held["model_states_total_bytes"] + held["saved_activations_peak_bytes"]
        pred = held.get("predicted") or {}
        total = pred.get("total_bytes")
        out.append({"rank": int(rank), "measured": held, "predicted": pred})
        rows.append([rank, *(f"{held['model_states_bytes'][k] / 1e6:.3f}"
                             for k in ("parameters", "gradients", "optimizer", "other")),
                     f"{held['saved_activations_peak_bytes'] / 1e6:.3f}", f"{measured / 1e6:.3f}",
                     "-" if total is None else f"{pred['model_states_bytes'] / 1e6:.3f}",
                     "-" if total is None else f"{pred['activations_bytes'] / 1e6:.3f}",
                     "-" if total is None else f"{total / 1e6:.3f}",
                     "-" if total is None else f"{100 * (total - measured) / measured:+.1f}%"])
    if not rows:
        raise UsageError(f"{run_dir} has no measured memory (runs record it since the held record; "
                         "train it again)")
    if as_json:
        print(json.dumps(out, indent=1))
        return 0
    pred = out[0]["predicted"]
    print(f"{run_dir}: measured in the first step of the run (run/held.py); predicted by the planner's memory "
          f"model for {pred.get('layout', 'no layout')} (analysis/plan/from_run.py). MB = 1e6 bytes; a sum of "
          "peaks on both sides")
    if "why_not" in pred:
        print(f"no prediction: {pred['why_not']}")
    print(text_table(["rank", "params", "grads", "optimizer", "other", "saved act.", "measured", "pred. states",
                      "pred. act.", "predicted", "error"], rows))
    return 0


def _size_options(q, bytes_option: bool, required: bool = True) -> None:
    g = q.add_mutually_exclusive_group(required=required)
    g.add_argument("--parameters", type=finite_float, help="parameter count Psi (e.g. 7.5e9)")
    add_flags(g, ModelOptions, only=("--model",), defaults=dict(model=None))  # or --parameters
    if bytes_option:
        g.add_argument("--bytes", type=finite_float, help="message size S in bytes")
    add_flags(q, ModelOptions, only=("--width",))


def run(args) -> int:
    return args.calc(args)


# ======================================================================== helpers
def _model_size(name: str, width: float):
    from ..models import MODELS, build_model
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if width <= 0:
        raise UsageError("--width must be positive")
    model = build_model(name, width=width)
    return model


def _parameters(args, model=None) -> tuple[int, str, list[int]]:
    """(parameter count, where it came from, per-tensor sizes if a model was named).

    ``model``: the model ``--model`` names, when the caller has built it already.
    """
    if args.model:
        model = model if model is not None else _model_size(args.model, args.width)
        sizes = [p.numel() for p in model.parameters()]
        return sum(sizes), f"{args.model} (width {args.width}): {sum(sizes):,} parameters in {len(sizes)} tensors", sizes
    if args.parameters is None or args.parameters <= 0 or not math.isfinite(args.parameters):
        raise UsageError("--parameters must be a positive number such as 7.5e9")
    return int(round(args.parameters)), f"{int(round(args.parameters)):,} parameters", []


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise UsageError(f"--{name} must be positive (got {value})")


def _print(*formulas) -> None:
    for f in formulas:
        print(f.text())
        print()


# ======================================================================== memory
def calc_memory(args) -> int:
    from ..analysis.memory import OPTIMIZERS, PRECISIONS, STAGE_NAMES, memory_per_worker
    if args.run:
        if args.workers or args.parameters or args.model:
            raise UsageError("calc memory RUN reads the run's own layout: leave out --workers/--parameters/--model")
        return calc_memory_run(Path(args.run), args.json)
    if args.workers is None or not (args.parameters or args.model):
        raise UsageError("calc memory needs --workers and one of --parameters/--model (or a RUN directory)")
    _positive("workers", args.workers)
    if args.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {args.optimizer!r})")
    if args.precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)} (got {args.precision!r}); "
                         "mixed = fp16/bf16 parameters and gradients with an fp32 optimizer")
    stages = [0, 1, 2, 3]
    if args.stage:
        try:
            stages = [int(s) for s in args.stage.split(",")]
        except ValueError:
            raise UsageError(f"--stage takes stage numbers such as 0,3 (got {args.stage!r})") from None
        if any(s not in STAGE_NAMES for s in stages):
            raise UsageError("--stage: stages are 0 (DDP), 1, 2, 3")
    model = _model_size(args.model, args.width) if args.model else None
    psi, source, _ = _parameters(args, model)
    if args.offload not in (None, "optimizer"):
        raise UsageError(f"--offload takes optimizer (the optimizer state on the host; got {args.offload!r})")
    if args.fp32_grads and args.precision != "mixed":
        raise UsageError("--fp32-grads is an fp32 copy of 16-bit gradients: it needs --precision mixed "
                         "(with fp32 the gradients are fp32 already)")
    if args.mp < 1 or psi % args.mp:
        raise UsageError(f"--mp must be a positive divisor of the {psi:,} parameters (each of the M model-parallel "
                         f"devices holds Psi/M; got {args.mp})")
    unit = args.unit_parameters
    if unit is None and model is not None:
        unit = max(sum(p.numel() for p in u.parameters()) for u in model)
    elif unit is not None and not (0 < unit <= psi):
        raise UsageError(f"--unit-parameters must be positive and at most the model's {psi:,} parameters")
    if args.step_in_backward and unit is None:
        raise UsageError("--step-in-backward needs the largest unit: pass --model or --unit-parameters")
    unit = None if unit is None else int(unit)
    if args.replicate < 1 or args.workers % args.replicate:
        raise UsageError(f"--replicate must be a positive divisor of --workers {args.workers} (R replica groups of "
                         f"N/R workers; got {args.replicate})")
    shard = args.workers // args.replicate  # HSDP: what the model states are sharded over
    estimates = [memory_per_worker(psi, shard, s, args.optimizer, args.precision, unit_parameters=unit,
                                   step_in_backward=args.step_in_backward and s >= 2, fp32_grads=args.fp32_grads,
                                   offload=args.offload, model_parallel=args.mp) for s in stages]
    if args.json:
        print(json.dumps([e.to_dict() for e in estimates], indent=2))
        return 0
    print(f"model states per worker: {source}, N = {args.workers} workers, {args.optimizer}, {args.precision}"
          + (f"; model parallelism M = {args.mp}: Psi = {psi:,} / {args.mp} = {psi // args.mp:,} per device, "
             f"{args.workers * args.mp:,} devices" if args.mp > 1 else "")
          + ("; fp32 gradient copy (DeepSpeed's accounting)" if args.fp32_grads else "")
          + ("; optimizer state offloaded to the host" if args.offload else "")
          + (f"; HSDP: {args.replicate} replica groups x {shard} workers, the ZeRO stages shard over N = {shard}"
             if args.replicate > 1 else "") + "\n")
    for e in estimates:
        print(e.text())
        print()
    from ..report.page import text_table
    header = ["strategy", "parameters", "gradients", "optimizer state", "total per worker"]
    rows = [[e.name, _gb(e.params.value), _gb(e.grads.value), _gb(e.optimizer_state.value), _gb(e.total)]
            for e in estimates]
    if args.fp32_grads:
        header.insert(4, "fp32 grads")
        for row, e in zip(rows, estimates):
            row.insert(4, _gb(e.fp32_grads.value))
    if args.offload:
        header += ["device", "host"]
        for row, e in zip(rows, estimates):
            row += [_gb(e.device), _gb(e.host)]
    if unit is not None:  # the working set of the largest unit, and the resident peak it gives
        header += ["working set", "peak"]
        for row, e in zip(rows, estimates):
            row += [_gb(e.working.value) if e.working is not None else "-", _gb(e.peak)]
    print(text_table(header, rows))
    return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:.4g} GB" if n >= 1e8 else f"{n / 1e6:.4g} MB"


# ======================================================================== all-reduce
def calc_allreduce(args) -> int:
    from ..analysis.cost import allreduce_bytes_per_rank, gather_scatter_time, ring_allreduce_time
    _positive("workers", args.workers)
    _positive("bandwidth", args.bandwidth)
    _positive("messages", args.messages)
    if args.latency < 0:
        raise UsageError("--latency must be zero or positive (microseconds)")
    if args.precision not in ELEMENT_BYTES:
        raise UsageError(f"--precision must be one of {', '.join(ELEMENT_BYTES)} (got {args.precision!r})")
    messages = args.messages
    if args.bytes is not None:
        _positive("bytes", args.bytes)
        size, source = args.bytes, f"S = {args.bytes:g} B"
        if args.per_tensor:
            raise UsageError("--per-tensor needs --model (it counts the model's parameter tensors)")
    else:
        psi, source, sizes = _parameters(args)
        e = ELEMENT_BYTES[args.precision]
        size = psi * e
        source += f"; S = {psi:,} x {e} B ({args.precision} gradients) = {size:,} B"
        if args.per_tensor:
            if not sizes:
                raise UsageError("--per-tensor needs --model (it counts the model's parameter tensors)")
            messages = len(sizes)
    print(f"gradient synchronisation: {source}; N = {args.workers}; B = {args.bandwidth:g} Gb/s; "
          f"a = {args.latency:g} us; k = {messages} call(s)\n")
    lat = args.latency * 1e-6
    ring = ring_allreduce_time(size, args.workers, args.bandwidth, lat, messages)
    gs = gather_scatter_time(size, args.workers, args.bandwidth, lat, messages)
    _print(allreduce_bytes_per_rank(size, args.workers), ring, gs)
    if ring.value > 0:
        print(f"gather/scatter takes {gs.value / ring.value:.2f}x the ring's time at N = {args.workers}")
    return 0


# ======================================================================== bubble
def calc_bubble(args) -> int:
    from ..analysis.cost import bubble_fraction, ideal_step_time, in_flight_formula
    _positive("stages", args.stages)
    try:
        ms = [int(m) for m in str(args.microbatches).split(",") if m.strip()]
    except ValueError:
        raise UsageError(f"--microbatches takes integers such as 4 or 1,2,4,8 (got {args.microbatches!r})") from None
    if not ms or any(m < 1 for m in ms):
        raise UsageError("--microbatches must be positive")
    times = _stage_times(args)
    p = args.stages
    if args.schedule is not None or args.virtual_stages is not None:
        return _calc_schedule_bubble(args, p, ms, times)
    if times is not None and args.weight_ms is not None:
        print(f"GPipe and 1F1B: each runs each backward whole, T_B = T_I + T_W = "
              f"{args.backward_ms:g} + {args.weight_ms:g} = {times[1] + times[2]:g} ms\n")
    rows = []
    for m in ms:
        print(f"--- p = {p} stages, m = {m} microbatches")
        fs = [bubble_fraction(p, m), in_flight_formula("gpipe", p, m), in_flight_formula("1f1b", p, m)]
        if times is not None:
            fs.append(ideal_step_time(p, m, times[0] / 1e3, (times[1] + times[2]) / 1e3))
        _print(*fs)
        rows.append([m, f"{fs[0].value:.1f}", fs[1].value, fs[2].value])
    if len(ms) > 1:
        from ..report.page import text_table
        print(text_table(["microbatches", "bubble %", "alive GPipe (any stage)", "alive 1F1B (stage 0)"], rows))
    return 0


def _stage_times(args) -> tuple[float, float, float] | None:
    """(T_F, T_I, T_W) in ms from --forward-ms, --backward-ms, --weight-ms (None without --forward-ms): without
    --weight-ms the backward (default 2 T_F) splits evenly into T_I and T_W."""
    given = [flag(n) for n in ("backward_ms", "weight_ms") if getattr(args, n) is not None]
    if args.forward_ms is None:
        if given:
            raise UsageError(f"{' and '.join(given)} needs --forward-ms (T_F, ms): the times go together")
        return None
    for name in ("forward_ms", "backward_ms", "weight_ms"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag(name)} must be a positive time in ms (got {value:g})")
    if args.weight_ms is not None:
        if args.backward_ms is None:
            raise UsageError("--weight-ms (T_W) needs --backward-ms, which is then T_I, the input-gradient part")
        return args.forward_ms, args.backward_ms, args.weight_ms
    tb = args.backward_ms if args.backward_ms is not None else 2 * args.forward_ms
    return args.forward_ms, tb / 2, tb / 2


def _calc_schedule_bubble(args, p: int, ms: list[int], times) -> int:
    """``--schedule NAME``: that schedule's bubble and peak activation memory formulas, substituted; with
    stage times, its ideal step time and bubble at those times, closed form and simulated."""
    from ..analysis.cost import SCHEDULE_SOURCES, schedule_bubble, schedule_memory, schedule_times
    from ..strategies.pipeline.schedules import REGISTRY
    from ..strategies.pipeline.schedules import VIRTUAL, layout_problem
    name = args.schedule or "interleaved-1f1b"
    if name not in SCHEDULE_SOURCES:
        raise UsageError(f"--schedule must be one of {', '.join(SCHEDULE_SOURCES)} (got {name!r})")
    v = args.virtual_stages if args.virtual_stages is not None else (2 if name in VIRTUAL else 1)
    rows = []
    for m in ms:
        problem = layout_problem(name, p, m, v)
        if problem:
            raise UsageError(problem)
    for m in ms:
        print(f"--- {name}: p = {p} ranks, m = {m} microbatches" + (f", v = {v} stages per rank" if v > 1 else ""))
        fs = [schedule_bubble(name, p, m, v), schedule_memory(name, p, m, v)]
        _print(*fs)
        if times is not None:
            tf, ti, tw = times
            if REGISTRY[name].split_backward and args.weight_ms is None:
                print(f"{name} splits each backward: T_B = {ti + tw:g} ms as T_I = T_W = {ti:g} ms "
                      "(give --weight-ms for another split)")
            elif not REGISTRY[name].split_backward and args.weight_ms is not None:
                print(f"{name} runs each backward whole: T_B = T_I + T_W = {ti + tw:g} ms")
            _print(schedule_times(name, p, m, v, forward_s=tf / 1e3, input_s=ti / 1e3, weight_s=tw / 1e3))
        rows.append([m, f"{fs[0].value:.1f}", f"{fs[1].value:g}"])
    if len(ms) > 1:
        from ..report.page import text_table
        print(text_table(["microbatches", "bubble %", "peak alive (busiest rank)"], rows))
    return 0


# ======================================================================== comm (partition)
def calc_tp(args) -> int:
    from ..analysis.cost import fmt_bytes as fmt
    from ..analysis.tensor import (RECOMPUTE, activation_memory, activation_total, gpt_flops_per_token,
                                   tp_communication)
    from ..models.gpt import VOCAB, parameter_counts
    run = None
    if args.run:
        from ..analysis.runs import load_run
        run = load_run(args.run)
        if not is_tp_gpt_run(run):
            raise UsageError(f"{args.run} is not a --model gpt run with tensor parallelism: nothing to compare")
        shape = run.config["mesh"]["shape"]
        for k in ("layers", "embed", "heads", "context", "sequence_parallel"):
            setattr(args, k, run.config[k])
        args.tp, args.vocab = shape["tp"], VOCAB
        _, args.batch_size = _tp_microbatches(run)
    for name in ("layers", "embed", "heads", "context", "vocab", "batch_size", "tp"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.embed % args.heads or args.heads % args.tp:
        raise UsageError("--embed must be divisible by --heads, and --heads by --tp")
    b, s, h, a, L, t, V = args.batch_size, args.context, args.embed, args.heads, args.layers, args.tp, args.vocab
    sp = args.sequence_parallel
    c = parameter_counts(L, h, s, V)
    print(f"gpt: L={L} h={h} a={a} s={s} V={V}: {c['total']:,} parameters (token table {c['tokens']:,}, "
          f"position table {c['positions']:,}, blocks {c['blocks']:,}, head {c['head']:,}); "
          f"b={b} sequences per microbatch, tp {t}" + (" + sequence parallelism" if sp else "") + "\n")
    comm = tp_communication(b, s, h, L, t, sp)
    _print(comm, activation_memory(b, s, h, a, 1, False), activation_memory(b, s, h, a, t, False),
           activation_memory(b, s, h, a, t, True), gpt_flops_per_token(L, h, s, V))
    print("per microbatch:  " + ", ".join(f"{k} {calls} x ({fmt(size)})" for k, (calls, size) in
                                        comm.parts["messages"].items()))
    from ..report.page import text_table
    totals = [activation_total(b, s, h, a, L, t, sp, r, V) for r in RECOMPUTE]
    print(f"\nactivation memory per rank over the {L} blocks, by recomputation (Korthikanti et al. 2022, Table 2 "
          f"and sec. 4.3; tp {t}" + (" + sp" if sp else "") + ", no pipeline):")
    print(text_table(["recompute", "per block", f"x {L} blocks", "+ embedding, head, loss", "total"],
                     [[r, fmt(f.parts["per_block"]), fmt(f.parts["blocks"]), fmt(f.parts["ends"]), fmt(f.value)]
                      for r, f in zip(RECOMPUTE, totals)]))
    print(f"  {totals[-1].formula}; 16-bit activations with dropout masks, as published")
    if t == 1:  # paralab's own gpt (--recompute; training/recompute.py), as the tests measure it
        from ..analysis.tensor import gpt_saved_bytes
        ours = [gpt_saved_bytes(b, s, h, a, L, r, 4, V) for r in RECOMPUTE]
        print("\nparalab's gpt (--recompute), fp32, one process: what autograd keeps (saved_tensors_hooks):")
        print(text_table(["recompute", "per block", f"x {L} blocks", "+ embedding, head, loss", "total"],
                         [[r, fmt(f.parts["per_block"]), fmt(f.parts["blocks"]), fmt(f.parts["ends"]), fmt(f.value)]
                          for r, f in zip(RECOMPUTE, ours)]))
        print("  none/selective per block: e (16 s b h + 4 s b [+ a s b]); full: e s b h (its input only)")
    if run is not None:
        tp_run_table(run, args.peak_tflops)
    return 0


def calc_cp(args) -> int:
    from ..analysis.context import causal_work, cp_communication
    from ..analysis.cost import fmt_bytes as fmt
    run = None
    if args.run:
        from ..analysis.runs import load_run
        run = load_run(args.run)
        shape = run.config.get("mesh", {}).get("shape", {})
        if run.config.get("model") != "gpt" or shape.get("cp", 1) < 2:
            raise UsageError(f"{args.run} is not a --model gpt run with --cp: nothing to compare")
        for k in ("layers", "embed", "heads", "context", "cp_method", "precision"):
            setattr(args, k, run.config[k])
        args.cp, args.tp = shape["cp"], shape["tp"]
        _, args.batch_size = _tp_microbatches(run)
    for name in ("layers", "embed", "heads", "context", "batch_size", "cp", "tp"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.embed % args.heads or args.heads % args.tp or args.context % args.cp:
        raise UsageError("--embed must be divisible by --heads, --heads by --tp, --context by --cp")
    b, s, h, L, C, t = args.batch_size, args.context, args.embed, args.layers, args.cp, args.tp
    e = 8 if args.precision == "fp64" else 4
    comm = cp_communication(b, s, h, L, C, args.cp_method, t, e)
    print(f"gpt: L={L} h={h} a={args.heads} s={s}; b={b} sequences per microbatch, cp {C}" +
          (f" x tp {t}" if t > 1 else "") + f", {args.cp_method}, {args.precision}\n")
    _print(comm)
    print("per microbatch:  " + ", ".join(f"{k} {calls} x ({fmt(size)})" for k, (calls, size) in
                                        comm.parts["messages"].items()))
    from ..analysis.tensor import activation_total
    whole = activation_total(b, s, h, args.heads, L, t, False, "selective")
    mine = activation_total(b, s // C, h, args.heads, L, t, False, "selective")
    print(f"activation memory per rank without attention scores (Korthikanti et al. 2022 Table 2, 16-bit, as "
          f"published; neither cp method keeps scores: the ring saves q, k, v, out and the log-sum-exp, Ulysses' "
          f"attention is fused): {fmt(whole.value)} on one rank, {fmt(mine.value)} with cp {C} (s / C = {s // C} "
          f"tokens)")
    for balanced in (True, False):
        work = causal_work(s, C, balanced)
        print(f"causal attention scores per cp rank, {'balanced' if balanced else 'contiguous'}: "
              + ", ".join(f"{w:,}" for w in work) + f" (max / mean {max(work) * C / sum(work):.2f})")
    if run is not None:
        cp_run_table(run, comm)
    return 0


def cp_run_table(run, comm) -> None:
    """A gpt run with --cp: each cp message it recorded per measured step (dp 0, cp 0, tp 0 of every stage,
    sends only: each has its receive) beside the cost model's, and each cp rank's attention time."""
    from ..analysis.timeline import measured_steps
    c, shape = run.config, run.config["mesh"]["shape"]
    micro, _ = _tp_microbatches(run)
    per_stage = shape["dp"] * shape["cp"] * shape["tp"]
    stage_ranks = [p * per_stage for p in range(shape["pp"])]
    spans = [sp for sp in run.spans if sp["rank"] in stage_ranks and sp["category"] == "comm"
             and sp["step"] >= 0 and sp.get("args", {}).get("op") != "recv" and not sp["name"].startswith("wait:")]
    steps = measured_steps(sorted({sp["step"] for sp in spans}), int(c.get("warmup", 1)))
    if not steps:
        raise UsageError(f"{run.path} has no measured step (all within --warmup)")
    e = 8 if c["precision"] == "fp64" else 4
    print(f"\n{run.path}: context parallelism per step ({len(steps)} measured), {micro} microbatch(es), "
          f"recorded on rank(s) {', '.join(map(str, stage_ranks))} (cp 0 of each stage):")
    print(f"  {'message':<28}{'predicted':>22}{'measured':>22}")
    # a zero-bubble schedule splits each backward in two (I, then W), and both walk back through the attention
    # core, so its backward messages happen twice (the records say so: backward_input spans)
    split = 2 if any(sp["name"] == "backward_input" for sp in run.spans if sp["category"] == "compute") else 1
    if split > 1:
        print("  (the backward is split in two, I and W, as zero-bubble schedules do: each part runs the attention "
              "backward, so its messages are counted twice)")
    rows = {k: (calls * micro * (split if k.endswith("_backward") else 1),
                size * micro * (split if k.endswith("_backward") else 1))
            for k, (calls, size) in comm.parts["messages"].items()}
    rows["cp_loss_all_reduce"] = (1, e)  # on the stage that has the loss
    for k, (calls, size) in rows.items():
        got = [sp for sp in spans if sp["name"] == k and sp["step"] in steps]
        predicted = f"{calls} x, {size:,} B"  # exact: byte for byte
        measured = f"{len(got) / len(steps):g} x, {sum(sp['bytes'] for sp in got) / len(steps):,.0f} B"
        print(f"  {k:<28}{predicted:>22}{measured:>22}")
    cp_ranks = [k * shape["tp"] for k in range(shape["cp"])]  # stage 0, dp 0, tp 0
    layout = "balanced" if c.get("cp_balance", True) else "contiguous"
    print(f"\nattention compute per step (forward + backward), cp ranks of stage 0 ({layout} layout):")
    for rank in cp_ranks:
        t = sum(sp["t1"] - sp["t0"] for sp in run.spans if sp["rank"] == rank and sp["category"] == "compute"
                and sp["name"] in ("attention", "attention_backward") and sp["step"] in steps) / len(steps)
        print(f"  rank {rank}: {t * 1e3:.3f} ms")


def calc_moe(args) -> int:
    from types import SimpleNamespace

    from ..analysis import moe
    from ..analysis.cost import fmt_bytes as fmt
    run = None
    if args.run:
        from ..analysis.runs import load_run
        run = load_run(args.run)
        if not run.config.get("experts"):
            raise UsageError(f"{args.run} is not a --model gpt --experts run: nothing to compare")
        for k in ("layers", "embed", "context", "experts", "top_k", "expert_hidden", "capacity_factor", "ep",
                  "precision"):
            setattr(args, k.replace("-", "_"), run.config[k])
        args.tokens = run.get("global_batch") // run.config["mesh"]["shape"]["dp"] * args.context
    for name in ("layers", "embed", "context", "experts", "top_k", "ep", "tokens"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.top_k > args.experts or args.experts % args.ep:
        raise UsageError("--top-k must be at most --experts, and --experts divisible by --ep")
    e = 8 if args.precision == "fp64" else 4
    cfg = SimpleNamespace(layers=args.layers, embed=args.embed, context=args.context, experts=args.experts,
                          top_k=args.top_k, expert_hidden=args.expert_hidden)
    p = moe.parameters(cfg)
    print(f"MoE gpt: L={args.layers} h={args.embed} s={args.context}, E={args.experts} experts, top-{args.top_k}"
          f"{'' if args.capacity_factor is None else f', capacity factor {args.capacity_factor:g}'}")
    print(f"  parameters {p['parameters_total']:,} total, {p['parameters_active']:,} active per token "
          f"(experts {p['expert_parameters']:,}, router {p['router_parameters']:,})")
    print(f"  training FLOPs per token (6 N + 12 L h s): {p['flops_per_token_active']:,} active, "
          f"{p['flops_per_token_total']:,} if every expert ran")
    v = moe.step_volume(args.tokens, args.top_k, args.experts, args.embed, args.layers, args.ep, e,
                        args.capacity_factor)
    m = moe.memory_per_rank(p, args.ep, e, args.optimizer)
    print(f"\nep {args.ep}, {args.tokens} tokens per rank and forward, even load, {args.precision}:")
    print(f"  kept choices per layer: {v['choices']:,}; one transfer: {v['choices']:,} x {args.embed} x {e} B = "
          f"{fmt(v['per_transfer'])}")
    print(f"  token all-to-all per rank and step (4 transfers x {args.layers} layers): {fmt(v['per_step'])}, "
          f"of which {fmt(v['per_step_remote'])} to other ranks ((ep - 1) / ep)")
    print(f"  model state per rank ({args.optimizer}: parameters, gradients, optimizer): {fmt(m['bytes'])} "
          f"({m['parameters_held']:,} parameters held) vs {fmt(m['bytes_all_experts'])} with every expert")
    if run is not None:
        rows = [r for r in run.steps if r.get("moe")]
        spans = [sp for sp in run.spans if sp["name"] == "moe_dispatch"]
        measured_steps = sorted({r["step"] for r in rows})[-1:]  # the last step: one number per rank
        print(f"\nmeasured load, step {measured_steps[0]}: the dispatch (forward, one transfer per layer) per rank")
        table = []
        for rank in sorted({r["rank"] for r in rows}):
            row = next(r for r in rows if r["rank"] == rank and r["step"] == measured_steps[0])
            predicted = sum(moe.a2a_bytes(sum(layer["counts"]), args.embed, e, args.ep)["bytes"]
                            for layer in row["moe"])
            recorded = sum(sp["bytes"] for sp in spans if sp["rank"] == rank and sp["step"] == measured_steps[0])
            table.append([rank, [sum(layer["counts"]) for layer in row["moe"]], fmt(predicted), fmt(recorded),
                          fmt(len(row["moe"]) * v["per_transfer"])])  # the layers it holds (a stage: some)
        from ..report.page import text_table
        print(text_table(["rank", "kept choices per layer", "predicted (measured load)", "recorded",
                          "predicted (even load)"], table))
    return 0


def is_tp_gpt_run(run) -> bool:
    return run.config.get("model") == "gpt" and run.config.get("mesh", {}).get("shape", {}).get("tp", 1) > 1


def _tp_microbatches(run) -> tuple[int, int]:
    """(microbatches per step, sequences in each) on one rank: the global batch over dp, over the
    pipeline's microbatches."""
    shape = run.config["mesh"]["shape"]
    micro = int(run.config.get("microbatches", 1)) if shape["pp"] > 1 else 1
    return micro, run.summary["global_batch"] // shape["dp"] // micro


def tp_run_table(run, peak_tflops: float | None = None) -> None:
    """A gpt run with tensor parallelism: each tp collective it recorded per measured step (rank 0 of each
    stage) beside the cost model's count and bytes, and its MFU."""
    from ..analysis.cost import fmt_bytes as fmt
    from ..analysis.tensor import gpt_flops_per_token, mfu, tp_communication
    from ..analysis.timeline import measured_steps
    c, shape = run.config, run.config["mesh"]["shape"]
    (micro, b), s = _tp_microbatches(run), c["context"]
    cp = shape.get("cp", 1)  # under --cp a rank's tp collectives carry its s / cp tokens
    e = 8 if c.get("precision") == "fp64" else 4
    comm = tp_communication(b, s // cp, c["embed"], c["layers"], shape["tp"], c["sequence_parallel"], e)
    # one rank per pipeline stage (dp 0, tp 0): each tp collective happens on exactly one stage
    stage_ranks = [p * shape["dp"] * cp * shape["tp"] for p in range(shape["pp"])]
    spans = [sp for sp in run.spans if sp["rank"] in stage_ranks and sp["category"] == "comm"]
    steps = measured_steps(sorted({sp["step"] for sp in spans if sp["step"] >= 0}), int(c.get("warmup", 1)))
    if not steps:
        raise UsageError(f"{run.path} has no measured step (all within --warmup)")
    print(f"\n{run.path}: tensor parallelism per step ({len(steps)} measured), {micro} microbatch(es) of {b}, "
          f"recorded on rank(s) {', '.join(map(str, stage_ranks))} (tp 0 of each stage):")
    print(f"  {'collective':<28}{'predicted':>22}{'measured':>22}")
    for k, (calls, size) in comm.parts["messages"].items():
        got = [sp for sp in spans if sp["name"] == k and sp["step"] in steps]
        predicted = f"{calls * micro} x, {fmt(size * micro)}"
        measured = f"{len(got) / len(steps):g} x, {fmt(sum(sp['bytes'] for sp in got) / len(steps))}"
        print(f"  {k:<28}{predicted:>22}{measured:>22}")
    if run.summary.get("samples_per_s"):
        from ..models.gpt import VOCAB
        flops = gpt_flops_per_token(c["layers"], c["embed"], s, VOCAB)
        per_token = flops.value
        peak, source = (peak_tflops * 1e12, f"--peak-tflops {peak_tflops:g}") if peak_tflops \
            else _measured_peak(run.workers)
        print(f"\nFLOPs per token {per_token:,.0f} ({flops.formula}; {flops.note})\npeak: {source}")
        _print(mfu(run.summary["samples_per_s"] * s, per_token, peak))


def _measured_peak(workers: int) -> tuple[float, str]:
    """This machine's fp32 matmul rate on one core (best of 5, 1024^3), times the workers."""
    import time

    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(threads)
    rate = 2 * 1024 ** 3 / best
    return rate * workers, f"measured fp32 matmul on one core here, {rate / 1e9:.1f} GFLOP/s x {workers} worker(s)"


def calc_comm(args) -> int:
    from ..analysis.cost import allreduce_bytes_per_rank, boundary_traffic, fmt_bytes, fmt_seconds, bytes_per_second
    from ..models import count_parameters
    from ..strategies.pipeline.partition import analyze_partition, parse_spec, partition_model, sample_batch
    _positive("workers", args.workers)
    _positive("batch-size", args.batch_size)
    _positive("microbatches", args.microbatches)
    model = _model_size(args.model, args.width)
    if args.norm is not None:
        from ..models import build_model
        model = build_model(args.model, width=args.width, norm=args.norm)
    parse_spec(args.partition, args.workers, len(model))
    unit_times = None
    if args.partition == "balanced":
        from ..strategies.pipeline.partition import measure_unit_times
        print("measuring each unit's forward+backward time on a batch of 32 to balance the stages...")
        unit_times = measure_unit_times(model, sample_batch(32, model=model))
    ranges = partition_model(model, args.workers, args.partition, unit_times=unit_times)
    info = analyze_partition(model, ranges, args.batch_size, unit_times=unit_times)
    print(f"{args.model} (width {args.width}) over {args.workers} stages, partition {args.partition}, "
          f"batch {args.batch_size}:")
    for st in info.stages:
        share = f", {100 * st.time_share:.0f}% of the time" if st.time_share is not None else ""
        print(f"  stage {st.stage}: units {st.units[0]}..{st.units[1] - 1} ({', '.join(st.labels)}), "
              f"{st.parameters:,} parameters{share}")
    for b in info.boundaries:
        print(f"  boundary {b.after_stage}->{b.after_stage + 1}: activation {tuple(b.activation_shape)} = "
              f"{fmt_bytes(b.activation_bytes)} forward, gradient of the same shape back")
    print()
    traffic = boundary_traffic([(b.after_stage, b.activation_shape, b.activation_bytes) for b in info.boundaries],
                               args.batch_size)
    _print(traffic)
    m, p = args.microbatches, args.workers
    print(f"messages per step: 2 x m x (p-1) = 2 x {m} x {p - 1} = {2 * m * (p - 1)} "
          f"(microbatches split the bytes, not add to them)")
    psi = count_parameters(model)
    ddp = allreduce_bytes_per_rank(psi * 4, p)
    print()
    print(f"for comparison, data parallelism over {p} workers all-reduces {psi:,} fp32 gradients per step:")
    _print(ddp)
    if args.bandwidth:
        _positive("bandwidth", args.bandwidth)
        b = bytes_per_second(args.bandwidth)
        # boundaries are sequential in model parallelism: each crossing is on the critical path
        print(f"transfer time at {args.bandwidth:g} Gb/s: boundaries {fmt_seconds(traffic.value / b)} "
              f"(each crossing is on the critical path), data-parallel ring {fmt_seconds(ddp.value / b)}")
    return 0


# ======================================================================== from a run
def calc_run(args) -> int:
    from ..analysis.cost import (bandwidth_utilisation, fmt_bytes, fmt_seconds,
                                 gather_scatter_time, link_share, ring_allreduce_time)
    from ..analysis.runs import load_run
    from ..report.page import text_table
    r = load_run(args.run)
    if args.bandwidth is not None:
        _positive("bandwidth", args.bandwidth)
    elif (r.config.get("network_emulated") or {}).get("gbps"):  # --network: the link the run had
        from ..run.network import describe
        args.bandwidth = r.config["network_emulated"]["gbps"]
        print(f"link bandwidth from the run's --network: {args.bandwidth:g} Gb/s "
              f"({describe(r.config['network_emulated'])})")
    if args.latency < 0:
        raise UsageError("--latency must be zero or positive (microseconds)")
    n = r.workers
    steps = max(int(r.get("measured_steps") or 1), 1)
    ops = r.get("comm_ops") or {}
    print(f"{r.path}: {r.label}, {r.get('parameters'):,} parameters, global batch {r.get('global_batch')}, "
          f"{steps} measured steps, {r.environment.get('backend', '?')} on {r.environment.get('device', '?')}\n")
    if not ops:
        print("no communication with a payload was recorded in the measured steps (one worker?)")
        return 0
    rows = []
    for op, e in sorted(ops.items()):
        per_rank_s = e["seconds"] / steps / n
        rows.append([op, e["calls"] // (steps * n), fmt_bytes(e["bytes_per_step"]), fmt_seconds(per_rank_s),
                     f"{e['algbw_GBps']:.4g}" if e.get("algbw_GBps") else "-"])
    print("measured, per step and rank:")
    print(text_table(["operation", "calls", "bytes", "time", "achieved GB/s (bytes/time)"], rows))
    print()
    lat = args.latency * 1e-6
    if "all_reduce" in ops and n > 1:
        e = ops["all_reduce"]
        size = e["bytes_per_step"]
        t = e["seconds"] / steps / n
        calls = max(e["calls"] // (steps * n), 1)
        print("HPML Lab 4 Q3.2, assuming the ring all-reduce of Patarasuk & Yuan:")
        u = bandwidth_utilisation(size, n, t)
        _print(u)
        split_comm = sum(r.split(k).get("comm", 0.0) for k in r.ranks) / max(len(r.ranks), 1)
        print(f"  blocking communication in the step (split, mean over ranks): {fmt_seconds(split_comm)}; "
              f"all-reduce time in flight: {fmt_seconds(t)}" + (" (asynchronous: partly hidden under backward)"
                                                                  if any(r.split(k).get("comm_async") for k in r.ranks)
                                                                  else ""))
        print()
        if args.bandwidth:
            _print(link_share(u.value, args.bandwidth))
            pred = ring_allreduce_time(size, n, args.bandwidth, lat, calls)
            _print(pred)
            print(f"predicted {fmt_seconds(pred.value)} vs measured {fmt_seconds(t)} per step: "
                  f"measured / predicted = {t / pred.value:.2f}" if pred.value > 0 else "")
        else:
            print("pass --bandwidth (Gb/s) to predict the time and the share of the link")
    if "gather" in ops and "scatter" in ops and n > 1 and args.bandwidth:
        size = ops["gather"]["bytes_per_step"]
        calls = max(ops["gather"]["calls"] // (steps * n), 1)
        t = (ops["gather"]["seconds"] + ops["scatter"]["seconds"]) / steps / n
        pred = gather_scatter_time(size, n, args.bandwidth, lat, calls)
        _print(pred)
        print(f"measured gather + scatter per step and rank: {fmt_seconds(t)}")
    p2p = {k: v for k, v in ops.items() if k in ("send", "recv")}
    if p2p:
        sent = ops.get("send", {}).get("bytes_per_step", 0.0)
        print(f"point-to-point: {fmt_bytes(sent)} sent per step per rank on average "
              f"({fmt_bytes(sent * n)} over all ranks)")
        if args.bandwidth:
            from ..analysis.cost import bytes_per_second
            print(f"  at {args.bandwidth:g} Gb/s that is {fmt_seconds(sent * n / bytes_per_second(args.bandwidth))} "
                  "of transfers per step")
        print()
    if is_tp_gpt_run(r):  # tensor parallelism: its collectives beside the cost model's
        tp_run_table(r)
        print()
    if r.config.get("model") == "gpt" and r.config.get("mesh", {}).get("shape", {}).get("cp", 1) > 1:
        from ..analysis.context import cp_communication  # context parallelism: its messages, the same way
        c, shape = r.config, r.config["mesh"]["shape"]
        cp_run_table(r, cp_communication(_tp_microbatches(r)[1], c["context"], c["embed"], c["layers"], shape["cp"],
                                         c["cp_method"], shape["tp"], 8 if c["precision"] == "fp64" else 4))
        print()
    bubbles, pipe = r.bubbles, r.pipeline
    if bubbles and pipe:  # ranks that are pipeline stages and measured their idle share
        from ..analysis.cost import SCHEDULE_SOURCES, schedule_bubble
        schedule = "gpipe" if pipe["schedule"] == "naive" else pipe["schedule"]
        if schedule not in SCHEDULE_SOURCES:
            print(f"schedule {schedule}: no bubble formula in the cost model; measured bubble per rank: "
                  + ", ".join(f"rank {k}: {100 * b:.1f} %" for k, b in bubbles.items()))
            return 0
        v = int(r.rank_details(next(iter(r.stages))).get("virtual_stages") or 1)
        theory = schedule_bubble(schedule, pipe["stages"], pipe["microbatches"], v)
        print(f"schedule {schedule}" + (f", {v} stages per rank" if v > 1 else "") + ":")
        _print(theory)
        print("measured bubble (idle / step time) per rank: "
              + ", ".join(f"rank {k}: {100 * b:.1f} %" for k, b in bubbles.items()))
        from ..analysis.pipeline import ideal_timeline
        ideal, why = ideal_timeline(r)
        if ideal is None:
            print(f"(no replay on this run's stage times: {why})")
        else:  # the formula assumes equal stages; the replay has this cut's own
            print("the schedule replayed on this run's mean stage times (no communication), per rank: "
                  + ", ".join(f"rank {k}: {100 * b:.1f} %" for k, b in enumerate(ideal.bubble))
                  + "\n(measured minus replayed: communication, overhead and noise; replayed minus the formula: "
                    "the cut's imbalance)")
    return 0
