"""RunConfig: every option of a run, declared once, validated before any worker starts.

Each option is declared once, as an ``option(...)`` field of a small class
beside the code that reads it (``paralab.options`` says how): the model's in
``models`` (ModelOptions), the data's in ``data`` (DataOptions), the
optimiser's, the records' and the launcher's here (the worker and the
launcher that read them import this module), the strategies' in their own
files (``strategies.all_options.StrategyOptions``). RunConfig inherits them all,
so its attributes are flat (``cfg.lr``, ``cfg.workers``, ``cfg.bucket_mb``).

The CLI builds a RunConfig from the flags the declarations give
(:meth:`RunConfig.add_flags`); :meth:`RunConfig.to_argv` spells a config as
``paralab train`` arguments and :meth:`RunConfig.from_argv` reads them back.
``validate()`` checks each value against its declaration, then what relates
several options, and raises UsageError (exit code 2) with a message saying
what to change. Workers receive the validated config and never re-check it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import options
from ..data import DataOptions
from ..errors import UsageError
from ..models import ModelOptions
from ..options import integer, option
from ..strategies.all_options import OPTION_CLASSES, StrategyOptions
from .warm import START_METHODS

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
CPUINFO = Path("/proc/cpuinfo")  # where the CPU's features are read (tests point it at their own)
# Native bfloat16 instructions, as /proc/cpuinfo names them: x86 AVX512-BF16 and AMX-BF16 (and
# AVX-NE-CONVERT, which oneDNN uses for bf16 on AVX2-class cores), Arm's BF16 extension. Without
# them PyTorch's CPU bf16 kernels fall back to conversions and reference code: much slower than fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16")
# and float16 arithmetic: x86 AVX512-FP16 and AMX-FP16, Arm's half-precision SIMD
FP16_FLAGS = ("avx512_fp16", "amx_fp16", "asimdhp")


@dataclass
class OptimizerOptions:
    """optimisation"""
    batch_size: int = option(256, "global batch (split over the data-parallel replicas)", positive=True)
    per_worker_batch: int | None = option(None, "per-worker batch instead (weak scaling)", type=integer, positive=True)
    epochs: int = option(1, "epochs to train, unless --num-batches is given", positive=True)
    num_batches: int | None = option(None, "train exactly this many steps instead of --epochs", type=integer,
                                     positive=True)
    optimizer: str = option("sgd", "sgd (with --momentum); adam (torch's Adam: --weight-decay added to the gradient); "
                                   "adamw (torch's AdamW: --weight-decay decoupled from the gradient)",
                            choices=OPTIMIZERS)
    lr: float = option(0.1, "learning rate", positive=True)
    momentum: float = option(0.9, "SGD momentum", minimum=0)
    weight_decay: float = option(1e-4, "weight decay: L2 in the gradient (sgd, adam), decoupled (adamw)", minimum=0)
    seed: int = option(0, "seed of the initial weights, the shuffling and the augmentation (0 to 2^32 - 1: the data's "
                          "generators add and multiply it within torch's 64-bit seeds)", minimum=0, maximum=2 ** 32 - 1)
    precision: str | None = option(None, "fp32; bf16 (autocast); fp16 (autocast, with torch's dynamic loss "
                                         "scaling: training/loss_scale.py); fp64 (model, collectives, optimizer "
                                         "state and --check reference in float64: exact checks at real "
                                         "hyper-parameters). "
                                         "Below fp64 --check tells a bug from rounding by a noise band it measures. "
                                         "Not given: fp64 with --check, else fp32 (docs/correctness.md)",
                                   type=str, choices=PRECISIONS)
    initial_loss_scale: float = option(65536.0, "--precision fp16: the loss scale the run starts from, a power of two "
                                                "(torch's GradScaler's init_scale; halved at each overflow, doubled "
                                                "after 2,000 steps without one)", minimum=1.0, maximum=2.0 ** 64,
                                       metavar="S")
    lr_scaling: str = option("none", "linear: lr x global batch / 256 (Goyal et al.)", choices=("none", "linear"))
    warmup_epochs: float = option(0.0, "linear lr warm-up over this many epochs (constant: from --lr to the scaled "
                                       "rate; cosine: from 0)", minimum=0)
    lr_schedule: str = option("constant", "constant: the rate after warm-up held; cosine: after warm-up, half a cosine "
                                          "from the rate down to --min-lr over the run's steps "
                                          "(training/lr_schedule.py)", choices=LR_SCHEDULES)
    min_lr: float = option(0.0, "--lr-schedule cosine's floor", minimum=0)
    clip_grad: float | None = option(None, "clip the whole model's gradient norm to NORM before every optimizer step "
                                           "(torch's clip_grad_norm_ rule, under every layout: "
                                           "training/grad_norm.py); the norm is recorded per step (steps.jsonl "
                                           "grad_norm, `paralab plot grad-norm`)", type=float, positive=True,
                                     metavar="NORM")
    on_nonfinite: str | None = option(None, "before every optimizer step, one all-reduce asks every rank whether "
                                            "its loss and gradient are finite: stop (every rank stops at that "
                                            "step, naming the ranks; exit 3) or skip (every rank skips that "
                                            "step's update, steps.jsonl marks it; summary.json skipped_steps). "
                                            "Not given: a non-finite loss stops the run at the next log point",
                                      type=str, choices=("stop", "skip"))
    allow_slow_bf16: bool = option(False, "run --precision bf16 even on a CPU without bf16 instructions (refused "
                                          "otherwise: much slower than fp32 there, on slow fallback kernels)")


@dataclass
class RecordOptions:
    """records"""
    log_every: int = option(20, "print the loss every N steps", positive=True)
    warmup: int = option(1, "first N steps left out of timing averages", minimum=0)
    eval_batches: int | None = option(None, "test batches evaluated (not given: the whole test split)",
                                        type=integer, positive=True)
    eval_batch_size: int = option(500, "test evaluation batch", positive=True)
    out: str | None = option(None, "run directory (default runs/<strategy>-w<N>-<time>); one run at a time",
                             type=str)
    overwrite: bool = option(False, "replace the finished run --out holds (else refused: --resume continues it)")
    progress: bool = option(True, "progress bar on rank 0")
    keep_checkpoints: int = option(2, "committed checkpoints kept; an older one is deleted only once a newer one "
                                      "is committed", minimum=1)
    checkpoint_every: int = option(0, "save resumable state every N steps, and at the end (0: at the end only)",
                                   minimum=0)
    resume: str | None = option(None, "run directory whose checkpoint to continue from", type=str)
    check: bool = option(False, "compare with the single-process reference; exit 1 on FAIL")
    first_divergence: bool = option(True, "with --check: when it FAILs, replay the run beside the reference and name "
                                          "the first step, rank, module and direction (forward, backward, optimizer "
                                          "step) where they differ (check/diverge.py)")
    replay: bool = option(False, "with --check: replay the run beside the reference even when it passes, "
                                 "comparing every module's output, gradient and weight step by step (the first "
                                 "divergence, or none: a closer look than the end-of-run comparison)")
    save_init: bool = option(False, "also save the starting weights (checkpoint/init/; `paralab export RUN --init`)")
    check_every: int | None = option(None, "with --check: compare with the reference every N steps too (by "
                                           "default after the first and second steps and the last; summary.json "
                                           "check.history, `paralab plot deviation`)", type=integer, positive=True,
                                     metavar="N")
    check_cache: str | None = option(None, "with --check: keep the single-process reference's final weights in DIR "
                                           "and load them in a later run whose reference is the same: the same "
                                           "starting weights, batches, learning rates, optimizer, split and "
                                           "threads, by digest (compare and sweep pass their own)",
                                     type=str, metavar="DIR")


@dataclass
class LaunchOptions:
    """launch"""
    workers: int = option(1, "local worker processes", positive=True)
    cores_per_worker: int | None = option(None, "pin rank r to cores [rC, rC+C)", type=integer, positive=True)
    world_size: int | None = option(None, "multi-node by hand: total ranks", type=integer, positive=True)
    rank: int | None = option(None, "multi-node by hand: this process's rank", type=integer)
    master_addr: str = option("127.0.0.1", "rank 0's address")
    master_port: int | None = option(None, "rank 0's port (local default: a free port)", type=integer, minimum=1,
                                     maximum=65535)
    backend: str = option("auto", "the process group's backend", choices=BACKENDS)
    device: str = option("auto", "where the model runs", choices=DEVICES)
    timeout: float = option(60.0, "seconds before a stuck collective fails the run", positive=True, maximum=1e6)
    network: str | None = option(None, "emulate a cluster network: each local worker in its own network namespace "
                                       "on a full-duplex link of RATE (e.g. 100mbit, 1gbit, 10gbit) to one switch, "
                                       "shaped by tc; needs iproute2 and root or unprivileged user namespaces. "
                                       "LATENCY (e.g. ,200us) only where the kernel has netem", type=str,
                                 metavar="RATE[,LATENCY]")
    max_restarts: int = option(0, "local workers: after a rank dies, stop the rest and start every rank again "
                                  "from the last checkpoint (--checkpoint-every), at most this many times",
                               minimum=0)
    start: str = option("auto", "how local ranks start: auto (forked from this process once it has imported "
                                "what a rank needs, where that is safe; else from a forkserver that has), "
                                "forkserver, or spawn (a fresh interpreter per rank)", choices=START_METHODS)


#: the run's own option classes, in the order the command line lists them (the strategies' follow)
RUN_OPTION_CLASSES = (ModelOptions, DataOptions, OptimizerOptions, RecordOptions, LaunchOptions)
ALL_OPTION_CLASSES = RUN_OPTION_CLASSES + OPTION_CLASSES


@dataclass
class _Strategy:
    strategy: str = "single"          #: strategy name (see `paralab train --help`): the positional argument


@dataclass
class RunConfig(*reversed(RUN_OPTION_CLASSES), _Strategy, StrategyOptions):
    """Every option of a run (flat: each declared once in its own class) and what the launcher records."""
    # filled in by the launcher, for the record (not options)
    launched_by: str = "local"
    network_emulated: dict | None = None  #: the links the launcher built for --network (network.Network.record)
    started_by: str | None = None  #: how the local ranks started: fork, forkserver or spawn (warm.rank_context)
    restarts: list | None = None  #: --max-restarts: each restart so far (restart.py), for summary.json

    # ---------------------------------------------------------------- derived
    @property
    def world(self) -> int:
        if self.world_size is not None:
            return self.world_size
        if "WORLD_SIZE" in os.environ and self.launched_by == "torchrun":
            return int(os.environ["WORLD_SIZE"])
        if self.launched_by == "slurm" and os.environ.get("SLURM_NTASKS", "").isdigit():
            return int(os.environ["SLURM_NTASKS"])
        return self.workers

    def strategy_options(self) -> StrategyOptions:
        """The strategies' options alone, typed: what a strategy receives as ``ctx.options``."""
        return options.project(self, StrategyOptions)

    def default_out(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        from ..strategies.user import label
        return str(Path("runs") / f"{label(self.strategy)}-w{self.world}-{stamp}")

    # ---------------------------------------------------------------- as a command line
    @staticmethod
    def add_flags(parser) -> None:
        """Every option's flag on ``parser`` (`paralab train`'s), one argument group per declaring class."""
        for cls in ALL_OPTION_CLASSES:
            options.add_flags(parser.add_argument_group(cls.__doc__.strip()), cls)

    def to_argv(self, *, first=(), **changes) -> list[str]:
        """The `paralab train` arguments that make this run (with ``changes``): the strategy, then every
        option that differs from its default (the options named in ``first`` first, always)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | changes
        return [values["strategy"], *options.to_argv(values, ALL_OPTION_CLASSES, first=first)]

    @classmethod
    def from_argv(cls, argv: list[str], what: str = "paralab train") -> "RunConfig":
        """The config that `paralab train` arguments (STRATEGY and flags) give; UsageError if they are wrong."""
        parser = options.RaisingParser(what)
        parser.add_argument("strategy")
        cls.add_flags(parser)
        return cls(**vars(parser.parse_args(argv)))

    @staticmethod
    def given(argv: list[str], what: str) -> dict:
        """{option: value} for the options that `paralab train` flags ``argv`` set (no strategy), only those."""
        return options.given(argv, ALL_OPTION_CLASSES, what)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """The inverse of :meth:`to_dict` (how ``paralab.run.runner`` hands a config to its child);
        keys that are not fields (e.g. config.json's environment) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # ---------------------------------------------------------------- checks
    def validate(self) -> "RunConfig":
        from ..data import check_dataset
        from ..strategies import get_strategy, plan

        named_cls = get_strategy(self.strategy)
        for cls in ALL_OPTION_CLASSES:  # each value against its declaration; below, what relates several
            options.check(self, cls)
        if self.check_every and not self.check:
            raise UsageError("--check-every N compares with the reference every N steps: it needs --check")
        if self.replay and not self.check:
            raise UsageError("--replay replays the run beside the reference --check trains: add --check")
        if self.replay and not self.first_divergence:
            raise UsageError("--replay looks for the first divergence, which --no-first-divergence turns off: "
                             "give one of them")
        if self.precision is None:  # not given: an exact check (docs/correctness.md#the-default-precision)
            self.precision = "fp64" if self.check else "fp32"
        if self.out and Path(self.out).exists() and not Path(self.out).is_dir():
            raise UsageError(f"--out {self.out} is a file: name a folder (made if missing)")
        if self.check_cache and not self.check:
            raise UsageError("--check-cache DIR keeps the reference that --check trains: add --check (or drop it)")
        if self.check_cache and Path(self.check_cache).exists() and not Path(self.check_cache).is_dir():
            raise UsageError(f"--check-cache {self.check_cache} is a file: name a folder (created if missing)")
        from ..models import DEFAULT_NORM, MODALITY
        if self.norm is None:  # the model's own: BatchNorm, but none for CS1390's plain VGG-16s and the gpt
            self.norm = DEFAULT_NORM[self.model]
        if MODALITY[self.model] == "text":
            if self.norm != "none":
                raise UsageError(f"--model {self.model} is a transformer with LayerNorm; --norm {self.norm} applies "
                                 "to the CNNs only: leave --norm out")
            if self.embed % self.heads:
                raise UsageError(f"--embed {self.embed} must be divisible by --heads {self.heads} "
                                 "(each head gets embed / heads features)")
        elif self.dropout:
            raise UsageError(f"--dropout drops the gpt's residual branches; --model {self.model} has none: use "
                             "--model gpt, or drop --dropout")
        check_moe(self, MODALITY[self.model])
        parameters = check_fits_in_memory(self)
        if self.recompute != "none" and self.experts:  # activation recomputation (training/recompute.py)
            raise UsageError(f"--recompute {self.recompute} with --experts: a mixture of experts records its "
                             "routing and load-balancing loss in each forward, which a recompute would repeat; "
                             "drop one of them")
        if (self.world_size is None) != (self.rank is None):
            raise UsageError("manual multi-node needs both --world-size and --rank")
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise UsageError(f"--rank must be in [0, {self.world_size}) (got {self.rank})")
        if self.world_size is not None and self.workers != 1:
            raise UsageError("--workers starts local processes; with --world-size/--rank "
                             "run one command per rank instead")
        if self.launched_by == "slurm" and self.workers != 1:
            raise UsageError("under `srun -n N` each task is one rank: drop --workers (or start one task, "
                             "srun -n 1, and let --workers start the local ranks)")
        from ..strategies import compression  # --compress: which strategies take it, what cannot resume
        compression.validate(self, named_cls)
        if self.network is not None:
            from .network import check_can_emulate, parse
            if self.world_size is not None or self.launched_by in ("torchrun", "slurm"):
                raise UsageError("--network emulates links between local workers (--workers N); with "
                                 "--world-size/--rank or torchrun the ranks use the real network: drop --network")
            if self.workers > 1:
                check_can_emulate(parse(self.network))
            else:
                parse(self.network)
        if self.cores_per_worker is not None and self.world_size is None:
            cores = os.cpu_count() or 1
            if self.cores_per_worker * self.workers > cores:
                raise UsageError(f"--cores-per-worker {self.cores_per_worker} x --workers {self.workers} "
                                 f"needs {self.cores_per_worker * self.workers} cores; this machine has {cores}")
        if self.device == "cuda" or self.backend == "nccl":
            import torch
            if not torch.cuda.is_available():
                raise UsageError("CUDA/NCCL asked for but no GPU is visible; use --device cpu (gloo)")
            gpus = torch.cuda.device_count()
            if self.world_size is None and self.launched_by == "local" and self.workers > gpus:
                raise UsageError(f"--workers {self.workers} on CUDA needs a GPU for each worker and "
                                 f"{gpus} {'is' if gpus == 1 else 'are'} visible: use --workers {gpus} or fewer, "
                                 "or --device cpu")
        if self.precision == "bf16" and not self.allow_slow_bf16:
            refuse_slow_bf16(self)
        world = self.world
        shape, strategy_cls, _ = plan(self, world)
        if self.per_worker_batch is None and self.batch_size % shape.dp:
            raise UsageError(f"--batch-size {self.batch_size} must divide evenly over "
                             f"{shape.dp} data-parallel replicas; change it or use --per-worker-batch")
        named_cls.validate(self, world)
        if self.clip_grad is not None or self.on_nonfinite or self.precision == "fp16":
            refuse_unclipped(self, named_cls, strategy_cls)
        check_loss_scale(self)
        if strategy_cls is not named_cls:
            strategy_cls.validate(self, world)  # the pipeline a data-parallel flavour is composed with
        if self.packing:
            check_packing(self, named_cls)
        check_dataset(self.dataset, Path(self.data_dir) if self.data_dir else None, model=self.model,
                      context=self.context)
        from ..data import train_size
        n = train_size(self.dataset, Path(self.data_dir) if self.data_dir else None, self.synthetic_size,
                       model=self.model, context=self.context, packing=self.packing, doc_length=self.doc_length)
        batch = self.batch_size if self.per_worker_batch is None else self.per_worker_batch * shape.dp
        if n < batch:  # every step would take the whole split, fewer samples than the batch the records state
            raise UsageError(f"the global batch of {batch} is more than the {n} training samples"
                             + (" (--synthetic-size)" if n == self.synthetic_size else "")
                             + ": every step would use fewer than it says; lower the batch size")
        if self.lr_schedule == "cosine" or self.min_lr:
            check_schedule(self, shape.dp)
        if self.check:
            check_reference_fits(self, parameters, named_cls.gradient_wire)
        if self.check:  # a comparison fp32 cannot vouch for (Strategy.check_limit): refused before anything starts
            from ..strategies import check_limit
            why = check_limit(self, self.world)
            if why:
                raise UsageError(f"--check of {self.strategy} on {self.model} in {self.precision} would report a "
                                 f"FAIL that is no bug, so it is refused: {why}")
        if self.max_restarts:
            if self.world_size is not None or self.launched_by == "torchrun":
                raise UsageError("--max-restarts restarts local workers; under torchrun give torchrun its own "
                                 "--max-restarts (a restarted rank resumes from the run's last checkpoint by "
                                 "itself), and by hand run the commands again with --resume")
            if not self.checkpoint_every:
                raise UsageError("--max-restarts starts the ranks again from the last checkpoint: add "
                                 "--checkpoint-every K (a checkpoint every K steps; at most K steps are lost)")
        if self.resume:
            from .checkpoint import check_resumable
            from .folder import refuse_if_held
            if not self.out or Path(self.out).resolve() != Path(self.resume).resolve():  # (the same: its claim asks)
                refuse_if_held(Path(self.resume), "--resume")  # its newest checkpoint may be one being written
            check_resumable(Path(self.resume), self)
        return self

    def data_replicas(self, strategy_cls=None) -> int:
        """How many data-parallel replicas share the global batch: the mesh's dp size."""
        strategy_cls = strategy_cls or _registered(self.strategy)
        return strategy_cls.mesh_shape(self, self.world).dp

    def global_batch(self, strategy_cls=None) -> int:
        if self.per_worker_batch is not None:
            return self.per_worker_batch * self.data_replicas(strategy_cls)
        return self.batch_size


def available_memory() -> int | None:
    """Bytes of memory this machine has available now (``MemAvailable``), None where it cannot say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def train_command(cfg: RunConfig, run_dir=None, first=("workers",)) -> str:
    """The `paralab train` command line that makes the same run (for people: reports, --dry-run, plans):
    ``--workers`` (and ``first``) first, the options that differ from their default, ``--out RUN_DIR`` last."""
    import shlex
    words = ["paralab", "train", *cfg.to_argv(first=first, out=None)]
    return shlex.join(words + (["--out", str(run_dir)] if run_dir is not None else []))


def refuse_unclipped(cfg, named_cls, strategy_cls) -> None:
    """--clip-grad or --on-nonfinite with a layout whose strategy cannot compute the whole model's gradient norm
    (nor skip a step on every rank): exit 2."""
    flag = "--clip-grad" if cfg.clip_grad is not None else "--on-nonfinite" if cfg.on_nonfinite else \
        "--precision fp16"
    why = " (its loss scale is taken out of the gradients each rank holds)" if flag == "--precision fp16" else ""
    for cls in {named_cls, strategy_cls}:
        if not cls.clips:
            raise UsageError(f"{flag} is not supported by strategy {cls.name!r} yet (it computes no whole-model "
                             f"gradient norm{why}): drop {flag}, or use another strategy (every other one "
                             "clips, and their compositions)")


def check_loss_scale(cfg: RunConfig) -> None:
    """--initial-loss-scale: fp16's alone, and a power of two, so that scaling and unscaling are exact (exit 2)."""
    scale = cfg.initial_loss_scale
    if cfg.precision != "fp16" and scale != OptimizerOptions.initial_loss_scale:
        raise UsageError(f"--initial-loss-scale {scale:g} is fp16's loss scale: give --precision fp16, or drop it")
    if math.frexp(scale)[0] != 0.5:
        raise UsageError(f"--initial-loss-scale {scale:g} must be a power of two (e.g. "
                         f"{2.0 ** round(math.log2(scale)):g}), so that scaling and unscaling the gradients are exact")


def check_packing(cfg: RunConfig, named_cls) -> None:
    """``--packing`` needs documents (``--dataset auto`` becomes the first dataset of documents present) and
    an attention paralab writes (exit 2 otherwise)."""
    from ..data.datasets import modality_of
    from ..data.documents import JARGON_ENTRIES, NOT_DOCUMENTS, DOCUMENT_DATASETS, SYNTHETIC_DOCS
    from ..data.text import text_path
    if cfg.dataset == "auto" and modality_of(cfg.model) == "text":
        cfg.dataset = JARGON_ENTRIES if text_path("jargon", Path(cfg.data_dir) if cfg.data_dir else None) \
            else SYNTHETIC_DOCS
    if cfg.dataset not in DOCUMENT_DATASETS:
        raise UsageError(NOT_DOCUMENTS.format(name=cfg.dataset if cfg.dataset != "auto" else
                                              f"auto (for --model {cfg.model}: images)"))
    if named_cls.name == "torch-cp":
        raise UsageError("--packing with torch-cp: PyTorch's context_parallel runs causal attention only, with no "
                         "mask to keep each packed document to itself; use paralab's --cp (e.g. 'paralab train "
                         "cp --workers 2 --model gpt --packing'), or drop --packing (padded documents)")


def check_schedule(cfg: RunConfig, replicas: int) -> None:
    """A cosine schedule must have steps left after its warm-up, and a floor below its rate (exit 2 otherwise)."""
    if cfg.lr_schedule != "cosine":
        raise UsageError(f"--min-lr is the floor of --lr-schedule cosine; this run's schedule is "
                         f"{cfg.lr_schedule}: add --lr-schedule cosine or drop --min-lr")
    from ..data import steps_per_epoch, train_size
    from ..training.lr_schedule import target_lr
    n = train_size(cfg.dataset, Path(cfg.data_dir) if cfg.data_dir else None, cfg.synthetic_size,
                   model=cfg.model, context=cfg.context, packing=cfg.packing, doc_length=cfg.doc_length)
    per_rank = cfg.per_worker_batch or cfg.batch_size // replicas
    per_epoch = steps_per_epoch(n, replicas, per_rank, cfg.drop_last)
    total, warmup = cfg.num_batches or cfg.epochs * per_epoch, cfg.warmup_epochs * per_epoch
    if warmup >= total:
        raise UsageError(f"--lr-schedule cosine: the warm-up (--warmup-epochs {cfg.warmup_epochs:g}: {warmup:g} steps at "
                         f"{per_epoch} an epoch) leaves none of the run's {total} steps to decay over; "
                         "shorten the warm-up or train longer")
    target = target_lr(cfg.lr, cfg.lr_scaling, per_rank * replicas)
    if cfg.min_lr >= target:
        raise UsageError(f"--min-lr {cfg.min_lr:g} is the floor the cosine decays to: it must be below the rate "
                         f"({target:g}); lower it")


def check_fits_in_memory(cfg: RunConfig) -> int:
    """The model's parameters, counted without allocating them (``models.parameters_of``). Its weights alone
    must fit in this machine's available memory (each rank builds the whole model before a strategy splits
    it), and so must the synthetic data each local rank generates: refused before start, naming the options
    that size them, where they cannot (``--width 1e9``), or where a tensor's size is past what torch can
    count."""
    from ..models import MODALITY, model_shape, parameters_of
    sizing = "--width" if MODALITY[cfg.model] == "image" else "--embed, --layers, --context or --experts"
    parameters = parameters_of(cfg.model, width=cfg.width, norm=cfg.norm, **model_shape(cfg))
    if parameters is None:
        raise UsageError(f"{cfg.model} at this size has a layer too large for torch to count; lower {sizing}")
    available = available_memory()
    from ..data.datasets import resolve_dataset
    if resolve_dataset(cfg.dataset, Path(cfg.data_dir) if cfg.data_dir else None, cfg.model).startswith("synthetic"):
        # each local rank generates the synthetic set: an image's noise is drawn in fp32 (12 KiB) before it is
        # kept as bytes (3 KiB); a text window's bytes as int64 tokens, twice (inputs and targets)
        each = 15 * 1024 if MODALITY[cfg.model] == "image" else 16 * (cfg.context + 1)
        local = cfg.workers if cfg.world_size is None else 1
        if available is not None and cfg.synthetic_size * each * local > available:
            raise UsageError(f"--synthetic-size {cfg.synthetic_size}: each of the {local} local rank(s) would "
                             f"generate {cfg.synthetic_size * each / 2 ** 30:.1f} GiB of synthetic data, more than "
                             f"the memory this machine has available ({available / 2 ** 30:.1f} GiB); lower it")
    weights = parameters * (8 if cfg.precision == "fp64" else 4)
    if available is not None and weights > available:
        gib = 2 ** 30
        raise UsageError(f"{cfg.model} at this size has {parameters:,} parameters, {weights / gib:.1f} GiB of weights "
                         f"in {cfg.precision}: more than the memory this machine has available "
                         f"({available / gib:.1f} GiB); lower {sizing}")
    return parameters


def check_reference_fits(cfg: RunConfig, parameters: int, wire=None) -> None:
    """--check: rank 0 trains the single-process reference (the whole model in one process) beside its part of
    the run, while each local rank builds the whole model before its strategy splits it; refuse before start
    where the reference and those models cannot fit in memory together (``wire``: the strategy's lossy
    ``gradient_wire``, whose noise band is trained in fp64 too)."""
    from ..check.reference import banded, reference_bytes
    each, weights = reference_bytes(cfg, parameters, wire), parameters * (8 if cfg.precision == "fp64" else 4)
    local = local_ranks(cfg)
    if _cuda_memory(cfg):
        import torch
        available, where = torch.cuda.mem_get_info()[1], "a GPU's memory"  # the reference on rank 0's GPU
    else:
        available, where = available_memory(), "the memory this machine has available"
    if available is not None and each + local * weights > available:
        gib = 2 ** 30
        raise UsageError(f"--check: rank 0 trains the single-process reference beside its part of the run, and "
                         f"the reference alone holds at least {each / gib:.1f} GiB (the model's {parameters:,} "
                         f"parameters, their gradients and the optimizer's state, in {cfg.precision}"
                         + ("" if not banded(cfg.precision, wire) else ", four times over: the reference "
                            "and the three its noise band measures the run's rounding with, docs/correctness.md")
                         + "), beside "
                         + (f"the {local} local ranks' whole models ({local * weights / gib:.1f} GiB)" if local > 1
                            else f"the rank's whole model ({weights / gib:.1f} GiB)")
                         + f": more than {where} ({available / gib:.1f} GiB). Check a smaller shape of the same "
                         "layout (--layers, --embed, --width), or drop --check")


def _cuda_memory(cfg: RunConfig) -> bool:
    """Whether a check's reference lives in a GPU's memory, as the memory estimates here decide it (``--device
    cuda`` or nccl)."""
    return cfg.device == "cuda" or cfg.backend == "nccl"


def local_ranks(cfg: RunConfig) -> int:
    """The ranks that share one memory: this machine's workers on a CPU (one where it is one of many launched
    apart), one on a GPU (each rank its own)."""
    return 1 if _cuda_memory(cfg) or cfg.world_size is not None else cfg.workers


def replay_too_large(cfg: RunConfig, parameters: int, wire=None, available: int | None = None,
                     local: int | None = None) -> str | None:
    """Why the first divergence's replay cannot fit beside the run, or None: every local rank builds the whole
    model again and trains a reference of its own (below fp64, and for a lossy ``wire``, the band's three more
    too: ``reference_bytes``), while the run's own state is still held. ``available``: the memory free now
    (default: this machine's, or the GPU's)."""
    from ..check.reference import reference_bytes
    if local is None:
        local = local_ranks(cfg)
    if available is None:
        if _cuda_memory(cfg):
            import torch
            available = torch.cuda.mem_get_info()[0]
        else:
            available = available_memory()
    weights = parameters * (8 if cfg.precision == "fp64" else 4)
    need = local * (reference_bytes(cfg, parameters, wire) + weights)
    if available is None or need <= available:
        return None
    gib = 2 ** 30
    return (f"the replay trains a reference on each of the {local} local rank(s) beside the run, "
            f"{need / gib:.1f} GiB, more than the {available / gib:.1f} GiB free now: replay a smaller shape of "
            "the same layout (--layers, --embed, --width) with --replay")


def check_moe(cfg: RunConfig, modality: str) -> None:
    """The mixture-of-experts options (models/moe.py) against the model and each other."""
    from ..models import MoEOptions
    from ..models.moe import check_shape
    given = [options.flag(f.name) for f in options.option_fields(MoEOptions)
             if getattr(cfg, f.name) != f.default]
    check_shape(given or (["--ep"] if cfg.ep > 1 else []), cfg.model, modality == "text", cfg.experts, cfg.top_k)
    if cfg.experts and cfg.sequence_parallel:
        raise UsageError("--experts with --sequence-parallel: each tp rank would route only its sequence "
                         "shard (another capacity and load-balancing loss than one process's); drop "
                         "--sequence-parallel")
    if cfg.experts and cfg.ep == 1:
        from ..strategies import get_strategy, strategy_names
        if not get_strategy(cfg.strategy).moe:
            able = [n for n in strategy_names() if get_strategy(n).moe]
            raise UsageError(f"--experts: a mixture of experts runs under {', '.join(able)} (and with --pp, --tp, "
                             f"--ep); not yet under {cfg.strategy!r}")


def cpu_bf16_support(cpuinfo: Path | None = None, wanted: tuple = BF16_FLAGS) -> tuple[bool | None, str]:
    """(does this CPU have native bf16 instructions (or ``wanted``'s), its name): from /proc/cpuinfo's ``flags``
    (x86) or ``Features`` (Arm) line; None where that cannot be read (not Linux: not judged)."""
    try:
        text = Path(CPUINFO if cpuinfo is None else cpuinfo).read_text(errors="replace")
    except OSError:
        return None, "this CPU"
    name, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and flags is None:
            flags = set(value.split())
        elif key == "model name" and name is None:
            name = value.strip()
    if flags is None:
        return None, name or "this CPU"
    return bool(flags & set(wanted)), name or "this CPU"


def slow_fp16(cfg: RunConfig, device) -> str | None:
    """A note for fp16 on a CPU without float16 instructions (FP16_FLAGS): it runs, on fallback kernels that
    take several times as long as fp32's (not refused as bf16 is: a check in fp16 on a small model is what it
    is for on a CPU)."""
    if cfg.precision != "fp16" or device.type != "cpu":
        return None
    native, cpu = cpu_bf16_support(wanted=FP16_FLAGS)
    if native is not False:
        return None
    return (f"--precision fp16: this CPU ({cpu}) has no float16 instructions ({', '.join(FP16_FLAGS)}), so fp16 "
            "autocast runs on slow fallback kernels (often several times slower than fp32)")


def refuse_slow_bf16(cfg: RunConfig) -> None:
    """UsageError for bf16 on a CPU device whose CPU lacks bf16 instructions (see BF16_FLAGS)."""
    if cfg.device == "cuda" or cfg.backend == "nccl":
        return
    if cfg.device == "auto":
        import torch
        if torch.cuda.is_available():
            return
    native, cpu = cpu_bf16_support()
    if native is False:
        raise UsageError(f"--precision bf16: this CPU ({cpu}) has no bfloat16 instructions ({CPUINFO} lists none "
                         f"of {', '.join(BF16_FLAGS)}), so bf16 autocast would run much slower than fp32 (slow "
                         "fallback kernels). Use --precision fp32, or add --allow-slow-bf16 to run it anyway")


def _registered(name: str):
    from ..strategies import get_strategy
    return get_strategy(name)
