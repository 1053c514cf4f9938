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
sends the same tokens and the experts' gradients agree over tp. Not composed
(refused before start): ``--pp`` (a stage would need two flavours),
``--sequence-parallel``, flavours that wrap the whole module (``torch-ddp``)
or shard it (``fsdp``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import UsageError
from ..mesh import MeshShape
from ..models.moe import Routing, combine, moe_layers
from ..options import option
from .base import StepResult, Strategy, moe_record
from .replicas import Replicas

DISPATCHERS = ("all-to-all", "all-gather")


@dataclass
class ExpertOptions:
    """expert parallelism (--ep, a mixture-of-experts gpt)"""
    dispatcher: str = option("all-to-all", "how tokens reach their expert's rank under --ep: all-to-all (counts, "
                                           "then the token rows, and back) or all-gather (every token to every "
                                           "rank, outputs back by reduce-scatter; for comparison)",
                             choices=DISPATCHERS)


# ---------------------------------------------------------------- the collectives, differentiable
class AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` to rank r, ``out_splits[r]`` from it; backward: the gradients back, reversed."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits, name):
        ctx.comm, ctx.splits, ctx.name = comm, (out_splits, in_splits), name
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, name=f"{ctx.name}_backward")
        return back, None, None, None, None


class AllGather(torch.autograd.Function):
    """Every rank's rows, in rank order; backward: each rank's slice of the summed gradient."""

    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        out = x.new_empty((x.shape[0] * comm.world,) + tuple(x.shape[1:]))
        comm.all_gather_into(out, x.contiguous(), name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.comm, f"{ctx.name}_backward"), None, None


class ReduceScatter(torch.autograd.Function):
    """The sum over ranks, this rank's slice of rows; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, name):
        ctx.comm, ctx.name = comm, name
        return reduce_scatter(x, comm, name)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] * ctx.comm.world,) + tuple(grad.shape[1:]))
        ctx.comm.all_gather_into(out, grad.contiguous(), name=f"{ctx.name}_backward")
        return out, None, None


def reduce_scatter(x: torch.Tensor, comm, name: str) -> torch.Tensor:
    full = x.contiguous().clone()  # gloo's fallback all-reduces in place
    out = x.new_empty((x.shape[0] // comm.world,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, full, name=name)
    return out


# ---------------------------------------------------------------- the two dispatchers
class AllToAllDispatch:
    """A MoE layer's ``dispatch`` under --ep: counts, then tokens, out and back by all-to-all."""

    def __init__(self, comm, experts: int):
        self.comm, self.local = comm, experts // comm.world

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleList) -> torch.Tensor:
        ep, local = self.comm.world, self.local
        index, gates, counts = routing.assignments()  # kept choices sorted by expert, so by destination rank
        # 1. the counts: from every source, how many rows for each of this rank's experts
        received = torch.empty_like(counts)
        self.comm.all_to_all_single(received, counts, name="moe_counts")
        received = received.view(ep, local)
        in_splits, out_splits = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        # 2. the rows (source-major, expert within), regrouped expert-major for the experts
        rows = AllToAll.apply(tokens[index], self.comm, out_splits, in_splits, "moe_dispatch")
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(ep), received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        per_expert = received.sum(0)
        routing.stats["received"] = per_expert.tolist()
        out = torch.cat([e(part) for e, part in zip(experts, rows[order].split(per_expert.tolist()))])
        # 3. back to source-major order, and home by the reverse all-to-all
        unorder = torch.empty_like(order)
        unorder[order] = torch.arange(len(order))
        back = AllToAll.apply(out[unorder], self.comm, in_splits, out_splits, "moe_combine")
        return combine(tokens, index, gates, back)


class AllGatherDispatch:
    """The comparison: every rank's tokens, gates and choices to every rank; each computes its experts'
    share of all of them; the sum comes back by reduce-scatter."""

    def __init__(self, comm, experts: int):
        self.comm, self.local = comm, experts // comm.world
        self.first = comm.rank * self.local

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: nn.ModuleList) -> torch.Tensor:
        k = routing.expert.shape[1]
        everyone = AllGather.apply(tokens, self.comm, "moe_gather_tokens")
        gates = AllGather.apply(routing.gate, self.comm, "moe_gather_gates")
        choice = torch.where(routing.kept, routing.expert, routing.expert.new_full((), -1)).contiguous()
        choices = choice.new_empty((choice.shape[0] * self.comm.world, k))
        self.comm.all_gather_into(choices, choice, name="moe_gather_choices")
        mine = choices.reshape(-1) - self.first
        mine = torch.where((mine >= 0) & (mine < self.local), mine, mine.new_full((), self.local))
        order = torch.argsort(mine, stable=True)
        per_expert = torch.bincount(mine, minlength=self.local + 1)[:self.local]
        order = order[:int(per_expert.sum())]
        routing.stats["received"] = per_expert.tolist()
        index = order // k
        out = torch.cat([e(part) for e, part in zip(experts, everyone[index].split(per_expert.tolist()))])
        partial = combine(everyone, index, gates.reshape(-1)[order], out)
        return ReduceScatter.apply(partial, self.comm, "moe_scatter_outputs")


# ---------------------------------------------------------------- the strategy
class _Parameters(nn.Module):
    """Some of a model's parameters (the same objects), as a module a data-parallel flavour can wrap."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)


class ExpertParallel(Strategy):
    """Data parallelism whose MoE experts are split over the ep group (composed: ``--ep`` with a flavour)."""
    name = "ep"
    options = (ExpertOptions,)

    def __init__(self, ctx, model_fn, optim_fn, replicas_cls):
        super().__init__(ctx, model_fn, optim_fn)
        mesh = ctx.mesh
        self.ep_comm, self.ep = mesh.comm("ep"), mesh.size("ep")
        model = model_fn()
        if ctx.tp is not None:  # --tp: this rank's slice of every unit (the MoE layers stay whole)
            model = nn.Sequential(*ctx.shard(dict(enumerate(model))).values())
        self.layers = moe_layers(model)
        self.experts = self.layers[0].num_experts
        self.local = self.experts // self.ep
        self.first = self.ep_comm.rank * self.local
        dispatcher = AllToAllDispatch if ctx.options.dispatcher == "all-to-all" else AllGatherDispatch
        for layer in self.layers:  # keep this rank's experts only
            layer.experts = nn.ModuleList(list(layer.experts)[self.first:self.first + self.local])
            layer.dispatch = dispatcher(self.ep_comm, self.experts)
        self.model = model.to(ctx.device)
        owned = {id(p) for layer in self.layers for p in layer.experts.parameters()}
        self.expert_params = [p for p in self.model.parameters() if id(p) in owned]
        dense = [p for p in self.model.parameters() if id(p) not in owned]
        self.dense = replicas_cls(_Parameters(dense), optim_fn, mesh.comm("dp"), ctx)       # over dp
        self.sparse = replicas_cls(_Parameters(self.expert_params), optim_fn, mesh.comm("edp"), ctx)  # over edp
        self.flavours = (self.dense, self.sparse)
        for f in self.flavours:
            f.broadcast_parameters()
        self.microbatches = ctx.options.accumulate

    # ------------------------------------------------------------ declarations
    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        from . import get_strategy, strategy_names
        if cfg.pp > 1:
            raise UsageError(f"--ep {cfg.ep} is not composed with --pp yet: drop one (a stage would need two "
                             "data-parallel flavours, over dp and over edp)")
        if cfg.experts == 0:
            raise UsageError(f"--ep {cfg.ep} splits a mixture of experts: add --model gpt --experts E")
        if cls.flavour_of(get_strategy(cfg.strategy), cfg) is None:
            able = [n for n in strategy_names() if cls.flavour_of(get_strategy(n), cfg) is not None]
            raise UsageError(f"--ep needs a data-parallel flavour that averages a set of parameters over a group "
                             f"({', '.join(able)}); strategy {cfg.strategy!r} is not one")
        if cfg.experts % cfg.ep:
            raise UsageError(f"--experts {cfg.experts} must be divisible by --ep {cfg.ep} (each rank holds "
                             "experts / ep of them)")
        return MeshShape.for_world(world, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep)

    @staticmethod
    def flavour_of(named, cfg):
        """The data-parallel flavour of strategy class ``named`` that this strategy can use twice (over the
        non-expert parameters and over the experts'), or None: a flavour that wraps the whole module for
        its forward (PyTorch's DDP) cannot be given a set of parameters."""
        from .data_parallel import DataParallel
        flavour = named.pipeline_replicas(cfg) if issubclass(named, DataParallel) else None
        if flavour is None or flavour.forward_module is not Replicas.forward_module:
            return None
        return flavour

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        self.model.train()
        for f in self.flavours:
            f.start()
        loss = self.forward_backward(self.model, x, y, before_last=self._all("accumulating"),
                                     last=self._all("last_backward"))
        for f in self.flavours:
            f.finish()
        with torch.no_grad():  # the experts' gradients: mean over edp so far, to the mean over dp
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(self.ep)
        for f in self.flavours:
            f.step()
            f.sync_buffers()
        return StepResult(loss, len(y), moe=moe_record(self.model))

    def _all(self, method: str):
        def entered():
            stack = contextlib.ExitStack()
            for f in self.flavours:
                stack.enter_context(getattr(f, method)())
            return stack
        return entered

    def predict(self, x):
        return self.eval_logits(self.model, x)  # a collective: every ep rank routes its own batch

    # ------------------------------------------------------------ the whole model, and this rank's part
    def full_state_dict(self):
        """Plain keys; every expert gathered from the rank holding it (a collective over ep)."""
        local = {k: v.detach() for k, v in self.model.state_dict().items()}
        whole = {k: v.clone() for k, v in local.items() if ".experts." not in k}
        for prefix, module in self.model.named_modules():
            if module not in self.layers:
                continue
            for name in dict(module.experts[0].named_parameters()):
                stacked = torch.stack([local[f"{prefix}.experts.{j}.{name}"] for j in range(self.local)])
                out = stacked.new_empty((self.experts,) + tuple(stacked.shape[1:]))
                self.ep_comm.all_gather_into(out, stacked.contiguous(), name="ep_gather_weights")
                for e in range(self.experts):
                    whole[f"{prefix}.experts.{e}.{name}"] = out[e].clone()
        return whole

    def state_dict(self):
        return {"model": self.model.state_dict(), "dense": self.dense.state_dict(),
                "experts": self.sparse.state_dict(), "ep": {"rank": self.ep_comm.rank, "size": self.ep}}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.dense.load_state_dict(state["dense"])
        self.sparse.load_state_dict(state["experts"])

    @classmethod
    def consolidate(cls, states, model):
        """Offline: the non-expert tensors from any rank (they are replicated), each expert from a rank
        whose ep index holds it (``paralab export``)."""
        size = states[0]["ep"]["size"]
        local = moe_layers(model)[0].num_experts // size
        by_slice = {s["ep"]["rank"]: s["model"] for s in states}
        whole = {}
        for key in model.state_dict():
            if ".experts." not in key:
                whole[key] = states[0]["model"][key]
                continue
            prefix, rest = key.split(".experts.", 1)
            e, name = rest.split(".", 1)
            whole[key] = by_slice[int(e) // local][f"{prefix}.experts.{int(e) % local}.{name}"]
        return whole

    def extra_summary(self) -> dict:
        return {"expert_parallel": {"ep": self.ep, "rank": self.ep_comm.rank, "experts": list(
            range(self.first, self.first + self.local)), "dispatcher": self.ctx.options.dispatcher,
            "flavour": self.dense.flavour}}
