"""Record kinds: what strategies tell the analysis, declared in one place.

Everything measured is a *span* (``recorder.Span``: rank, step, category,
name, t0, t1, bytes, args). The analysis (``paralab.analysis``) derives
figures from spans by their category, their name and a few ``args`` keys,
never from which strategy wrote them; this module names those.

Span categories:

- ``data``: loading this rank's samples;
- ``compute``: named ``forward`` or ``backward`` (``args.mb``: the
  microbatch; ``args.unit``: the unit, where a strategy goes unit by unit;
  ``args.stage``: a pipeline rank's stage), or ``backward_input`` and
  ``backward_weight`` where a pipeline splits the backward (zero bubble);
- ``comm``: one per collective or send/recv, with ``bytes`` and ``args.op``
  (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
  ``gather``, ``scatter``, ``all_to_all``, ``send``, ``recv``, ``barrier``). An asynchronous
  operation is one span with ``args.async`` covering launch to completion,
  plus a synchronous span named ``wait:<name>`` for the time the rank
  blocked on it;
- ``optimizer``: the optimizer step;
- ``idle``: waiting on a peer with nothing else to do (a pipeline stage
  waiting for an activation or a gradient: ``wait:recv_*``).

Detail records: figures a strategy alone knows (its bucket layout, its
stage's units, what its memory model is) go in ``summary.json``'s
``strategy_details`` per rank, under the keys below; the ones the analysis
reads are typed here (:class:`StageRecord`, :class:`MemoryModel`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

# span categories
DATA, COMPUTE, COMM, OPTIMIZER, IDLE = "data", "compute", "comm", "optimizer", "idle"
CATEGORIES = (DATA, COMPUTE, COMM, OPTIMIZER, IDLE)

# compute span names
FORWARD, BACKWARD = "forward", "backward"
# a pipeline's backward split in two (zero-bubble schedules): the input gradient, then the weights'
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"

# span args and naming
ASYNC = "async"          # args key: an asynchronous operation's in-flight interval
UNSEEN = "unseen"        # args key, beside ASYNC: the backend reports no completion (gloo's send and recv), so
                         # the interval ends where the rank's wait() returned: an upper bound, not an overlap
WAIT_PREFIX = "wait:"    # name prefix: the rank blocked on an asynchronous operation

# detail record keys (strategy_details[rank])
STAGE = "stage"      # this rank is a pipeline stage: a StageRecord's fields
BUCKETS = "buckets"  # a bucketed all-reduce's layout (ddp)
MEMORY = "memory"    # a sharded strategy's {"model": a MemoryModel}; a reader adds "predicted" (measured: HELD)
UNCOUNTED_COMM = "uncounted_comm"  # this rank also communicated outside comm.py (e.g. a library's own hook), so
                                   # its recorded bytes are not all it sent: why, as a string
ALLOCATOR = "allocator"  # CUDA only: the allocator's peak bytes per step (recorder.allocator_peaks); where a
                         # memory record has a prediction, records put it beside it (memory["allocator"])
HELD = "held"  # every device: the saved-activation peak and model states of a start's first step (run/held.py)


@dataclass
class StageRecord:
    """A pipeline stage: what the analysis needs to put its measured bubble and microbatches alive
    beside their theory, and what only the stage knows."""
    stage: int                  # its index in the pipeline
    stages: int                 # P
    microbatches: int           # M
    schedule: str               # gpipe | 1f1b | naive (one microbatch)
    dp_replica: int             # which data-parallel replica of the pipeline this rank belongs to
    units: list[int]            # [first, last + 1] of the model's units
    unit_labels: list[str]
    stage_parameters: int
    partition: str              # how the cut was chosen
    ranges: list[list[int]]     # every stage's units
    time_share: float | None    # this stage's share of the measured unit times (balanced partition)
    peak_activation_bytes: int  # the most bytes autograd saved for the microbatches alive at once
    data_parallel: dict         # the flavour wrapping the stage: name, replicas, its own figures

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryModel:
    """What a memory ledger's strategy holds, for the cost model (analysis/memory.py) to predict."""
    parameters: int             # Psi
    workers: int                # N, the ranks the states are sharded over
    zero_stage: int             # 0 (replicated) to 3
    optimizer: str              # sgd | sgd-momentum | adam
    precision: str              # fp32 | mixed
    unit_parameters: int        # the largest unit's parameters (its working set)
    step_in_backward: bool = False

    def to_dict(self) -> dict:
        return asdict(self)
