"""Pure data parallelism: every rank a full replica of the model, one flavour keeping them equal.

The data-parallel strategies (``single``, ``gather-scatter``, ``allreduce``,
``ddp``, ``torch-ddp``) differ only in *how* the replicas agree on their
gradients: that is their flavour (a :class:`~paralab.strategies.replicas.Replicas`
class, in each strategy's own file). This class is the step they share::

    forward and backward over this rank's shard (and its --accumulate microbatches)
    make the gradients the mean over the replicas     (the flavour)
    optimizer step                                    (the flavour: ZeRO-1 shards it)
    BatchNorm statistics from dp rank 0               (the flavour)

Under ``--pp P`` the same flavour wraps each pipeline stage instead of the
whole model (:meth:`pipeline_replicas`; see ``pipeline/strategy.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..options import option
from .base import StepResult, Strategy, moe_record
from .portable import Portable
from .replicas import Replicas


@dataclass
class AccumulateOptions:
    """data parallelism: gradient accumulation"""
    accumulate: int = option(1, "data-parallel strategies: microsteps per step, gradients synchronised "
                                "once, by the last (no_sync)", minimum=1, identity=True)


def flavour_of(state: dict) -> type[Replicas]:
    """The flavour class that reads a saved flavour state: ZeRO-1's holds shards, every other flavour
    the whole optimizer state (read alike); under --ep a stage's (or the model's) two flavours, over its
    non-expert parameters and its experts, are one state (``strategies/expert/``)."""
    if "ep" in state and "dense" in state:
        from .expert import ExpertReplicas
        return ExpertReplicas
    if "zero1" in state:
        from .fsdp.zero1 import ZeroOneReplicas
        return ZeroOneReplicas
    return Replicas


class DataParallel(Strategy):
    #: the flavour: how the replicas agree (set by each data-parallel strategy)
    replicas_cls: type[Replicas] = Replicas
    options = (AccumulateOptions,)
    moe = True
    clips = True

    def __init__(self, ctx, model_fn, optim_fn, replicas_cls: type[Replicas] | None = None):
        """``replicas_cls``: the flavour, when a composed layout (``--tp``) names it; else the class's."""
        super().__init__(ctx, model_fn, optim_fn)
        self.replicas_cls = replicas_cls or self.replicas_cls
        self.microbatches = ctx.options.accumulate
        model = model_fn()
        if ctx.tp is not None or ctx.cp is not None:  # tensor parallelism: this rank's slice of every unit
            model = nn.Sequential(*ctx.shard(dict(enumerate(model))).values())
        self.model = model.to(ctx.device)
        dp_comm = ctx.mesh.comm("dp") if ctx.mesh is not None else ctx.comm
        self.dp = self.replicas_cls(self.model, optim_fn, dp_comm, ctx)
        self.dp.broadcast_parameters()  # the same start everywhere
        self.forward_module = self.dp.forward_module()

    @classmethod
    def pipeline_replicas(cls, cfg):
        return cls.replicas_cls

    @property
    def optimizer(self):
        return self.dp.optimizer

    def train_step(self, x, y) -> StepResult:
        self.forward_module.train()
        self.dp.start()
        loss = self.forward_backward(self.forward_module, x, y,
                                     before_last=self.dp.accumulating, last=self.dp.last_backward)
        self.dp.finish()
        self.clip_gradients()
        self.dp.step()
        self.dp.sync_buffers()
        return StepResult(loss, len(y), moe=moe_record(self.model))

    def held_gradients(self):
        return self.dp.held_gradients(self.plain_keys(dict(enumerate(self.model))), self.copies)

    def predict(self, x):
        self.dp.sync_buffers(after_step=False)
        return self.eval_logits(self.model, x)

    def full_state_dict(self):
        self.dp.sync_buffers(after_step=False)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self):
        # dp rank 0's BatchNorm statistics first (a collective: every rank saves at the same steps), so
        # every rank file holds the authoritative ones; PyTorch's DDP would broadcast them only at its
        # next forward, leaving each rank's own in its file
        self.dp.sync_buffers(after_step=False)
        return {"model": self.model.state_dict(), **self.dp.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.dp.load_state_dict(state)

    @classmethod
    def consolidate(cls, states, model):
        """Every rank saved the whole model, synchronised first: rank 0's is the model."""
        return dict(states[0]["model"])

    @classmethod
    def portable(cls, states, model):
        """Every rank holds the whole model (synchronised) and, but under ZeRO-1, the whole optimizer
        state; ``states`` are the dp replicas in order."""
        return Portable(dict(states[0]["model"]), flavour_of(states[0]).optimizer_portable(states,
                                                                                          dict(enumerate(model))))

    def load_portable(self, portable):
        units = dict(enumerate(self.model))
        self.load_state_dict({"model": {k: portable.tensors[k] for k in self.model.state_dict()},
                              **self.dp.state_from_portable(portable, units)})

    def extra_summary(self) -> dict:
        return self.dp.summary()

    def unexercised(self) -> list[str]:
        return self.dp.unexercised()
