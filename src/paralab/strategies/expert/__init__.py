"""``--ep N``: expert parallelism, a mixture of experts' experts split over ranks, tokens sent to them.

A mixture-of-experts gpt (``--experts E``, ``models/moe.py``) holds E expert
MLPs per block. Under ``--ep N`` the data-parallel replicas are grouped in
``ep`` groups of N neighbours (``mesh.py``); in each, rank i holds experts
``[i E/N, (i+1) E/N)`` of every block and everything else whole. Per MoE
layer and forward, on every rank of an ep group:

    route its own tokens (the router is replicated)           models/moe.py
    all-to-all the counts: rank r learns how many rows each source sends each of its experts
    all-to-all the token rows, sorted by expert, so by destination (variable sizes)
    each local expert computes the rows it received (an empty batch too)
    all-to-all the outputs back (the same splits reversed); gate and sum them per token

Backward runs the same two all-to-alls in reverse (:class:`AllToAll`). The
second dispatcher, ``--dispatcher all-gather`` (kept for comparison, as
Megatron keeps both), all-gathers every rank's tokens and gates instead, lets
each rank compute its experts' share of everything, and reduce-scatters the
outputs back: more bytes (every token to every rank), no counts, the same
outputs and gradients.

Gradients. The non-expert parameters are replicated over the whole dp group
and averaged there, as pure data parallelism does. An expert's gradient on its
rank already sums what every ep rank's tokens contributed, each rank
back-propagating the mean loss of its own shard; averaging over the ranks
that hold the same expert (the ``edp`` group) and dividing by N gives the
mean over all dp = edp x N shards, what one process computes. Both averages
are the named strategy's data-parallel flavour (``allreduce``, ``ddp``,
``gather-scatter``), one over each set of parameters, each with its
optimizer. Routing, the aux loss and the capacity are per rank's forward,
as on one process replaying the same shards (``check/reference.py``).

Under ``--tp`` (``TensorParallel`` around this strategy) the attention, the
embedding and the head are sharded over tp and every MoE layer stays whole
on each tp rank: its input is the same there, so each tp rank's ep group
sends the same tokens and the experts' gradients agree over tp.

Under ``--pp`` the two flavours are one (:class:`ExpertReplicas`), the flavour
``pipeline/strategy.py`` wraps each stage in: the stage's MoE layers keep
their ep slice, their all-to-alls run in the stage's ep group (the mesh
builds ep and edp inside each stage), and every ep rank of a stage runs the
same schedule, so their collectives meet in the same order. A rank's tensors
keep the whole model's names (:class:`ExpertSlice`), so checkpoints of any
of these layouts resume under any other (``portable``: ``--ep`` is a layout).
Not composed (refused before start): ``--sequence-parallel``, flavours that
wrap the whole module (``torch-ddp``) or shard it (``fsdp`` at ZeRO-2/3).
"""

from .dispatch import DISPATCHERS, AllGatherDispatch, AllToAllDispatch, ExpertOptions
from .replicas import ExpertReplicas, ExpertSlice, expert_index, gather_experts
from .strategy import ExpertParallel

__all__ = ["DISPATCHERS", "AllGatherDispatch", "AllToAllDispatch", "ExpertOptions", "ExpertParallel",
           "ExpertReplicas", "ExpertSlice", "expert_index", "gather_experts"]
