"""The data-parallel flavour of a module holding MoE layers under ``--ep``: the named flavour twice,
over the dense parameters (dp) and over this rank's slice of the experts (edp, divided by ep)."""
from __future__ import annotations

import contextlib
import re

import torch
import torch.nn as nn

from ...models.moe import moe_layers
from ..base import broadcast_buffers
from ..portable import Portable, trainable
from ..replicas import Replicas
from .dispatch import AllGatherDispatch, AllToAllDispatch


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
        from ..fsdp.zero1 import ZeroOneReplicas
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

    def held_gradients(self, keys, copies):
        """Both parts': the dense parameters' held by every dp replica, each expert's by its edp group."""
        return [held for f in self.parts for held in f.held_gradients(keys, copies)]

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
