"""The device mesh: ranks on a grid with named dimensions, one process group per dimension.

A run of ``W`` ranks is laid out as a grid ``pp x dp x tp`` (``W = pp * dp *
tp``), outermost dimension first, as torchtitan orders it::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so the innermost dimension's ranks are neighbours (tensor parallelism, the
chattiest, stays on one host when hosts hold consecutive ranks), and a
pipeline stage's data-parallel replicas are consecutive. With ``dp 2 x pp 2``
on 4 ranks: ranks 0, 1 are stage 0 (replicas 0, 1), ranks 2, 3 are stage 1.

Along each dimension a rank belongs to one group: the ranks that differ
from it only in that dimension's index. Its ``dp`` group averages gradients
with the other replicas of the same stage; its ``pp`` group is its pipeline,
one rank per stage. Every group is created once, at start, by every rank in
the same order (``torch.distributed.new_group`` is collective), and handed to
strategies as a :class:`~paralab.comm.Comm` whose ranks are group-local.

Its ``tp`` group holds the shards of every layer (``strategies/tensor/``):
the collectives inside each layer's forward and backward run there.

Expert parallelism (``--ep E``, ``strategies/expert/``) subdivides dp: the
dp index is ``edp_index * ep + ep_index``, so an ``ep`` group is ``ep``
consecutive replicas (neighbours: the all-to-all of every MoE layer runs
there, each member holding a different slice of the experts), and an
``edp`` group (expert data parallelism) is the replicas holding the same
experts, over which the experts' gradients are averaged. Every rank still
reads its own data shard: ep ranks are data-parallel replicas too, so the
non-expert parameters are averaged over the whole dp group.

HSDP (``fsdp --replicate R``, ``strategies/fsdp/``) subdivides dp the same
way: the dp index is ``replicate_index * shard + shard_index``, so a
``shard`` group is ``dp / R`` consecutive replicas (the parameters, gradients
and optimizer state are sharded there: all-gathers and reduce-scatters), and
a ``replicate`` group is the ``R`` replicas holding the same shard (each
reduced gradient shard is all-reduced there, once per step).

Context parallelism (``--cp C``, ``strategies/context/``) adds a fourth grid
dimension between dp and tp, only when C > 1: ``pp x dp x cp x tp``,
``rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index``.
Its ``cp`` group holds the sequence slices of the same samples (the ring or
the all-to-all of every attention layer runs there: chattier than dp's one
gradient exchange per step, lighter than tp's collectives around every
matmul, so between them, as torchtitan orders it). Its ``dpcp`` group (the
ranks that differ in dp or cp) is where gradients are averaged: every cp rank
holds the whole model and the same number of tokens of its samples.
"""
from __future__ import annotations

from dataclasses import dataclass

from .comm import Comm
from .errors import UsageError
from .options import option

DIMS = ("pp", "dp", "tp")  # outermost first
EXPERT_DIMS = ("ep", "edp")  # dp subdivided under --ep: experts split over ep, replicated over edp
CONTEXT_DIMS = ("cp", "dpcp")  # under --cp: the sequence split over cp; gradients averaged over dp x cp
HSDP_DIMS = ("shard", "replicate")  # dp subdivided under --replicate: sharded over shard, replicated over replicate


@dataclass
class MeshOptions:
    """mesh: how the workers form a grid (pipeline stages x data-parallel replicas x tensor-parallel shards)"""
    pp: int = option(1, "pipeline stages; the strategy then names the data-parallel flavour of each stage and "
                        "dp = workers / pp (e.g. 'ddp --workers 4 --pp 2 --schedule 1f1b --microbatches 4' "
                        "is dp 2 x pp 2)", minimum=1, identity=True)
    tp: int = option(1, "tensor-parallel shards of every layer; the strategy names the data-parallel flavour and "
                        "dp = workers / (pp x tp) (e.g. 'ddp --workers 4 --tp 2' is dp 2 x tp 2)", minimum=1,
                     identity=True)
    ep: int = option(1, "expert parallelism (a mixture-of-experts gpt, --experts): the experts split over this "
                        "many data-parallel replicas, tokens sent to them by all-to-all; a divisor of dp (e.g. "
                        "'allreduce --workers 4 --ep 2 --model gpt --experts 4' is dp 4 = 2 x ep 2)", minimum=1,
                     identity=True)
    cp: int = option(1, "context parallelism (the gpt): each sample's sequence split over this many ranks, "
                        "attention by a ring or all-to-all (--cp-method); dp = workers / (pp x cp x tp) (e.g. "
                        "'allreduce --workers 4 --cp 2 --model gpt' is dp 2 x cp 2)", minimum=1, identity=True)


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1  # a divisor of dp (see the module docstring)
    cp: int = 1  # context parallelism: a grid dimension between dp and tp when > 1
    replicate: int = 1  # HSDP: a divisor of dp (see the module docstring)

    @classmethod
    def for_world(cls, world: int, pp: int = 1, tp: int = 1, ep: int = 1, cp: int = 1) -> "MeshShape":
        """The shape with ``dp = world / (pp * cp * tp)``; UsageError if that is not a whole number."""
        for name, size in (("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp)):
            if size < 1:
                raise UsageError(f"--{name} must be positive (got {size})")
        if world % (pp * cp * tp):
            grid = f"pp {pp} x cp {cp} x tp {tp}" if cp > 1 else f"pp {pp} x tp {tp}"
            raise UsageError(f"{world} worker(s) cannot form a mesh with {grid}: the workers must be a "
                             f"multiple of {pp * cp * tp} (data parallelism takes the rest)")
        dp = world // (pp * cp * tp)
        if dp % ep:
            raise UsageError(f"--ep {ep} must divide the {dp} data-parallel replicas (workers / (pp x tp)): "
                             f"change --ep or --workers")
        return cls(pp=pp, dp=dp, tp=tp, ep=ep, cp=cp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def grid(self) -> tuple[str, ...]:
        """The grid's dimensions, outermost first: pp, dp, (cp,) tp."""
        return ("pp", "dp", "cp", "tp") if self.cp > 1 else DIMS

    def size(self, dim: str) -> int:
        if dim == "dpcp":
            return self.dp * self.cp
        if dim == "shard":
            return self.dp // self.replicate
        return self.dp // self.ep if dim == "edp" else getattr(self, dim)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (and under --ep along ep and edp: its dp index split)."""
        coords = {}
        for dim in reversed(self.grid()):  # innermost varies fastest
            coords[dim] = rank % self.size(dim)
            rank //= self.size(dim)
        out = {dim: coords[dim] for dim in self.grid()}
        if self.ep > 1:
            out |= {"ep": out["dp"] % self.ep, "edp": out["dp"] // self.ep}
        if self.replicate > 1:
            shard = self.size("shard")
            out |= {"shard": out["dp"] % shard, "replicate": out["dp"] // shard}
        return out

    def rank(self, **coords: int) -> int:
        if "ep" in coords or "edp" in coords:
            coords = coords | {"dp": coords.get("edp", 0) * self.ep + coords.get("ep", 0)}
        if "shard" in coords or "replicate" in coords:
            coords = coords | {"dp": coords.get("replicate", 0) * self.size("shard") + coords.get("shard", 0)}
        r = 0
        for dim in self.grid():
            r = r * self.size(dim) + coords.get(dim, 0)
        return r

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The global ranks of ``rank``'s group along ``dim``, ordered by their index in it."""
        c = self.coords(rank)
        if dim == "dpcp":  # dp-major, cp within
            return [self.rank(**(c | {"dp": d, "cp": k})) for d in range(self.dp) for k in range(self.cp)]
        if dim == "dp":  # ep, edp (shard, replicate) follow from dp
            c = {k: v for k, v in c.items() if k in self.grid()}
        elif dim in EXPERT_DIMS:
            c = {k: v for k, v in c.items() if k != "dp" and k not in HSDP_DIMS}
        elif dim in HSDP_DIMS:
            c = {k: v for k, v in c.items() if k != "dp" and k not in EXPERT_DIMS}
        return [self.rank(**(c | {dim: i})) for i in range(self.size(dim))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each once, in a fixed order (the order ranks must create them)."""
        seen, out = set(), []
        for r in range(self.world):
            g = tuple(self.group_of(r, dim))
            if g not in seen:
                seen.add(g)
                out.append(list(g))
        return out

    def dims(self) -> tuple[str, ...]:
        """The dimensions with a group of their own: pp, dp, tp, under --ep ep and edp, under --cp cp and dpcp,
        under --replicate shard and replicate."""
        return (DIMS + (EXPERT_DIMS if self.ep > 1 else ()) + (CONTEXT_DIMS if self.cp > 1 else ())
                + (HSDP_DIMS if self.replicate > 1 else ()))

    def describe(self) -> str:
        return " x ".join(f"{dim} {self.size(dim)}" + (f" (edp {self.size('edp')} x ep {self.ep})"
                                                         if dim == "dp" and self.ep > 1 else "")
                          + (f" (replicate {self.replicate} x shard {self.size('shard')})"
                             if dim == "dp" and self.replicate > 1 else "") for dim in self.grid())

    def to_dict(self) -> dict:
        out = {"shape": {dim: self.size(dim) for dim in self.grid()}, "order": list(self.grid()),
               "layout": "rank = (pp_index * dp + dp_index) * tp + tp_index" if self.cp == 1 else
               "rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index"}
        if self.ep > 1:
            out["shape"] |= {"ep": self.ep, "edp": self.size("edp")}
            out["layout"] += "; dp_index = edp_index * ep + ep_index"
        if self.replicate > 1:
            out["shape"] |= {"replicate": self.replicate, "shard": self.size("shard")}
            out["layout"] += "; dp_index = replicate_index * shard + shard_index"
        return out


class Mesh:
    """This rank's view of the mesh: its coordinates and one Comm per dimension."""

    def __init__(self, shape: MeshShape, rank: int, world_comm: Comm, new_group=None):
        """``new_group(ranks)`` creates a process group (``torch.distributed.new_group``); it is
        called for every group of every dimension, on every rank, in the same order."""
        if shape.world != world_comm.world:
            raise ValueError(f"mesh {shape.describe()} has {shape.world} ranks, the world {world_comm.world}")
        self.shape, self.rank, self.world = shape, rank, world_comm
        self.coords = shape.coords(rank)
        self.comms: dict[str, Comm] = {}
        for dim in shape.dims():
            for index, ranks in enumerate(shape.groups(dim)):
                if len(ranks) == world_comm.world:
                    group = world_comm.group  # the whole world: no new group needed
                elif new_group is not None:
                    group = new_group(ranks)
                else:
                    group = None
                if rank in ranks:
                    self.comms[dim] = Comm(world_comm.recorder, ranks.index(rank), len(ranks), group, ranks,
                                           name=f"{dim} {index}")

    def comm(self, dim: str) -> Comm:
        return self.comms[dim]

    def size(self, dim: str) -> int:
        return self.shape.size(dim)

    def describe(self) -> str:
        where = ", ".join(f"{dim} {self.coords[dim]}" for dim in self.shape.dims())
        return f"mesh {self.shape.describe()} (rank {self.rank}: {where})"
