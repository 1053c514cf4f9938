"""The pipeline schedule's vocabulary: actions, per-rank lists, transfers.

A schedule says, for every rank of a ``p``-rank pipeline fed ``m``
microbatches, what to do and in which order: run the forward or backward of a
microbatch on one of its stages, send or receive an activation (forward
direction) or a gradient (backward direction). This module is that language
(:class:`Kind`, :class:`Action`, :class:`Schedule`); ``builders.py`` writes
schedules in it, ``schedules.py`` names them, ``simulate.py`` checks them and
``executor.py`` runs them.

Stages and ranks. The model is cut into ``S`` stages; a schedule's
``placement`` says which rank holds each stage: one stage per rank
(``S = p``, stage ``k`` on rank ``k``), or ``v`` non-adjacent stages per rank
(``S = p·v``, rank ``r`` holds stages ``r, r+p, r+2p, ...``). Every action
names its stage; a send or receive also names the peer rank. Two consecutive
stages on one rank hand their tensors over in memory, without a transfer.

Backward comes whole (``B``: input and weight gradients in one pass) or split
(zero-bubble): ``I`` computes only the gradient of the stage's input (what
the stage before waits for) and ``W`` later the gradients of the weights
(what only the optimizer waits for), filling time the stage would idle.

Channels: the messages from rank ``a`` to rank ``b`` travel on one
first-in-first-out channel, whatever their kind or stage, so the k-th send
from ``a`` to ``b`` meets ``b``'s k-th receive from ``a``. Builders write the
compute order only; :func:`with_transfers` adds the sends (right after the
compute that produced the tensor) and the receives (right before the compute
that needs it, preceded by whatever the same peer sent earlier), so every
built schedule pairs up by construction. Sends never block (the executor
posts them with ``isend`` and waits for them at the end of the step); a
receive blocks until its message has arrived.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    """What an action does. A ``str`` enum: each kind compares equal to its name in records."""
    FORWARD = "forward"
    BACKWARD = "backward"                # input and weight gradients in one pass
    BACKWARD_INPUT = "backward_input"    # zero-bubble I: the gradient of the stage's input only
    BACKWARD_WEIGHT = "backward_weight"  # zero-bubble W: the gradients of the stage's weights
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)

    @property
    def sends_gradient_back(self) -> bool:
        """The compute after which the stage's input gradient exists (whole or input-only backward)."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_INPUT)

    @property
    def completes_weights(self) -> bool:
        """The compute that finishes a microbatch's weight gradients on its stage."""
        return self in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)

    @property
    def channel(self) -> str | None:
        """What a transfer carries: "act" (forward direction) or "grad"."""
        return {Kind.SEND_ACT: "act", Kind.RECV_ACT: "act", Kind.SEND_GRAD: "grad", Kind.RECV_GRAD: "grad"}.get(self)

    @property
    def short(self) -> str:
        return {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I", Kind.BACKWARD_WEIGHT: "W",
                Kind.SEND_ACT: "sA", Kind.RECV_ACT: "rA", Kind.SEND_GRAD: "sG", Kind.RECV_GRAD: "rG"}[self]


COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
KINDS = tuple(Kind)


class ScheduleError(Exception):
    """An action list that is inconsistent, mismatched or would deadlock."""


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    peer: int | None = None   # the other rank of a send/recv (its pipeline rank); None for compute
    stage: int | None = None  # the stage it runs on / sends from / receives for; None: the rank's own

    def __post_init__(self):
        if not isinstance(self.kind, Kind):  # also accepts the kind's name (the planner builds millions: no lookup)
            object.__setattr__(self, "kind", Kind(self.kind))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    def __str__(self) -> str:
        return f"{self.kind.short}{self.microbatch}" + ("" if self.peer is None else f"@{self.peer}")

    def label(self) -> str:
        """``str`` with the stage: ``F3s2`` is microbatch 3's forward on stage 2."""
        return (f"{self.kind.short}{self.microbatch}" + ("" if self.stage is None else f"s{self.stage}")
                + ("" if self.peer is None else f"@{self.peer}"))


@dataclass
class Schedule:
    """Every rank's ordered action list, and which rank holds which stage.

    Indexing and iterating go over the ranks' lists, so a Schedule reads as
    the plain list of lists it wraps.
    """
    name: str
    microbatches: int
    placement: tuple[int, ...]          # stage -> rank
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def stages(self) -> int:
        return len(self.placement)

    def held(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in pipeline order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def __getitem__(self, rank: int) -> list[Action]:
        return self.actions[rank]

    def __setitem__(self, rank: int, actions: list[Action]) -> None:
        self.actions[rank] = actions

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)


def as_schedule(schedule: Schedule | list[list[Action]]) -> Schedule:
    """A Schedule with every action's stage filled in. A plain list of lists is read as one stage
    per rank (stage ``k`` on rank ``k``); an action without a stage runs on its rank's only stage."""
    if isinstance(schedule, Schedule):
        name, placement, rows = schedule.name, schedule.placement, schedule.actions
    else:
        name, placement, rows = "custom", tuple(range(len(schedule))), schedule
    fixed = []
    for r, row in enumerate(rows):
        held = [s for s, owner in enumerate(placement) if owner == r]
        if any(a.stage is None for a in row) and len(held) != 1:
            raise ScheduleError(f"rank {r} holds stages {held}: every action must name its stage")
        fixed.append([a if a.stage is not None else Action(a.kind, a.microbatch, a.peer, held[0]) for a in row])
    microbatches = (schedule.microbatches if isinstance(schedule, Schedule)
                    else sum(a.kind is Kind.FORWARD for a in fixed[0]) if fixed else 0)
    return Schedule(name, microbatches, placement, fixed)


# ---------------------------------------------------------------- transfers
def message_of(a: Action) -> tuple[str, int, int]:
    """What a send carries or a receive expects: (channel, the stage that consumes it, microbatch)."""
    if a.kind is Kind.SEND_ACT:
        return "act", a.stage + 1, a.microbatch
    if a.kind is Kind.SEND_GRAD:
        return "grad", a.stage - 1, a.microbatch
    return a.kind.channel, a.stage, a.microbatch


def with_transfers(compute: list[list[Action]], placement: tuple[int, ...]) -> list[list[Action]]:
    """Add the sends and receives to per-rank compute orders.

    A send follows the compute that produced its tensor (a forward's output
    for the next stage, an input gradient for the stage before) when that
    stage lives on another rank. A receive precedes the compute that needs
    it, preceded in turn by the receives of whatever that peer sent earlier
    (one first-in-first-out channel per pair of ranks): receiving them sooner
    costs no wait, since the peer sent them before the one needed now.
    """
    last = len(placement) - 1
    sends: list[list[Action]] = []   # per rank, in order
    for r, acts in enumerate(compute):
        mine = []
        for a in acts:
            s = a.stage
            if a.kind is Kind.FORWARD and s < last and placement[s + 1] != r:
                mine.append(Action(Kind.SEND_ACT, a.microbatch, placement[s + 1], s))
            elif a.kind.sends_gradient_back and s > 0 and placement[s - 1] != r:
                mine.append(Action(Kind.SEND_GRAD, a.microbatch, placement[s - 1], s))
        sends.append(mine)
    streams = {(src, dst): deque() for src in range(len(compute)) for dst in range(len(compute))}
    for src, mine in enumerate(sends):  # each pair's channel, in the order its sender sends
        for a in mine:
            streams[(src, a.peer)].append(message_of(a))

    out = []
    for r, acts in enumerate(compute):
        got: set[tuple[str, int, int]] = set()
        row: list[Action] = []

        def receive(channel: str, stage: int, mb: int, src: int) -> None:
            while (channel, stage, mb) not in got:
                if not streams[(src, r)]:
                    raise ScheduleError(f"rank {r} needs {channel} for stage {stage} microbatch {mb} "
                                        f"from rank {src}, which never sends it")
                ch, st, m = streams[(src, r)].popleft()
                row.append(Action(Kind.RECV_ACT if ch == "act" else Kind.RECV_GRAD, m, src, st))
                got.add((ch, st, m))

        for a in acts:
            s = a.stage
            if a.kind is Kind.FORWARD and s > 0 and placement[s - 1] != r:
                receive("act", s, a.microbatch, placement[s - 1])
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and s < last and placement[s + 1] != r:
                receive("grad", s, a.microbatch, placement[s + 1])
            row.append(a)
            if a.kind is Kind.FORWARD and s < last and placement[s + 1] != r:
                row.append(Action(Kind.SEND_ACT, a.microbatch, placement[s + 1], s))
            elif a.kind.sends_gradient_back and s > 0 and placement[s - 1] != r:
                row.append(Action(Kind.SEND_GRAD, a.microbatch, placement[s - 1], s))
        out.append(row)
    return out

