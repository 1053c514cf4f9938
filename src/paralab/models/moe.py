"""A mixture of experts: the gpt block's MLP as E expert MLPs behind a learned router.

Per block, for the ``N`` tokens of one forward (``--experts E --top-k K``)::

    scores  = softmax(x W_router)             [N, E], computed in float64 (below)
              (--gating sigmoid: sigmoid(x W_router))
    choice  = the K largest scores per token   expert ids [N, K], gates = their scores
              (sigmoid: the K chosen scores divided by their sum)
    kept    = all (dropless), or per expert the first C = ceil(F N K / E) choices
              (--capacity-factor F), first choices before second ones, tokens in order
    y[n]    = sum over kept (n, j) of gate[n, j] * expert[choice[n, j]](x[n])

A dropped choice adds nothing: the token goes on by the residual alone
(GShard's rule), and the drops are counted. Under softmax gating (the
default) the gates are the softmax probabilities themselves, not renormalised
over the K chosen (so top-1 still trains the router, as in Switch). Under
sigmoid gating (DeepSeek-V3's) each expert's score is an independent
``sigmoid(logit)``; the K largest are chosen and the gates are the chosen
scores normalised to sum to 1 over those K (so with top-1 the gate is always 1
and the router learns from the auxiliary loss alone). The load-balancing loss
of Switch/GShard, ``aux = E * sum_i f_i P_i`` (``f_i``: the share of the N K
choices that went to expert i; ``P_i``: the mean over tokens of expert i's
share of the token's scores: its softmax probability, or under sigmoid its
score divided by the sum of the token's E scores, so that ``P`` stays a
distribution and ``aux`` is 1 at an even load for both), is 1 when the load
is even; the training loss adds ``--aux-loss-coef`` times the sum over blocks
(:func:`take_aux_loss`). Everything is per forward, on the tokens of that
forward: a data-parallel shard's microbatch, whichever rank holds the experts.

Why the router runs in float64: a top-K choice is discontinuous, so a near-tie
that rounding flips changes the step. In float64 the products of float32
inputs are exact and the sums round at 1e-16, so the choice does not depend on
how tokens are batched; each forward also records the smallest gap between the
K-th and the (K+1)-th score it decided on (``min_margin``), the deviation
a run would need before any choice could flip. Both gatings choose on float64
scores and record that gap alike. Both are increasing functions of the logits,
so they choose the same experts from the same logits (they differ in the gates
and the auxiliary loss); a sigmoid's slope is at most 1/4, so a score gap g
means a logit gap of at least 4 g: the margin recorded is the stricter one. A
sigmoid rounds to exactly 1.0 in float64 above a logit of about 37, where
distinct logits would tie: such a tie shows as a ``min_margin`` of 0.

How the experts are reached is the *dispatcher*: here, all on this rank
(:func:`local_dispatch`); under expert parallelism (``strategies/expert/``)
the experts are split over ranks and the tokens travel to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UsageError
from ..options import option

#: how router logits become gates (``--gating``; the module docstring)
GATINGS = ("softmax", "sigmoid")


@dataclass
class MoEOptions:
    """mixture of experts (--model gpt): every block's MLP as --experts expert MLPs behind a learned router"""
    experts: int = option(0, "experts per block (0: the dense MLP); each token goes to --top-k of them",
                          minimum=0, identity=True)
    top_k: int = option(1, "experts each token is sent to (at most --experts)", minimum=1, identity=True)
    expert_hidden: int = option(0, "each expert MLP's hidden width (0: 4 x --embed, the dense MLP's)", minimum=0,
                                identity=True)
    capacity_factor: float | None = option(None, "tokens an expert takes per forward, as a multiple of an even "
                                                 "share (tokens x top-k / experts); the overflow is dropped (the "
                                                 "token skips the MLP) and counted; default: dropless",
                                           type=float, minimum=0, above=True, identity=True)
    aux_loss_coef: float = option(0.01, "weight of the load-balancing loss (Switch/GShard) in the training loss",
                                  minimum=0, identity=True)
    gating: str = option("softmax", "how router logits become gates: softmax (probabilities over the experts; "
                                    "the K chosen keep their probabilities) or sigmoid (DeepSeek-V3: an independent "
                                    "sigmoid score per expert; the K largest chosen, their scores normalised to sum "
                                    "to 1)", choices=GATINGS, identity=True)
    router_skew: float = option(0.0, "added to expert 0's router logit: a knob that sends it more tokens, to "
                                     "measure what imbalance costs (benchmarks); 0: none", minimum=0, identity=True)


def check_shape(flags: list[str], model: str, text: bool, experts: int, top_k: int) -> None:
    """UsageError where the mixture-of-experts options a command was given (``flags``: those set away from
    their defaults) do not fit the model (``text``: a gpt, the one with MLPs) or each other; what
    ``paralab train`` and ``paralab plan`` both check."""
    if flags and not text:
        raise UsageError(f"{', '.join(flags)}: a mixture of experts replaces the gpt's MLPs; --model {model} "
                         "has none: use --model gpt or drop them")
    if flags and not experts:
        raise UsageError(f"{', '.join(flags)} shape a mixture of experts: add --experts E")
    if experts and top_k > experts:
        raise UsageError(f"--top-k {top_k} must be at most --experts {experts} (each token goes to "
                         "top-k different experts)")


class Expert(nn.Module):
    """One expert: the dense MLP's shape, ``Linear(D, H) -> GELU -> Linear(H, D)``."""

    def __init__(self, embed: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(embed, hidden)
        self.proj = nn.Linear(hidden, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


@dataclass
class Routing:
    """One forward's routing decisions (``N`` tokens, ``K`` choices each)."""
    expert: torch.Tensor     # [N, K] expert ids
    gate: torch.Tensor       # [N, K] their gates (the activations' dtype; carries the router's gradient)
    kept: torch.Tensor       # [N, K] bool: not dropped by the capacity
    aux: torch.Tensor        # the load-balancing loss (a scalar, float64)
    stats: dict = field(default_factory=dict)  # counts per expert, dropped, min_margin

    def assignments(self):
        """The kept choices sorted by expert (ties in token order): ``(tokens, gates, counts per expert)``."""
        e = torch.where(self.kept, self.expert, self.expert.new_full((), -1)).reshape(-1)
        order = torch.argsort(e, stable=True)
        order = order[(e[order] >= 0)]
        k = self.expert.shape[1]
        return order // k, self.gate.reshape(-1)[order], self.stats["counts"]


def scores(logits: torch.Tensor, gating: str = "softmax") -> torch.Tensor:
    """The router's scores ``[N, E]`` from its logits: softmax probabilities, or independent sigmoids."""
    if gating == "softmax":
        return F.softmax(logits, dim=-1)
    if gating == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown gating {gating!r}; choose one of {', '.join(GATINGS)}")


def route(probs: torch.Tensor, k: int, capacity_factor: float | None, dtype: torch.dtype,
          gating: str = "softmax", choose=None) -> Routing:
    """Top-``k`` choices, the capacity's drops, the auxiliary loss (see the module docstring).

    ``probs``: the router's :func:`scores` under ``gating``. Softmax: the gates are the chosen
    probabilities as they are. Sigmoid: the gates are the chosen scores normalised to sum to 1 over the
    ``k`` chosen, and the auxiliary loss's ``P`` is each token's scores normalised over all experts.
    ``choose(probs, expert)``: given the top-``k`` experts ``[N, K]`` (best first), the experts to use
    instead (a check's reference following a run's near-ties, ``check/routing.py``); None: those."""
    n, e = probs.shape
    top = probs.topk(min(k + 1, e), dim=-1)
    gate, expert = top.values[:, :k], top.indices[:, :k]
    if choose is not None:
        expert = choose(probs, expert)
        gate = probs.gather(1, expert)
    share = probs  # each token's distribution over the experts, for the auxiliary loss
    if gating == "sigmoid":
        gate = gate / gate.sum(-1, keepdim=True)
        share = probs / probs.sum(-1, keepdim=True)
    margin = float((top.values[:, k - 1] - top.values[:, k]).min().detach()) if k < e and n else float("inf")
    chosen = torch.bincount(expert.reshape(-1), minlength=e)
    aux = e * ((chosen.to(probs.dtype) / max(n * k, 1)) * share.mean(0)).sum() if n else probs.sum() * 0
    if capacity_factor is None:
        kept = torch.ones_like(expert, dtype=torch.bool)
    else:
        capacity = math.ceil(capacity_factor * n * k / e)
        flat = expert.t().reshape(-1)  # choice-major: every token's first choice before any second one
        position = (F.one_hot(flat, e).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
        kept = (position < capacity).view(k, n).t()
    counts = torch.bincount(expert[kept], minlength=e)
    stats = {"counts": counts, "dropped": int((~kept).sum()), "min_margin": margin}
    return Routing(expert, gate.to(dtype), kept, aux, stats)


def local_dispatch(tokens: torch.Tensor, routing: Routing, experts: nn.ModuleList) -> torch.Tensor:
    """Every expert on this rank: each computes its kept tokens (an empty batch too, so every expert
    parameter gets a gradient every step), gated, summed back into the tokens' rows."""
    index, gates, counts = routing.assignments()
    outputs = [expert(part) for expert, part in zip(experts, tokens[index].split(counts.tolist()))]
    return combine(tokens, index, gates, torch.cat(outputs))


def combine(tokens: torch.Tensor, index: torch.Tensor, gates: torch.Tensor, expert_out: torch.Tensor):
    """``expert_out`` rows (sorted by expert, as :meth:`Routing.assignments`) gated and summed per token."""
    return torch.zeros_like(tokens).index_add(0, index, expert_out * gates[:, None])


class MoE(nn.Module):
    """The block's MLP as ``E`` experts behind a router; ``dispatch`` reaches them (this rank's by default)."""

    def __init__(self, embed: int, experts: int, top_k: int, hidden: int, capacity_factor: float | None,
                 aux_loss_coef: float, router_skew: float = 0.0, gating: str = "softmax"):
        super().__init__()
        self.router = nn.Linear(embed, experts, bias=False)
        self.experts = nn.ModuleList(Expert(embed, hidden) for _ in range(experts))
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.aux_loss_coef, self.router_skew = aux_loss_coef, router_skew
        if gating not in GATINGS:
            raise ValueError(f"unknown gating {gating!r}; choose one of {', '.join(GATINGS)}")
        self.gating = gating
        self.dispatch = local_dispatch
        #: who may change the top-k choice: None, or a check's ``choose(moe, probs, expert) -> expert``
        #: (``check/routing.py``: a run's forwards recorded, a reference following the run at near-ties)
        self.choose = None
        self.aux_loss: torch.Tensor | None = None  # the last training forward's, until taken
        self.history: list[dict] = []               # per training forward: counts, dropped, aux, min_margin
        self.layer = 0  # which block of the model it is (gpt.py numbers them): records name it under a pipeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = F.linear(tokens.double(), self.router.weight.double())
        if self.router_skew:
            logits = logits + logits.new_tensor([self.router_skew] + [0.0] * (self.num_experts - 1))
        choose = (lambda probs, expert: self.choose(self, probs, expert)) if self.choose is not None else None
        routing = route(scores(logits, self.gating), self.top_k, self.capacity_factor, tokens.dtype, self.gating,
                        choose)
        out = self.dispatch(tokens, routing, self.experts)
        if self.training and torch.is_grad_enabled():
            self.aux_loss = routing.aux
            s = routing.stats
            self.history.append({"counts": s["counts"].tolist(), "dropped": s["dropped"],
                                 "aux": routing.aux.item(), "min_margin": s["min_margin"]}
                                | ({"received": s["received"]} if "received" in s else {}))
        return out.view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """``--aux-loss-coef`` x the load-balancing losses of the last training forward (None: no MoE), cleared."""
    total = None
    for m in moe_layers(model):
        if m.aux_loss is not None:
            term = m.aux_loss_coef * m.aux_loss
            total = term if total is None else total + term
            m.aux_loss = None
    return total


class _CarryAux(torch.autograd.Function):
    """``out`` unchanged forward; backward passes its gradient on and gives ``aux`` a gradient of 1, so a
    backward from ``out`` (a pipeline stage's, from the gradient the next stage sent) also back-propagates
    ``aux`` as a term of the loss."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux = (aux.dtype, aux.device)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux
        return grad, torch.ones((), dtype=dtype, device=device)


def carry_aux_loss(unit: nn.Module, out: torch.Tensor, weight: float, scaled=None) -> torch.Tensor:
    """``out`` carrying ``weight`` x the load-balancing losses of ``unit``'s last forward (taken), for a
    backward that starts from ``out`` rather than from the loss (pipeline stages); ``out`` if none.
    ``scaled``: what the loss goes through (fp16's loss scale, ``Context.scaled``)."""
    aux = take_aux_loss(unit)
    if aux is None:
        return out
    return _CarryAux.apply(out, scaled(aux * weight) if scaled is not None else aux * weight)


def take_history(model: nn.Module, numbered: bool = False) -> list:
    """Per MoE layer, its records since the last call (then cleared); ``numbered``: (its block's index,
    records) pairs, for a module holding some of the model's layers (a pipeline stage)."""
    out = []
    for m in moe_layers(model):
        out.append((m.layer, m.history) if numbered else m.history)
        m.history = []
    return out
