"""Every strategy's and dimension's options (and the transformer's shape), gathered into one namespace.

Each option is declared once, in the file of the strategy or dimension that
reads it (``paralab.options`` says how). This class only collects them, so
that ``RunConfig`` and the command line expose one flat set of flags
(``--bucket-mb``, ``--microbatches``, ``--pp``...) and a strategy receives
them typed, as ``ctx.options``. A new strategy with options of its own adds
its class to the bases below.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..mesh import MeshOptions
from ..models.gpt import GPTOptions
from ..models.moe import MoEOptions
from ..training.recompute import RecomputeOptions
from .compression import CompressOptions
from .context import ContextOptions
from .data_parallel import AccumulateOptions
from .ddp import BucketOptions
from .expert import ExpertOptions
from .fsdp.strategy import FSDPOptions
from .torch_dp import DataParallelOptions
from .pipeline.strategy import PipelineOptions
from .tensor.strategy import TensorOptions

#: in the order the command line lists them
OPTION_CLASSES = (MeshOptions, PipelineOptions, TensorOptions, AccumulateOptions, BucketOptions, CompressOptions,
                  FSDPOptions, DataParallelOptions, ExpertOptions, GPTOptions, MoEOptions,
                  ContextOptions)
OPTION_CLASSES += (RecomputeOptions,)  # activation recomputation (training/recompute.py)


@dataclass
class StrategyOptions(*reversed(OPTION_CLASSES)):
    """The options of every strategy and parallelism dimension (each declared in its own file)."""
