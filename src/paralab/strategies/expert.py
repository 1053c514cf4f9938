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
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import UsageError
from ..mesh import MeshShape
from ..models.moe import Routing, combine, moe_layers
from ..options import option
from .base import StepResult, Strategy, broadcast_buffers, moe_record
from .portable import Portable, trainable
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


# ---------------------------------------------------------------- the two flavours, as one
class _Parameters(nn.Module):
    """Some of a model's parameters (the same objects), as a module a data-parallel flavour can wrap."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)


class ExpertSlice(nn.Module):
    """Experts ``[first, first + n)`` of a MoE layer under their own indices, so a rank's ``state_dict``
    keys are the whole model's (``experts.<e>.fc.weight``); iterated and indexed as a list of its experts."""

    def __init__(self, experts: list[nn.Module], first: int):
        super().__init__()
        for j, expert in enumerate(experts):
            self.add_module(str(first + j), expert)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, j: int) -> nn.Module:
        return list(self._modules.values())[j]


EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The expert a plain parameter name belongs to (``3.mlp.experts.2.fc.weight``: 2), None if none."""
    m = EXPERT_KEY.search(name)
    return int(m.group(1)) if m else None


def inner_of(state: dict) -> type[Replicas]:
    """The flavour class that reads one of the two saved states (``data_parallel.flavour_of``'s rule:
    ZeRO-1's holds shards, every other flavour the whole optimizer state)."""
    if "zero1" in state:
        from .fsdp.zero1 import ZeroOneReplicas
        return ZeroOneReplicas
    return Replicas


class ExpertReplicas(Replicas):
    """The data-parallel flavour of a module holding MoE layers under --ep: ``inner`` (the named
    strategy's flavour) twice, over the non-expert parameters on ``comm`` (dp) and over this rank's
    experts on the ``edp`` group, the experts' mean then divided by ep (the module docstring). Built
    on a module, it keeps this rank's experts of each of its MoE layers (their ep slice) and points the
    layers' dispatch at the ``ep`` group. The whole model (:class:`ExpertParallel`) or one pipeline
    stage's units (``--ep`` with ``--pp``: ``pipeline/strategy.py`` wraps each stage in it, and the
    all-to-alls of a stage's MoE layers run among the ranks holding that stage). ``over(inner)`` makes
    the class for one inner flavour."""

    inner: type[Replicas] = Replicas

    @classmethod
    def over(cls, inner: type[Replicas]) -> type["ExpertReplicas"]:
        return type(f"Expert{inner.__name__}", (cls,), {"inner": inner, "flavour": inner.flavour})

    def __init__(self, module: nn.Module, optim_fn, comm, ctx):
        mesh = ctx.mesh
        self.module, self.comm, self.ctx, self.rec = module, comm, ctx, ctx.recorder
        self.ep_comm, self.ep = mesh.comm("ep"), mesh.size("ep")
        self.layers = moe_layers(module)
        self.experts = self.layers[0].num_experts if self.layers else 0
        self.local = self.experts // self.ep
        self.first = self.ep_comm.rank * self.local
        dispatcher = AllToAllDispatch if ctx.options.dispatcher == "all-to-all" else AllGatherDispatch
        for layer in self.layers:  # keep this rank's experts only
            layer.experts = ExpertSlice(list(layer.experts)[self.first:self.first + self.local], self.first)
            layer.dispatch = dispatcher(self.ep_comm, self.experts)
        owned = {id(p) for layer in self.layers for p in layer.experts.parameters()}
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.expert_params = [p for p in self.params if id(p) in owned]
        self.dense = self.inner(_Parameters([p for p in self.params if id(p) not in owned]), optim_fn, comm, ctx)
        self.sparse = (self.inner(_Parameters(self.expert_params), optim_fn, mesh.comm("edp"), ctx)
                       if self.expert_params else None)  # a pipeline stage without a MoE layer has none
        self.parts = [f for f in (self.dense, self.sparse) if f is not None]
        for unit in module.children():  # its tensors read (a checkpoint): none may be in flight
            unit.register_state_dict_pre_hook(lambda *_: self.settle())

    def settle(self) -> None:
        """Wait for what a part's last step left in flight (ZeRO-1's all-gather of the parameters): the
        parameter sets the parts wrap are never called, so their own forward hooks never fire."""
        for f in self.parts:
            if hasattr(f, "settle"):
                f.settle()

    @property
    def optimizer(self):
        return self.dense.optimizer

    def broadcast_parameters(self) -> None:
        for f in self.parts:
            f.broadcast_parameters()

    # ------------------------------------------------------------ one step: each phase on both
    def start(self) -> None:
        self.settle()  # the weights are about to be read by the step's forwards
        for f in self.parts:
            f.start()

    def accumulating(self):
        return self._all("accumulating")

    def last_backward(self):
        return self._all("last_backward")

    def _all(self, method: str):
        stack = contextlib.ExitStack()
        for f in self.parts:
            stack.enter_context(getattr(f, method)())
        return stack

    def finish(self) -> None:
        for f in self.parts:
            f.finish()
        if self.sparse is None:
            return
        with torch.no_grad():  # the experts' gradients: mean over edp so far, to the mean over dp (those
            for group in self.sparse.optimizer.param_groups:  # the optimizer steps: ZeRO-1's are its shards)
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self.ep)

    def step(self) -> None:
        for f in self.parts:
            f.step()

    def sync_buffers(self, after_step: bool = True) -> None:
        for f in self.parts:
            f.sync_buffers(after_step)
        broadcast_buffers(self.comm, self.module)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "experts": self.sparse.state_dict() if self.sparse else None,
                "ep": {"rank": self.ep_comm.rank, "size": self.ep, "experts": self.experts}}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        if self.sparse is not None:
            self.sparse.load_state_dict(state["experts"])

    @staticmethod
    def _split(named, ep: dict):
        """(plain name, parameter) pairs -> the non-expert ones, and per ep rank the experts it holds."""
        local = ep["experts"] // ep["size"] if ep["experts"] else 1
        dense = [(n, p) for n, p in named if expert_index(n) is None]
        slices: dict[int, list] = {}
        for n, p in named:
            if expert_index(n) is not None:
                slices.setdefault(expert_index(n) // local, []).append((n, p))
        return dense, slices

    @staticmethod
    def _renamed(inner, states, named):
        """``inner``'s ``optimizer_portable`` of one parameter set (its unit, as the flavour holds it: the
        list of ``named``'s parameters, plain names ``0.<k>``), the names mapped back."""
        out = inner.optimizer_portable(states, {0: nn.ParameterList([p for _, p in named])})
        return {named[int(k.rsplit(".", 1)[1])][0]: v for k, v in out.items()}

    @classmethod
    def optimizer_portable(cls, states: list[dict], units: dict) -> dict[str, dict]:
        """Offline: the flavour states of the module's dp replicas in dp order (the model's, or under a
        pipeline one stage's) -> each parameter's whole optimizer state: the non-expert parameters' from
        every replica (ZeRO-1 shards them over all), each expert's from the replicas holding it, its edp
        group in order. ``units``: the plain model's (every expert)."""
        dense, slices = cls._split(trainable(units), states[0]["ep"])
        out = cls._renamed(inner_of(states[0]["dense"]), [s["dense"] for s in states], dense)
        for rank in sorted({s["ep"]["rank"] for s in states}):
            group = [s["experts"] for s in states if s["ep"]["rank"] == rank]
            if group[0] is not None:
                out |= cls._renamed(inner_of(group[0]), group, slices[rank])
        return out

    def state_from_portable(self, portable, units: dict) -> dict:
        """This rank's flavour states, non-expert and expert, from a ``Portable`` (``units`` as the module
        holds them: this rank's experts only)."""
        named = trainable(units)
        dense, slices = self._split(named, {"experts": self.experts, "size": self.ep})
        out = {"ep": {"rank": self.ep_comm.rank, "size": self.ep, "experts": self.experts}, "experts": None}
        for key, flavour, part in (("dense", self.dense, dense), ("experts", self.sparse,
                                                                  slices.get(self.ep_comm.rank, []))):
            if flavour is None:
                continue
            local = Portable({f"0.{k}": portable.tensors[n] for k, (n, _) in enumerate(part)},
                             {f"0.{k}": portable.optimizer[n] for k, (n, _) in enumerate(part)
                              if n in portable.optimizer})
            out[key] = flavour.state_from_portable(local, {0: flavour.module.params})
        return out

    def summary(self) -> dict:
        return {"ep": self.ep, "experts_held": list(range(self.first, self.first + self.local)),
                **self.dense.summary()}


# ---------------------------------------------------------------- the strategy
class ExpertParallel(Strategy):
    """Data parallelism whose MoE experts are split over the ep group (composed: ``--ep`` with a flavour)."""
    name = "ep"
    options = (ExpertOptions,)

    def __init__(self, ctx, model_fn, optim_fn, replicas_cls):
        super().__init__(ctx, model_fn, optim_fn)
        model = model_fn()
        if ctx.tp is not None:  # --tp: this rank's slice of every unit (the MoE layers stay whole)
            model = nn.Sequential(*ctx.shard(dict(enumerate(model))).values())
        self.model = model.to(ctx.device)
        self.flavour = ExpertReplicas.over(replicas_cls)(self.model, optim_fn, ctx.mesh.comm("dp"), ctx)
        self.flavour.broadcast_parameters()
        self.ep_comm, self.ep = self.flavour.ep_comm, self.flavour.ep
        self.layers, self.experts, self.local = self.flavour.layers, self.flavour.experts, self.flavour.local
        self.microbatches = ctx.options.accumulate

    # ------------------------------------------------------------ declarations
    @classmethod
    def mesh_shape(cls, cfg, world: int) -> MeshShape:
        from . import get_strategy, strategy_names
        if cfg.experts == 0:
            raise UsageError(f"--ep {cfg.ep} splits a mixture of experts: add --model gpt --experts E")
        named = get_strategy(cfg.strategy)
        if cls.flavour_of(named, cfg) is None:
            able = [n for n in strategy_names() if cls.flavour_of(get_strategy(n), cfg) is not None]
            why = (named.why_not_pipelined(cfg) if named.pipeline_replicas(cfg) is None else
                   "its flavour wraps the whole model for the forward, so it cannot be given a set of parameters")
            raise UsageError(f"--ep needs a data-parallel flavour that averages a set of parameters over a group "
                             f"({', '.join(able)}); strategy {cfg.strategy!r} is not one: {why}")
        if cfg.experts % cfg.ep:
            raise UsageError(f"--experts {cfg.experts} must be divisible by --ep {cfg.ep} (each rank holds "
                             "experts / ep of them)")
        return MeshShape.for_world(world, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep)

    @staticmethod
    def flavour_of(named, cfg):
        """The data-parallel flavour of strategy class ``named`` that this strategy can use twice (over the
        non-expert parameters and over the experts'), or None: a flavour that wraps the whole module for
        its forward (PyTorch's DDP) cannot be given a set of parameters."""
        flavour = named.pipeline_replicas(cfg)  # None but for the data-parallel strategies
        if flavour is None or flavour.forward_module is not Replicas.forward_module:
            return None
        return flavour

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        self.model.train()
        f = self.flavour
        f.start()
        loss = self.forward_backward(self.model, x, y, before_last=f.accumulating, last=f.last_backward)
        f.finish()
        f.step()
        f.sync_buffers()
        return StepResult(loss, len(y), moe=moe_record(self.model))

    def predict(self, x):
        self.flavour.sync_buffers(after_step=False)
        return self.eval_logits(self.model, x)  # a collective: every ep rank routes its own batch

    # ------------------------------------------------------------ the whole model, and this rank's part
    def full_state_dict(self):
        """Plain keys; every expert gathered from the rank holding it (a collective over ep)."""
        self.flavour.sync_buffers(after_step=False)
        return gather_experts(self.model, self.flavour)

    def state_dict(self):
        self.flavour.sync_buffers(after_step=False)
        return {"model": self.model.state_dict(), **self.flavour.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.flavour.load_state_dict(state)

    @classmethod
    def consolidate(cls, states, model):
        """Offline: every rank's tensors under the whole model's names (each holds the non-expert ones
        and its experts'), their union (``paralab export``)."""
        whole = {}
        for state in states:
            for k, v in state["model"].items():
                whole.setdefault(k, v)
        return whole

    @classmethod
    def portable(cls, states, model):
        """Offline: the tensors as :meth:`consolidate`; the optimizer state of the non-expert parameters
        from the dp replicas, each expert's from the replicas holding it (``states``: the dp replicas in
        order, as the ranks are without --pp and --tp)."""
        return Portable(cls.consolidate(states, model),
                        ExpertReplicas.optimizer_portable(states, dict(enumerate(model))))

    def load_portable(self, portable):
        """This rank's experts and the non-expert tensors, and both flavours' optimizer state."""
        self.load_state_dict({"model": {k: portable.tensors[k] for k in self.model.state_dict()},
                              **self.flavour.state_from_portable(portable, dict(enumerate(self.model)))})

    def extra_summary(self) -> dict:
        return {"expert_parallel": {"ep": self.ep, "rank": self.ep_comm.rank, "experts": list(
            range(self.flavour.first, self.flavour.first + self.local)), "dispatcher": self.ctx.options.dispatcher,
            "flavour": self.flavour.dense.flavour}}


def gather_experts(module: nn.Module, flavour: ExpertReplicas) -> dict[str, torch.Tensor]:
    """``module``'s tensors under plain keys, each MoE layer's experts gathered from the ep ranks holding
    them (a collective over ep: every rank holds the same layers)."""
    local = {k: v.detach() for k, v in module.state_dict().items()}
    whole = {k: v.clone() for k, v in local.items() if expert_index(k) is None}
    for prefix, layer in module.named_modules():
        if layer not in flavour.layers:
            continue
        for name in dict(layer.experts[0].named_parameters()):
            stacked = torch.stack([local[f"{prefix}.experts.{flavour.first + j}.{name}"]
                                   for j in range(flavour.local)])
            out = stacked.new_empty((flavour.experts,) + tuple(stacked.shape[1:]))
            flavour.ep_comm.all_gather_into(out, stacked.contiguous(), name="ep_gather_weights")
            for e in range(flavour.experts):
                whole[f"{prefix}.experts.{e}.{name}"] = out[e].clone()
    return whole
