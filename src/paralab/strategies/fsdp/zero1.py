"""ZeRO stage 1 as a data-parallel flavour: ``fsdp --zero-stage 1`` under ``--pp`` (or ``--tp``).

:class:`ZeroOneReplicas` implements the :class:`~paralab.strategies.replicas.Replicas`
contract with the flat units and primitives of :mod:`.flat`, wrapped round
any module with its parameters kept as ordinary ``nn.Parameter``, so that a
pipeline stage can be sharded over its ``dp`` replicas
(``paralab train fsdp --zero-stage 1 --pp P``). See ``docs/fsdp.md``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...comm import Comm, nbytes
from ..memory_ledger import Ledger, optimizer_state_bytes
from ..portable import flat_optimizer_portable, flat_optimizer_shard, shard_of, slots
from ..replicas import Replicas
from .flat import FlatUnit, step_shards, unpadded_note


class ZeroOneReplicas(Replicas):
    """ZeRO stage 1 as a data-parallel flavour: each replica's optimizer owns only its shard.

    Applied to any module (the whole model, or one pipeline stage's units):
    each child unit with trainable parameters (the module itself if it has
    parameters of its own) becomes a :class:`FlatUnit` that *keeps* its
    parameters: they stay the module's ``nn.Parameter``, their storage a view
    of the unit's padded flat tensor, so the module's own forward runs
    unchanged and autograd accumulates the full gradients in ``p.grad``. The
    optimizer is given this rank's slice of each flat tensor (a view).

    - ``finish()``: per unit, the gradients flattened and padded, reduce-
      scattered; this rank keeps the mean of its slice as the shard's gradient,
      the full gradients are dropped;
    - ``step()``: the optimizer steps the shards (in place, in the flat
      tensors), then an in-place all-gather per unit completes the other
      ranks' slices: launched asynchronously, waited for when the unit's next
      forward starts, or before its tensors are read (``state_dict``),
      loaded, or evaluated (``sync_buffers(after_step=False)``).

    Numerically plain data parallelism (as ``fsdp --zero-stage 1``).
    Constraints: the module is on its device before it is wrapped and is not
    moved afterwards (moving re-allocates the parameters, undoing the views);
    no parameter shared between units; one dtype per unit; a checkpoint loads
    only on the same dp world.

    Under HSDP (``--replicate R``: the mesh's ``shard`` and ``replicate``
    groups) the flat units are sharded over the shard group only, each reduced
    gradient shard all-reduced over the replicate group; BatchNorm buffers and
    the start's broadcast still span the whole dp group.
    """

    flavour = "zero1"
    zero_stage = 1

    def __init__(self, module: nn.Module, optim_fn, comm: Comm, ctx):
        mesh = getattr(ctx, "mesh", None)
        comms = mesh.comms if mesh is not None else {}
        # HSDP: sharded over the shard group, the shards' gradients all-reduced over the replicate group
        self.shard_comm, self.replicate_comm = comms.get("shard", comm), comms.get("replicate")
        self.ledger = Ledger()
        self.reduce_scatter_kind: str | None = None
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        self.units = []
        for i, unit in enumerate([module] if own else module.children()):
            trainable = [p for p in unit.parameters() if p.requires_grad]
            if not trainable:
                continue
            device = trainable[0].device
            fu = FlatUnit(i, unit, self.shard_comm, self.ledger, device, keep_parameters=True,
                          replicate=self.replicate_comm)
            fu.hold_full()
            for register in (unit.register_forward_pre_hook, unit.register_state_dict_pre_hook,
                             unit.register_load_state_dict_pre_hook):
                register(lambda *_, fu=fu: fu.wait())
            self.units.append(fu)
        if len({id(p) for fu in self.units for p in fu.params}) != sum(len(fu.params) for fu in self.units):
            raise ValueError("zero1: a parameter is shared between units; it cannot be sharded")
        # the ledger counts each full gradient from when autograd first accumulates it in the step (its
        # first microbatch's backward), so that it is right at every moment, not only after backward
        self._counted: set[int] = set()  # ids of the parameters whose gradient the ledger holds
        for fu in self.units:
            for p in fu.params:
                p.register_post_accumulate_grad_hook(self._accumulated)
        super().__init__(module, optim_fn, comm, ctx)

    def _accumulated(self, p: torch.Tensor) -> None:
        if p.grad is not None and id(p) not in self._counted:
            self._counted.add(id(p))
            self.ledger.add("grads", nbytes(p.grad), "backward")

    def start(self) -> None:
        self._counted = set()

    def build_optimizer(self, optim_fn) -> torch.optim.Optimizer:
        return optim_fn([fu.shard for fu in self.units])

    def settle(self) -> None:
        """Wait for every all-gather still in flight."""
        for fu in self.units:
            fu.wait()

    @torch.no_grad()
    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:  # unused in this step: a zero gradient, as the reduction expects one
                p.grad = torch.zeros_like(p)
                self._accumulated(p)
        for fu in self.units:
            flat_grad = fu.flatten_grads([p.grad for p in fu.params])
            for p in fu.params:
                p.grad = None
            self.reduce_scatter_kind = fu.reduce_scatter(flat_grad)
            del flat_grad

    def held_gradients(self, keys, copies):
        """The gradient shards (``finish`` reduce-scattered them), each element counted as its parameter."""
        return [(fu.shard.grad, fu.shard_copies(copies)) for fu in self.units if fu.shard.grad is not None]

    def step(self) -> None:
        self.settle()  # never step a shard whose flat tensor a gather is still writing
        step_shards(self.rec, self.optimizer, self.ledger, self.units, skip=self.ctx.skipping)

    def sync_buffers(self, after_step: bool = True) -> None:
        if not after_step:  # the weights are about to be read or evaluated
            self.settle()
        super().sync_buffers(after_step)

    def state_dict(self) -> dict:
        self.settle()
        return {"zero1": {"world": self.shard_comm.world, "shards": [fu.shard.detach().clone() for fu in self.units],
                          **self._hsdp()},
                "optimizer": self.optimizer.state_dict()}

    def _hsdp(self) -> dict:
        """Under HSDP, which replica group this rank is in (its shards are also in the others')."""
        if self.replicate_comm is None:
            return {}
        return {"replicate": self.replicate_comm.world, "replica": self.replicate_comm.rank}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        saved = state["zero1"]
        if saved["world"] != self.shard_comm.world:
            raise ValueError(f"checkpoint is zero1 over {saved['world']} data-parallel replicas; "
                             f"this run shards over {self.shard_comm.world}")
        self.settle()
        for fu, shard in zip(self.units, saved["shards"]):
            fu.shard.copy_(shard)
            fu.gather(async_op=False)  # the full parameters current on every replica
        self.optimizer.load_state_dict(state["optimizer"])
        self.ledger.set("optimizer", optimizer_state_bytes(self.optimizer), "load")

    @classmethod
    def optimizer_portable(cls, states: list[dict], units: dict) -> dict[str, dict]:
        """Offline: each dp replica's optimizer holds its shard of every flat unit (one per unit with
        trainable parameters, in order): the shards of each state put together and cut back."""
        flat_units = [(i, u) for i, u in units.items() if any(p.requires_grad for p in u.parameters())]
        states = [s for s in states if s["zero1"].get("replica", 0) == 0]  # HSDP: one replica group holds all
        if len(states) != states[0]["zero1"]["world"]:
            raise ValueError(f"zero1: {len(states)} replica state(s) for {states[0]['zero1']['world']} replicas")
        out: dict[str, dict] = {}
        for n, (i, unit) in enumerate(flat_units):
            out |= flat_optimizer_portable([s["optimizer"]["state"].get(n, {}) for s in states], i, slots(unit))
        return out

    def state_from_portable(self, portable, units: dict) -> dict:
        """This replica's shards of the parameters and of their optimizer state (``units``: plain index ->
        unit, the module's children in order)."""
        index = list(units)
        shards, state = [], {}
        for n, fu in enumerate(self.units):
            layout = [(name, shape) for _, _, name, shape, _, _ in fu.slots]
            names = [f"{index[fu.index]}.{name}" for name, _ in layout]
            shards.append(shard_of([portable.tensors[k] for k in names], fu.padded, self.shard_comm.rank,
                                   self.shard_comm.world))
            held = flat_optimizer_shard(portable.optimizer, index[fu.index], layout, fu.padded,
                                        self.shard_comm.rank, self.shard_comm.world)
            if held is not None:
                state[n] = held
        return {"zero1": {"world": self.shard_comm.world, "shards": shards, **self._hsdp()},
                "optimizer": {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]}}

    def unexercised(self) -> list[str]:
        return unpadded_note("ZeRO-1", self.units, self.comm.world)

    def summary(self) -> dict:
        return {"zero_stage": self.zero_stage, "reduce_scatter": self.reduce_scatter_kind, **self._hsdp(),
                "units_sharded": len(self.units),
                "shard_elements": sum(fu.shard_numel for fu in self.units),
                "padding_elements": sum(fu.padded - fu.numel for fu in self.units)}
