"""Fully sharded data parallelism from primitives (ZeRO stages 1-3); the learner's page is ``docs/fsdp.md``.

- :mod:`.flat`: a unit's flat, padded, sharded parameters and the four
  primitives (gather, free, reduce-scatter, step);
- :mod:`.strategy`: the ``fsdp`` strategy and its options;
- :mod:`.zero1`: ZeRO stage 1 as a data-parallel flavour (``--pp``);
- :mod:`.zero23`: ZeRO stages 2 and 3 as data-parallel flavours (``--pp``);
- HSDP (``--replicate R``) in all of them: ``docs/hsdp.md``.

The memory ledger they count in is shared with ``torch-fsdp``:
:mod:`paralab.strategies.memory_ledger`.
"""
from ..memory_ledger import CATEGORIES, Ledger, optimizer_kind, optimizer_state_bytes
from .flat import FlatUnit, step_shards
from .strategy import FSDP, FSDPOptions
from .zero1 import ZeroOneReplicas
from .zero23 import ZeroThreeReplicas, ZeroTwoReplicas

__all__ = ["CATEGORIES", "FSDP", "FSDPOptions", "FlatUnit", "Ledger", "ZeroOneReplicas", "ZeroThreeReplicas",
           "ZeroTwoReplicas", "optimizer_kind",
           "optimizer_state_bytes", "step_shards"]
