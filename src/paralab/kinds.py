"""Record kinds: what strategies tell the analysis, declared in one place.

Everything measured is a *span* (``recorder.Span``: rank, step, category,
name, t0, t1, bytes, args). The analysis (``paralab.analysis``) derives
figures from spans by their category, their name and a few ``args`` keys,
never from which strategy wrote them; this module names those.

Span categories:

- ``data``: loading this rank's samples;
- ``compute``: named ``forward`` or ``backward`` (``args.mb``: the
  microbatch; ``args.unit``: the unit, where a strategy goes unit by unit);
- ``comm``: one per collective or send/recv, with ``bytes`` and ``args.op``
  (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
  ``gather``, ``scatter``, ``send``, ``recv``, ``barrier``). An asynchronous
  operation is one span with ``args.async`` covering launch to completion,
  plus a synchronous span named ``wait:<name>`` for the time the rank
  blocked on it;
- ``optimizer``: the optimizer step;
- ``idle``: waiting on a peer with nothing else to do (a pipeline stage
  waiting for an activation or a gradient: ``wait:recv_*``).

Detail records: figures a strategy alone knows (its bucket layout, its
stage's units, its memory ledger) go in ``summary.json``'s
``strategy_details`` per rank, under the keys below.
"""
from __future__ import annotations

# span categories
DATA, COMPUTE, COMM, OPTIMIZER, IDLE = "data", "compute", "comm", "optimizer", "idle"
CATEGORIES = (DATA, COMPUTE, COMM, OPTIMIZER, IDLE)

# compute span names
FORWARD, BACKWARD = "forward", "backward"

# span args and naming
ASYNC = "async"          # args key: an asynchronous operation's in-flight interval
WAIT_PREFIX = "wait:"    # name prefix: the rank blocked on an asynchronous operation

# detail record keys (strategy_details[rank])
STAGE = "stage"                  # this rank is a pipeline stage: its index, units, schedule, microbatches
BUCKETS = "buckets"              # a bucketed all-reduce's layout (ddp)
DATA_PARALLEL = "data_parallel"  # the data-parallel flavour wrapping a pipeline stage
MEMORY = "memory"                # a memory ledger (measured) beside the cost model (predicted)
