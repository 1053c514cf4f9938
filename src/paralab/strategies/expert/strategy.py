"""``ExpertParallel``: data parallelism whose MoE experts are split over the ep group."""
from __future__ import annotations

import torch.nn as nn

from ...errors import UsageError
from ...mesh import MeshShape
from ..base import StepResult, Strategy, moe_record
from ..portable import Portable
from ..replicas import Replicas
from .dispatch import ExpertOptions
from .replicas import ExpertReplicas, gather_experts


# ---------------------------------------------------------------- the strategy
class ExpertParallel(Strategy):
    """Data parallelism whose MoE experts are split over the ep group (composed: ``--ep`` with a flavour)."""
    name = "ep"
    options = (ExpertOptions,)
    clips = True

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
        from .. import get_strategy, strategy_names
        if cfg.experts == 0:
            raise UsageError(f"--ep {cfg.ep} splits a mixture of experts: add --model gpt --experts E")
        named = get_strategy(cfg.strategy)
        if cls.flavour_of(named, cfg) is None:
            able = [n for n in strategy_names() if cls.flavour_of(get_strategy(n), cfg) is not None]
            flavour = named.pipeline_replicas(cfg)
            why = (named.why_not_pipelined(cfg) if flavour is None else
                   "ZeRO-2/3 shard the parameters themselves unit by unit, so they cannot be given a set of "
                   "parameters: only --zero-stage 1 composes with --ep" if getattr(flavour, "zero_stage", 0) > 1
                   else "its flavour wraps the whole model for the forward, so it cannot be given a set of parameters")
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
        its forward (PyTorch's DDP) cannot be given a set of parameters, nor can one that shards the
        parameters themselves unit by unit (ZeRO-2/3: ``zero_stage`` above 1)."""
        flavour = named.pipeline_replicas(cfg)  # None but for the data-parallel strategies
        if flavour is None or flavour.forward_module is not Replicas.forward_module:
            return None
        if getattr(flavour, "zero_stage", 0) > 1:
            return None
        return flavour

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        self.model.train()
        f = self.flavour
        f.start()
        loss = self.forward_backward(self.model, x, y, before_last=f.accumulating, last=f.last_backward)
        f.finish()
        self.clip_gradients()
        f.step()
        f.sync_buffers()
        return StepResult(loss, len(y), moe=moe_record(self.model))

    def held_gradients(self):
        return self.flavour.held_gradients(self.plain_keys(dict(enumerate(self.model))), self.copies)

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
