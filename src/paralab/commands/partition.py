"""Show how a model splits into pipeline stages and what crosses each boundary.

Prints each stage's units, parameters and share of the measured
forward+backward time, then, per boundary, the activation sent forward and
the gradient sent back: shapes and bytes for one batch (and one microbatch
with --microbatches), as the receiver must know them ahead (CS1390 Task 2.1).

  paralab partition --model vgg16 --workers 3 --batch-size 32
  paralab partition --workers 2 --partition params
  paralab partition --workers 3 --partition 4,5,5 --json
"""
from __future__ import annotations

import json

import torch

from ..errors import UsageError
from ..models import DEFAULT_NORM, MODELS, ModelOptions, build_model, count_parameters
from ..options import add_flags, integer
from ..strategies.pipeline.partition import analyze_partition, measure_unit_times, parse_spec, partition_model, sample_batch

HELP = "split a model into pipeline stages; show parameters, time shares and boundary tensors"


def add_arguments(p) -> None:
    add_flags(p, ModelOptions, only=("--model",))
    p.add_argument("--workers", type=integer, default=2, help="number of stages (default %(default)s)")
    p.add_argument("--batch-size", type=integer, default=32, help="batch crossing the boundaries (default %(default)s)")
    p.add_argument("--microbatches", type=integer, default=1, help="also show per-microbatch sizes")
    add_flags(p, ModelOptions, only=("--width", "--norm"))
    p.add_argument("--partition", default="balanced", help="balanced | params | counts such as 2,3,8")
    p.add_argument("--repeats", type=integer, default=3, help="timed repetitions per unit (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def shape_str(shape) -> str:
    return "x".join(str(d) for d in shape)


#: the most timed repetitions per unit --repeats takes (the median of a few is what is shown)
MAX_REPEATS = 1000


def run(args) -> int:
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    for name in ("workers", "batch_size", "microbatches", "width", "repeats"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.norm is None:
        args.norm = DEFAULT_NORM[args.model]
    if args.norm not in ("batch", "none"):
        raise UsageError("--norm must be batch or none")
    if args.batch_size % args.microbatches:
        raise UsageError(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}")
    if args.repeats > MAX_REPEATS:
        raise UsageError(f"--repeats {args.repeats}: at most {MAX_REPEATS} timed repetitions per unit")
    from ..models import parameters_of
    from ..run.config import available_memory
    parameters, room = parameters_of(args.model, width=args.width, norm=args.norm), available_memory()
    # the model's weights, and a microbatch's input and its first activation (64 channels at width 1) in fp32
    need = None if parameters is None else 4 * (parameters + args.batch_size // args.microbatches * 3 * 32 * 32
                                                * (1 + 64 / 3 * max(args.width, 1)))
    if need is None or room is not None and need > room:
        raise UsageError(f"{args.model} at --width {args.width:g} with --batch-size {args.batch_size} needs more "
                         "memory than this machine has available: lower them")
    torch.manual_seed(0)
    model = build_model(args.model, width=args.width, norm=args.norm)
    spec = parse_spec(args.partition, args.workers, len(model))
    # time shares are always shown: measured on a microbatch, the size a pipeline stage runs on
    micro = args.batch_size // args.microbatches
    times = measure_unit_times(model, sample_batch(micro, model=model), repeats=args.repeats)
    ranges = partition_model(model, args.workers, spec, unit_times=times)
    info = analyze_partition(model, ranges, args.batch_size, unit_times=times)

    if args.json:
        out = info.to_dict() | {"model": args.model, "width": args.width, "norm": args.norm,
                                "partition": args.partition, "microbatches": args.microbatches,
                                "unit_seconds": times, "bytes_per_step": info.bytes_per_step}
        print(json.dumps(out, indent=2))
        return 0

    total = count_parameters(model)
    print(f"{args.model} (width {args.width}, norm {args.norm}): {len(model)} units, {total:,} parameters; "
          f"{args.workers} stage(s), partition {args.partition}")
    print(f"time shares: forward+backward of each unit measured on a batch of {micro} "
          f"(median of {args.repeats}), {torch.get_num_threads()} thread(s)\n")
    print(f"{'stage':<6}{'units':<8}{'parameters':>12}{'params %':>10}{'time %':>9}  layers")
    for s in info.stages:
        a, b = s.units
        print(f"{s.stage:<6}{f'{a}-{b - 1}':<8}{s.parameters:>12,}{100 * s.parameters / max(total, 1):>9.1f}%"
              f"{100 * s.time_share:>8.1f}%  {', '.join(s.labels)}")
    if not info.boundaries:
        print("\none stage: nothing crosses a boundary")
        return 0
    print(f"\nboundaries, batch of {args.batch_size} (fp32):")
    print(f"{'':<9}{'activation (forward)':<24}{'bytes':>12}   {'gradient (backward)':<24}{'bytes':>12}")
    for bd in info.boundaries:
        print(f"{f'{bd.after_stage} -> {bd.after_stage + 1}':<9}{shape_str(bd.activation_shape):<24}"
              f"{human_bytes(bd.activation_bytes):>12}   {shape_str(bd.gradient_shape):<24}"
              f"{human_bytes(bd.gradient_bytes):>12}")
    print(f"\nper step: {human_bytes(info.bytes_per_step)} cross the boundaries "
          f"(each activation forward, each gradient back)")
    if args.microbatches > 1:
        per = [f"{bd.after_stage}->{bd.after_stage + 1}: {args.microbatches} x "
               f"{human_bytes(bd.activation_bytes / args.microbatches)}" for bd in info.boundaries]
        print(f"with {args.microbatches} microbatches of {micro}, messages each way: {'; '.join(per)} "
              "(the same total)")
    slowest = max(s.time_share for s in info.stages)
    print(f"slowest stage: {100 * slowest:.1f}% of the time (ideal {100 / args.workers:.1f}%)")
    return 0
