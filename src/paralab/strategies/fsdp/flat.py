"""A unit's parameters as one flat, padded, sharded tensor, and the four primitives that move it.

Each unit of the model with trainable parameters becomes a :class:`FlatUnit`:
its parameters concatenated into one flat tensor, zero-padded to a multiple
of the N ranks and cut into N equal shards; rank r owns shard r, and the
optimizer is given only the shards. A unit's shard moves through four
primitives, each counting in the memory ledger the bytes it allocates or
frees, where it does so:

- **gather** (:meth:`FlatUnit.gather`): the full parameters from every rank's
  shard, into fresh storage at stage 3, in place at stages 1-2 after a step;
- **free** (:meth:`FlatUnit.free`, stage 3): the gathered storage released;
- **reduce-scatter** (:meth:`FlatUnit.reduce_scatter`): the unit's flat
  gradient summed over ranks, this rank's shard of it kept, divided by N
  (under HSDP, ``replicate``: the shard then all-reduced over the R replicas
  holding the same shard, and divided by N x R);
- **step** (:func:`step_shards`): the optimizer on the shards that have a
  gradient, their gradients dropped.

Both ``fsdp`` (:mod:`.strategy`) and the ZeRO-1 flavour (:mod:`.zero1`) are
built from these. Why the storage can be freed between forward and backward,
and what each primitive costs in memory: ``docs/fsdp.md``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...comm import Comm, nbytes
from ..memory_ledger import Ledger, optimizer_state_bytes


class FlatUnit:
    """One unit's trainable parameters as a flat tensor, padded to a multiple of the ranks, sharded by rank.

    ``slots`` remembers where each parameter lives in the flat tensor. The
    parameters are held one of two ways:

    - removed (fsdp): they are deleted from the unit's modules and replaced
      by plain attributes that :meth:`bind` points at views of whichever
      full flat tensor is current;
    - kept (``keep_parameters=True``, :class:`~.zero1.ZeroOneReplicas`): they stay
      the modules' ``nn.Parameter``, their ``.data`` re-pointed by
      :meth:`hold_full` at views of the full flat tensor, so the module's own
      forward and backward run unchanged (``p.grad`` accumulates as usual).

    After set-up the unit holds either its full parameters (:meth:`hold_full`,
    stages 1-2: the shard is a view of this rank's slice) or only its shard
    (:meth:`hold_shard`, stage 3). The primitives below move its tensors over
    ``comm`` and count every byte they allocate or free in ``ledger``.
    """

    def __init__(self, index: int, module: nn.Module, comm: Comm, ledger: Ledger, device: torch.device,
                 keep_parameters: bool = False, replicate: Comm | None = None):
        """``comm``: the group the unit is sharded over; ``replicate`` (HSDP): the group of the ranks that
        hold the same shard, over which each reduced gradient shard is then all-reduced."""
        self.index, self.module, self.comm, self.ledger, self.device = index, module, comm, ledger, device
        self.replicate = replicate if replicate is not None and replicate.world > 1 else None
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if len(list(module.named_parameters(remove_duplicate=False))) != len(list(module.named_parameters())):
            raise ValueError(f"unit {index} shares a parameter between layers; it cannot be flattened")
        self.slots = []  # (owning module, attribute, name in unit, shape, offset, numel)
        offset = 0
        for name, p in named:
            path, _, attr = name.rpartition(".")
            self.slots.append((module.get_submodule(path) if path else module, attr, name, p.shape,
                               offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // comm.world) * comm.world
        self.shard_numel = self.padded // comm.world
        self.dtype = named[0][1].dtype
        flat = torch.zeros(self.padded, dtype=self.dtype, device=named[0][1].device)
        torch.cat([p.detach().reshape(-1) for _, p in named], out=flat[:offset])
        self.initial = flat  # the starting values, consumed by hold_full or hold_shard
        self.params = [p for _, p in named] if keep_parameters else []
        if not keep_parameters:
            for owner, attr, *_ in self.slots:
                del owner._parameters[attr]
                setattr(owner, attr, None)
        self.sharded = False                       # only the shard is held; the full parameters are gathered
        self.full: torch.Tensor | None = None      # the full flat parameters (sharded: storage empty until gathered)
        self.resident = False                      # full's storage is allocated (gathered or in flight)
        self.pending = None                        # an in-flight asynchronous all-gather
        self.shard: nn.Parameter | None = None     # rank's slice: the optimizer's parameter
        self.grad: torch.Tensor | None = None      # stage 1: the unreduced flat gradient, until backward ends

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def full_bytes(self) -> int:
        return self.padded * self.element_size

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self.element_size

    def shard_copies(self, copies) -> float | torch.Tensor:
        """How many ranks hold each element of this rank's gradient shard (``--clip-grad``): the replicate
        group's size (HSDP) times ``copies(plain name)`` of the parameter the element belongs to; a number
        where every parameter of the unit has the same count."""
        per = [copies(f"{self.index}.{name}") for _, _, name, _, _, _ in self.slots]
        times = self.replicate.world if self.replicate is not None else 1
        if len(set(per)) == 1:
            return float(per[0] * times)
        flat = torch.ones(self.padded, dtype=torch.float64, device=self.device)  # padding: zero gradients
        for (_, _, _, _, offset, numel), c in zip(self.slots, per):
            flat[offset:offset + numel] = c
        return self._my_slice(flat) * times

    def _my_slice(self, flat: torch.Tensor) -> torch.Tensor:
        s = self.shard_numel
        return flat[self.comm.rank * s:(self.comm.rank + 1) * s]

    # ------------------------------------------------------------ holding the parameters
    def hold_full(self) -> None:
        """Keep the full flat parameters; the shard is a view of this rank's slice, updated in place."""
        self.full = self.initial.to(self.device)
        self.initial = None
        self.resident = True
        for p, (_, _, _, shape, offset, numel) in zip(self.params, self.slots):
            p.data = self.full[offset:offset + numel].view(shape)
        self.shard = nn.Parameter(self._my_slice(self.full))
        self.ledger.add("params", self.full_bytes, "init")

    def hold_shard(self) -> None:
        """Keep only this rank's shard (a copy); the full parameters are gathered when they are needed."""
        self.shard = nn.Parameter(self._my_slice(self.initial).clone().to(self.device))
        self.initial = None
        self.sharded = True
        self.ledger.add("params", self.shard_bytes, "init")
        # the storage every gather fills, one for the run and empty until then: a unit's parameter views
        # (and autograd's saves of them) always point at it, model state whenever it is measured
        self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        self.full.untyped_storage().resize_(0)

    def release_full(self) -> None:
        """From :meth:`hold_full` to holding only the shard (the ZeRO-3 flavour): the shard gets storage of
        its own (the same ``nn.Parameter``, so an optimizer built on it is unchanged) and the full
        parameters' storage is freed; the parameters kept as views of ``full`` point at no memory until
        the next :meth:`gather` refills that storage."""
        self.wait()
        self.shard.data = self.shard.data.clone()
        self.ledger.add("params", self.shard_bytes, f"shard unit {self.index}")
        self.sharded = True
        self.free()

    def bind(self, flat: torch.Tensor, train: bool) -> list[torch.Tensor]:
        """Point the unit's parameter attributes at views of ``flat``; return them.

        For training the views are autograd leaves with a version counter of
        their own (taken from ``flat.data``), so the storage can be freed after
        forward and refilled for backward.
        """
        base = flat.data if train else flat
        views = []
        for owner, attr, _, shape, offset, numel in self.slots:
            v = base[offset:offset + numel].view(shape)
            if train:
                v = v.detach().requires_grad_()
            setattr(owner, attr, v)
            views.append(v)
        return views

    def unbind(self) -> None:
        for owner, attr, *_ in self.slots:
            setattr(owner, attr, None)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Complete tensors (unpadded) under the unit's parameter names."""
        return {name: flat[offset:offset + numel].view(shape).clone()
                for _, _, name, shape, offset, numel in self.slots}

    # ------------------------------------------------------------ primitives: parameters
    def gather(self, async_op: bool) -> None:
        """All-gather every rank's shard into ``full``: a sharded unit's into its storage, refilled now,
        a unit holding its full parameters in place (after a step updated this rank's slice)."""
        if not self.resident:
            self.full.untyped_storage().resize_(self.full_bytes)
            self.resident = True
            self.ledger.add("params", self.full_bytes, f"gather unit {self.index}")
        pending = self.comm.all_gather_into(self.full, self.shard.detach(), name="all_gather_params",
                                            async_op=async_op)
        self.pending = pending if async_op else None

    def prefetch(self) -> None:
        """A sharded unit's gather launched ahead of its use, unless it is gathered already."""
        if self.sharded and not self.resident:
            self.gather(async_op=True)

    def wait(self) -> None:
        """Wait for this unit's all-gather in flight, if any."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def materialize(self) -> None:
        """Make sure ``full`` holds the full, current parameters (waits for a gather in flight)."""
        if self.pending is not None:
            self.wait()
        elif not self.resident:
            self.gather(async_op=False)

    def free(self) -> None:
        """A sharded unit's gathered storage released; autograd's saved views keep only metadata."""
        if not self.sharded or not self.resident:
            return
        self.wait()  # never free memory a collective is still writing
        self.full.untyped_storage().resize_(0)
        self.resident = False
        self.ledger.sub("params", self.full_bytes)

    @torch.no_grad()
    def current(self) -> torch.Tensor:
        """The full parameters, current (outside training: a sharded unit's are gathered into a
        temporary tensor, not counted)."""
        self.wait()
        if not self.sharded:
            return self.full
        out = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        self.comm.all_gather_into(out, self.shard.detach(), name="all_gather_state")
        return out

    # ------------------------------------------------------------ primitives: gradients
    def flatten_grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The parameters' gradients as one flat tensor padded like the parameters; the caller drops
        ``grads`` now."""
        with self.comm.recorder.span("compute", "backward", unit=self.index, what="flatten_grad"):
            pad = self.padded - self.numel
            flat_grad = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(pad)] if pad else []))
        self.ledger.add("grads", self.full_bytes, f"flatten grad unit {self.index}")
        self.ledger.sub("grads", sum(nbytes(g) for g in grads))
        return flat_grad

    def reduce_scatter(self, flat_grad: torch.Tensor) -> str:
        """Sum ``flat_grad`` over ranks, keep this rank's slice / N as the shard's gradient; the caller
        drops ``flat_grad`` now. Returns which reduce-scatter ran (see ``Comm.reduce_scatter``)."""
        shard_grad = torch.empty(self.shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
        self.ledger.add("grads", self.shard_bytes, f"reduce-scatter unit {self.index}")
        kind = self.comm.reduce_scatter(shard_grad, flat_grad, name="reduce_scatter_grads")
        if self.replicate is not None:  # HSDP: the same shard's sums of the other replica groups
            self.replicate.all_reduce(shard_grad, name="all_reduce_grad_shards")
        shard_grad.div_(self.comm.world * (self.replicate.world if self.replicate is not None else 1))
        self.shard.grad = shard_grad.to(self.shard.dtype)
        self.ledger.sub("grads", self.full_bytes)
        return kind

    def drop_grad_shard(self) -> None:
        self.shard.grad = None
        self.ledger.sub("grads", self.shard_bytes)


def step_shards(rec, optimizer: torch.optim.Optimizer, ledger: Ledger, units: list[FlatUnit], skip: bool = False,
                **where) -> None:
    """The step primitive: the optimizer on the shards of ``units`` (the only ones with a gradient),
    their gradients dropped; units holding their full parameters then re-gather them.

    ``torch.optim`` skips parameters whose ``.grad`` is None and keeps its
    state per parameter (Adam's step count too), so stepping unit by unit
    updates every shard exactly as one step over all of them would. The
    re-gathers are asynchronous, each waited for only when the next forward
    (or a read of the weights) reaches its unit. ``skip`` (``--on-nonfinite skip``): the gradients dropped,
    nothing updated.
    """
    with rec.span("optimizer", "step", **where):
        if not skip:
            optimizer.step()
        ledger.set("optimizer", optimizer_state_bytes(optimizer), "optimizer step")
        for fu in units:
            fu.drop_grad_shard()
    for fu in units:
        if not fu.sharded:
            fu.gather(async_op=True)


def unpadded_note(who: str, units: list[FlatUnit], world: int) -> list[str]:
    """The check's "not exercised" line where no unit of ``units`` is padded over the ``world`` ranks that shard
    them (every unit's parameters a multiple of ``world``), naming a shard count that would pad one."""
    if world < 2 or any(fu.padded != fu.numel for fu in units):
        return []
    pads = next((w for w in range(2, 64) if any(fu.numel % w for fu in units)), None)
    hint = f" (sharded over {pads} ranks, a unit is padded)" if pads else ""
    return [f"{who}: every unit's parameters divide evenly over {world} ranks, so no shard is padded and the "
            f"padding path is not exercised{hint}"]
