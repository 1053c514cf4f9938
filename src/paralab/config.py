"""RunConfig: every option of a run, documented once, validated before any worker starts.

The run's own options are fields here; the strategies' options are declared
in the strategies' files and come in by inheritance
(``strategies.options.StrategyOptions``), so each is written once. The CLI
builds a RunConfig from its flags; ``validate()`` raises UsageError (exit
code 2) with a message saying what to change. Workers receive the validated
config and never re-check it.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import options
from .errors import UsageError
from .strategies.options import OPTION_CLASSES, StrategyOptions

OPTIMIZERS = ("sgd", "adam")
PRECISIONS = ("fp32", "bf16", "fp64")
NORMS = ("batch", "none")
BACKENDS = ("auto", "gloo", "nccl")
CPUINFO = Path("/proc/cpuinfo")  # where the CPU's features are read (tests point it at their own)
# Native bfloat16 instructions, as /proc/cpuinfo names them: x86 AVX512-BF16 and AMX-BF16 (and
# AVX-NE-CONVERT, which oneDNN uses for bf16 on AVX2-class cores), Arm's BF16 extension. Without
# them PyTorch's CPU bf16 kernels fall back to conversions and reference code: VGG-11 ran 19x
# slower in bf16 than in fp32 on a 2-core AVX2 AMD EPYC.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16")


@dataclass
class RunConfig(StrategyOptions):
    # what to train
    strategy: str = "single"          #: strategy name (see `paralab train --help`)
    model: str = "vgg11"              #: vgg11 | vgg13 | vgg16 | vgg19 | resnet18 | vgg16-cs1390[-pool] | gpt
    width: float = 1.0                #: channel multiplier (0.25 for fast runs)
    norm: str | None = None           #: batch | none (BatchNorm-free); None: the model's own (validate sets it)
    # data
    dataset: str = "auto"             #: auto | cifar10 | fashion-mnist | synthetic | jargon | synthetic-text
    data_dir: str | None = None       #: folder with the dataset files
    synthetic_size: int = 10000       #: training samples of the synthetic set
    augment: bool = True              #: random crop (pad 4) + horizontal flip
    drop_last: bool = False           #: epochs of n // B full global batches: no sample repeated, none padded
    # optimisation
    batch_size: int = 256             #: global batch (split over data-parallel workers)
    per_worker_batch: int | None = None  #: per-worker batch instead (weak scaling)
    epochs: int = 1                   #: epochs to train, unless num_batches is given
    num_batches: int | None = None    #: train exactly this many steps
    optimizer: str = "sgd"            #: sgd | adam
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    seed: int = 0
    precision: str = "fp32"           #: fp32 | bf16 (autocast) | fp64 (everything in float64: exact checks)
    lr_scaling: str = "none"          #: none | linear (lr x global batch / 256, Goyal et al.)
    warmup_epochs: float = 0.0        #: linear lr warm-up over this many epochs
    allow_slow_bf16: bool = False     #: run bf16 on a CPU without bf16 instructions (about 19x slower)
    # reporting
    log_every: int = 20               #: print the loss every N steps
    warmup: int = 1                   #: first N steps left out of timing averages
    eval_batches: int | None = None   #: bound the test evaluation (None: whole test split)
    eval_batch_size: int = 500
    out: str | None = None            #: run directory (default runs/<strategy>-w<N>-<time>)
    progress: bool = True             #: progress bar on rank 0
    # checkpoints and verification
    checkpoint_every: int = 0         #: save resumable state every N steps (0: at the end only)
    resume: str | None = None         #: run directory to resume from
    check: bool = False               #: compare with the single-process reference
    save_init: bool = False           #: also save the starting weights (checkpoint/init/, `paralab export --init`)
    check_every: int = 0              #: with check: also compare every N steps (the deviation's growth)
    # launch
    workers: int = 1                  #: local worker processes
    cores_per_worker: int | None = None  #: pin rank r to cores [rC, rC+C)
    world_size: int | None = None     #: manual multi-node: total ranks
    rank: int | None = None           #: manual multi-node: this process's rank
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    backend: str = "auto"             #: auto | gloo | nccl
    device: str = "auto"              #: auto | cpu | cuda
    timeout: float = 60.0             #: seconds before a stuck collective fails the run
    network: str | None = None        #: emulated link per local rank: RATE[,LATENCY] (network.py), e.g. 1gbit
    # the strategies' options: inherited from StrategyOptions (pp, microbatches, bucket_mb, zero_stage...)
    # filled in by the launcher, for the record
    launched_by: str = "local"
    network_emulated: dict | None = None  #: the links the launcher built for --network (network.Network.record)

    # ---------------------------------------------------------------- derived
    @property
    def world(self) -> int:
        if self.world_size is not None:
            return self.world_size
        if "WORLD_SIZE" in os.environ and self.launched_by == "torchrun":
            return int(os.environ["WORLD_SIZE"])
        return self.workers

    def strategy_options(self) -> StrategyOptions:
        """The strategies' options alone, typed: what a strategy receives as ``ctx.options``."""
        return options.project(self, StrategyOptions)

    def default_out(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return str(Path("runs") / f"{self.strategy}-w{self.world}-{stamp}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        """The inverse of :meth:`to_dict` (how ``paralab.runner`` hands a config to its child);
        keys that are not fields (e.g. config.json's environment) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # ---------------------------------------------------------------- checks
    def validate(self) -> "RunConfig":
        from .data import check_dataset
        from .models import MODELS
        from .strategies import get_strategy, plan

        def positive(name, value, allow_none=False):
            if value is None and allow_none:
                return
            if value is None or value <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive (got {value})")

        named_cls = get_strategy(self.strategy)
        for cls in OPTION_CLASSES:
            options.check(self, cls)
        if self.model not in MODELS:
            raise UsageError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        for name in ("width", "batch_size", "epochs", "lr", "log_every", "eval_batch_size",
                     "synthetic_size", "workers", "timeout"):
            positive(name, getattr(self, name))
        for name in ("num_batches", "per_worker_batch", "eval_batches", "cores_per_worker", "world_size"):
            positive(name, getattr(self, name), allow_none=True)
        if self.check_every < 0 or (self.check_every and not self.check):
            raise UsageError("--check-every N compares with the reference every N steps: it needs --check "
                             "and N >= 1")
        if self.warmup < 0 or self.checkpoint_every < 0:
            raise UsageError("--warmup and --checkpoint-every must be zero or positive")
        if self.lr_scaling not in ("none", "linear"):
            raise UsageError(f"--lr-scaling must be none or linear (got {self.lr_scaling!r})")
        if self.warmup_epochs < 0:
            raise UsageError("--warmup-epochs must be zero or positive")
        if self.momentum < 0 or self.weight_decay < 0:
            raise UsageError("--momentum and --weight-decay must be zero or positive")
        from .models import DEFAULT_NORM, MODALITY
        if self.norm is None:  # the model's own: BatchNorm, but none for CS1390's plain VGG-16s and the gpt
            self.norm = DEFAULT_NORM[self.model]
        if MODALITY[self.model] == "text":
            if self.norm != "none":
                raise UsageError(f"--model {self.model} is a transformer with LayerNorm; --norm {self.norm} applies "
                                 "to the CNNs only: leave --norm out")
            if self.embed % self.heads:
                raise UsageError(f"--embed {self.embed} must be divisible by --heads {self.heads} "
                                 "(each head gets embed / heads features)")
        for name, allowed in (("norm", NORMS), ("optimizer", OPTIMIZERS), ("precision", PRECISIONS),
                              ("backend", BACKENDS), ("device", ("auto", "cpu", "cuda"))):
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if self.check and self.precision == "bf16":
            raise UsageError("--check compares fp32 or fp64 arithmetic with a reference; autocast's bf16 "
                             "rounding is not replayed: drop --precision bf16 (or use fp64 for an exact check)")
        if (self.world_size is None) != (self.rank is None):
            raise UsageError("manual multi-node needs both --world-size and --rank")
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise UsageError(f"--rank must be in [0, {self.world_size}) (got {self.rank})")
        if self.world_size is not None and self.workers != 1:
            raise UsageError("--workers starts local processes; with --world-size/--rank "
                             "run one command per rank instead")
        from .strategies import compression  # --compress: which strategies take it, what cannot resume
        compression.validate(self, named_cls)
        if self.network is not None:
            from .network import check_can_emulate, parse
            if self.world_size is not None or self.launched_by == "torchrun":
                raise UsageError("--network emulates links between local workers (--workers N); with "
                                 "--world-size/--rank or torchrun the ranks use the real network: drop --network")
            if self.workers > 1:
                check_can_emulate(parse(self.network))
            else:
                parse(self.network)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be a TCP port (got {self.master_port})")
        if self.cores_per_worker is not None and self.world_size is None:
            cores = os.cpu_count() or 1
            if self.cores_per_worker * self.workers > cores:
                raise UsageError(f"--cores-per-worker {self.cores_per_worker} x --workers {self.workers} "
                                 f"needs {self.cores_per_worker * self.workers} cores; this machine has {cores}")
        if self.device == "cuda" or self.backend == "nccl":
            import torch
            if not torch.cuda.is_available():
                raise UsageError("CUDA/NCCL asked for but no GPU is visible; use --device cpu (gloo)")
        if self.precision == "bf16" and not self.allow_slow_bf16:
            refuse_slow_bf16(self)
        world = self.world
        shape, strategy_cls, _ = plan(self, world)
        if self.per_worker_batch is None and self.batch_size % shape.dp:
            raise UsageError(f"--batch-size {self.batch_size} must divide evenly over "
                             f"{shape.dp} data-parallel replicas; change it or use --per-worker-batch")
        named_cls.validate(self, world)
        if strategy_cls is not named_cls:
            strategy_cls.validate(self, world)  # the pipeline a data-parallel flavour is composed with
        check_dataset(self.dataset, Path(self.data_dir) if self.data_dir else None, model=self.model,
                      context=self.context)
        if self.drop_last:
            from .data import train_size
            n = train_size(self.dataset, Path(self.data_dir) if self.data_dir else None, self.synthetic_size,
                           model=self.model, context=self.context)
            batch = self.batch_size if self.per_worker_batch is None else self.per_worker_batch * shape.dp
            if n < batch:
                raise UsageError(f"--drop-last: the {n} training samples make no full global batch of {batch}; "
                                 "lower the batch size or drop --drop-last")
        if self.check:  # a comparison fp32 cannot vouch for (Strategy.check_limit): refused before anything starts
            from .strategies import check_limit
            why = check_limit(self, self.world)
            if why:
                raise UsageError(f"--check of {self.strategy} on {self.model} in {self.precision} would report a "
                                 f"FAIL that is no bug, so it is refused: {why}")
        if self.resume:
            from .checkpoint import check_resumable
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


def cpu_bf16_support(cpuinfo: Path | None = None) -> tuple[bool | None, str]:
    """(does this CPU have native bf16 instructions, its name): from /proc/cpuinfo's ``flags``
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
    return bool(flags & set(BF16_FLAGS)), name or "this CPU"


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
                         f"of {', '.join(BF16_FLAGS)}), so bf16 autocast would run on slow fallback kernels "
                         "(VGG-11: 19x slower than fp32 on an AVX2-only AMD EPYC). Use --precision fp32, or "
                         "add --allow-slow-bf16 to run it anyway")


def _registered(name: str):
    from .strategies import get_strategy
    return get_strategy(name)
