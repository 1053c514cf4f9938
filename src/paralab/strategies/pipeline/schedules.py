"""Pipeline schedules as data: one ordered list of actions per rank.

A schedule says, for every rank of a ``p``-rank pipeline fed ``m``
microbatches, what to do and in which order: run the forward or backward of a
microbatch on one of its stages, send or receive an activation (forward
direction) or a gradient (backward direction). One executor
(``executor.py``) runs any such list, so adding a schedule is adding a
function here; the tests check the lists without running a model
(:func:`check_local`, :func:`simulate`).

Stages and ranks. The model is cut into ``S`` stages; a schedule's
``placement`` says which rank holds each stage. Most schedules hold one stage
per rank (``S = p``, stage ``k`` on rank ``k``); ``interleaved-1f1b`` holds
``v`` non-adjacent stages per rank (``S = p·v``, rank ``r`` holds stages
``r, r+p, r+2p, ...``). Every action names its stage; a send or receive also
names the peer rank. Two consecutive stages on one rank hand their tensors
over in memory, without a transfer.

Backward comes whole (``B``: input and weight gradients in one pass) or split
(zero-bubble): ``I`` computes only the gradient of the stage's input (what
the stage before waits for) and ``W`` later the gradients of the weights
(what only the optimizer waits for), filling time the stage would idle.

Channels: the messages from rank ``a`` to rank ``b`` travel on one
first-in-first-out channel, whatever their kind or stage, so the k-th send
from ``a`` to ``b`` meets ``b``'s k-th receive from ``a``. The builders write
the compute order only; :func:`with_transfers` adds the sends (right after
the compute that produced the tensor) and the receives (right before the
compute that needs it, preceded by whatever the same peer sent earlier), so
every built schedule pairs up by construction, and :func:`simulate` checks
any list. Sends never block (the executor posts them with ``isend`` and waits
for them at the end of the step); a receive blocks until its message has
arrived.

Schedules:

- ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward
  (microbatches in order). Stage ``k`` keeps all ``m`` microbatches alive.
- ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): stage ``k`` first runs
  ``p - 1 - k`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. The bubble is GPipe's,
  ``(p - 1) / (m + p - 1)`` with equal stage times, but at most ``p - k``
  microbatches are alive on stage ``k``. With ``m < p`` the warm-up is cut to
  ``m`` forwards: handled, not refused.
- ``zb-h1`` (zero bubble, Qi et al., ICLR 2024, "ZB-H1"): 1F1B with the
  backward split into ``I`` and ``W``; stage ``k`` runs its ``I`` as 1F1B runs
  its backward but holds back ``k`` of its ``W`` (the last stage the most), so
  the input gradients reach the earlier stages sooner, and runs the held-back
  ``W`` in the drain where 1F1B idles. With ``T_F = T_I = T_W`` its idle time
  is ``(p-1)(T_F + T_I - T_W)`` against 1F1B's ``(p-1)(T_F + T_I + T_W)``; at
  most ``p`` microbatches are alive on any stage (1F1B's stage 0).
- ``zb-h2`` (zero bubble with more memory, Qi et al., "ZB-H2"): the same split,
  up to ``2p - 1`` microbatches alive on every stage. The order is what a
  greedy list scheduler on equal action times gives, each stage choosing, when
  free: an ``I`` whose gradient is there (the stages before wait for it), else
  a ``F`` whose input is there while fewer than ``2p - 1`` microbatches are
  alive, else a waiting ``W``. The early stages run more warm-up forwards and
  put their ``W`` off, so at (or near) equal times no stage waits once it
  has started: one step idles only the pipeline's fill, ``(p-1)·T_F`` per
  rank; ZB-H1 idles ``(p-1)(T_F + T_I - T_W)``: the same at equal times,
  more when ``I`` costs more than ``W``. Steps that follow one another
  without a synchronisation between them hide that fill too (each stage
  starts its next step ``T_F`` after the stage before: the paper's
  parallelogram, its zero bubble). It holds ``2p - 1`` microbatches where
  1F1B's stage 0 holds ``p``: memory bought for time.
- ``interleaved-1f1b`` (Megatron-LM's interleaved schedule, Narayanan et al.
  2021): ``v`` stages per rank; microbatches enter in groups of ``p``, each
  group running through a rank's stages in order (forward) and back
  (backward); ``(p - 1 - r)·2 + (v - 1)·p`` warm-up forwards on rank ``r``,
  then one forward / one backward. Needs ``m`` a multiple of ``p``; bubble
  ``(p - 1) / (v·m + p - 1)`` (the ``(p-1)/m`` of 1F1B divided by ``v``).

``m = 1`` with gpipe or 1f1b is naive model parallelism.
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
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b")
#: schedules that hold several stages per rank (``--virtual-stages``)
VIRTUAL = ("interleaved-1f1b",)
#: PyTorch's V-shaped zero-bubble schedules, which only ``torch-pipeline`` runs (see its module)
TORCH_ONLY = ("zbv", "dualpipev")


class ScheduleError(Exception):
    """An action list that is inconsistent, mismatched or would deadlock."""


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    peer: int | None = None   # the other rank of a send/recv (its pipeline rank); None for compute
    stage: int | None = None  # the stage it runs on / sends from / receives for; None: the rank's own

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))  # also accepts the kind's name

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


# ---------------------------------------------------------------- the compute orders
def _c(kind: Kind, mb: int, stage: int) -> Action:
    return Action(kind, mb, stage=stage)


def gpipe(world: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every stage."""
    return [[_c(Kind.FORWARD, mb, r) for mb in range(microbatches)]
            + [_c(Kind.BACKWARD, mb, r) for mb in range(microbatches)] for r in range(world)]


def one_f_one_b(world: int, microbatches: int) -> list[list[Action]]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    out = []
    for r in range(world):
        warmup = min(world - 1 - r, microbatches)
        acts = [_c(Kind.FORWARD, mb, r) for mb in range(warmup)]
        for j in range(microbatches - warmup):
            acts += [_c(Kind.FORWARD, warmup + j, r), _c(Kind.BACKWARD, j, r)]
        acts += [_c(Kind.BACKWARD, mb, r) for mb in range(microbatches - warmup, microbatches)]
        out.append(acts)
    return out


def zb_h1(world: int, microbatches: int) -> list[list[Action]]:
    """1F1B with the backward split into I and W; stage ``k`` holds back ``k`` W's for the drain."""
    out = []
    for r in range(world):
        warmup = min(world - 1 - r, microbatches)
        held = r  # W's this stage may keep waiting: the later the stage, the sooner its I must go back
        acts = [_c(Kind.FORWARD, mb, r) for mb in range(warmup)]
        waiting: deque[int] = deque()

        def backward_input(mb: int) -> None:
            acts.append(_c(Kind.BACKWARD_INPUT, mb, r))
            waiting.append(mb)

        for j in range(microbatches - warmup):
            acts.append(_c(Kind.FORWARD, warmup + j, r))
            backward_input(j)
            if len(waiting) > held:
                acts.append(_c(Kind.BACKWARD_WEIGHT, waiting.popleft(), r))
        for mb in range(microbatches - warmup, microbatches):
            backward_input(mb)  # the drain: after each I, one W where 1F1B would wait for a gradient
            if waiting:
                acts.append(_c(Kind.BACKWARD_WEIGHT, waiting.popleft(), r))
        acts += [_c(Kind.BACKWARD_WEIGHT, mb, r) for mb in waiting]
        out.append(acts)
    return out


def zb_h2(world: int, microbatches: int) -> list[list[Action]]:
    """Zero bubble with up to ``2p - 1`` microbatches alive per stage: a greedy list scheduler.

    Every action takes one unit of time on an ideal clock, transfers none. At
    each tick every free stage picks, in this order: the ``I`` of its oldest
    microbatch not yet back-propagated once its output gradient is there (the
    last stage: once its forward is done); else its next ``F`` once the input
    is there, while fewer than the memory bound are alive (forwarded, ``W``
    not yet run); else its oldest waiting ``W``. The per-rank orders it
    records are the schedule; the executor runs them whatever the real times.
    """
    p, m = world, microbatches
    bound = min(2 * p - 1, m)
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, microbatch) -> tick it finished
    forwarded, inputs, weights = [0] * p, [0] * p, [0] * p  # next F, I and W of each stage
    free_at = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]

    def finished(key: tuple[Kind, int, int], tick: int) -> bool:
        return key in done and done[key] <= tick

    tick = 0
    while any(w < m for w in weights):
        picks = []
        for s in range(p):
            if free_at[s] > tick:
                continue
            i, f = inputs[s], forwarded[s]
            grad_there = finished((Kind.FORWARD, s, i) if s == p - 1 else (Kind.BACKWARD_INPUT, s + 1, i), tick)
            if i < f and grad_there:
                picks.append(_c(Kind.BACKWARD_INPUT, i, s))
            elif f < m and f - weights[s] < bound and (s == 0 or finished((Kind.FORWARD, s - 1, f), tick)):
                picks.append(_c(Kind.FORWARD, f, s))
            elif weights[s] < i:
                picks.append(_c(Kind.BACKWARD_WEIGHT, weights[s], s))
        for a in picks:  # decided on what had finished by this tick, then all started together
            s = a.stage
            out[s].append(a)
            done[(a.kind, s, a.microbatch)] = free_at[s] = tick + 1
            counter = {Kind.FORWARD: forwarded, Kind.BACKWARD_INPUT: inputs, Kind.BACKWARD_WEIGHT: weights}[a.kind]
            counter[s] += 1
        tick += 1
    return out


def interleaved_warmup(world: int, virtual: int, microbatches: int, rank: int) -> int:
    """Megatron-LM's warm-up forwards on ``rank`` (chunk-microbatches), capped at all of them."""
    return min((world - 1 - rank) * 2 + (virtual - 1) * world, microbatches * virtual)


def interleaved_1f1b(world: int, microbatches: int, virtual: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: rank ``r`` holds stages ``r + c·p`` (``c < v``).

    The k-th forward of a rank is chunk ``(k // p) % v`` of microbatch
    ``(k // (p·v))·p + k % p`` (groups of ``p`` microbatches go through the
    rank's chunks in order); the k-th backward the same with the chunks
    reversed. Needs ``m`` a multiple of ``p``.
    """
    p, v, m = world, virtual, microbatches

    def which(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        total, warmup = m * v, interleaved_warmup(p, v, m, r)

        def step(kind: Kind, k: int) -> Action:
            chunk, mb = which(k, kind is Kind.BACKWARD)
            return _c(kind, mb, chunk * p + r)

        acts = [step(Kind.FORWARD, k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [step(Kind.FORWARD, warmup + k), step(Kind.BACKWARD, k)]
        acts += [step(Kind.BACKWARD, k) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def virtual_gpipe(world: int, microbatches: int, virtual: int) -> list[list[Action]]:
    """GPipe over the interleaved layout: each rank's stages in order forward, in reverse backward.

    What ``interleaved-1f1b`` runs for a batch whose microbatches are not a
    multiple of ``p`` (an epoch's short last batch)."""
    out = []
    for r in range(world):
        held = [c * world + r for c in range(virtual)]
        out.append([_c(Kind.FORWARD, mb, s) for s in held for mb in range(microbatches)]
                   + [_c(Kind.BACKWARD, mb, s) for s in reversed(held) for mb in range(microbatches)])
    return out


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
    streams = {(src, dst): deque(message_of(a) for a in sends[src] if a.peer == dst)
               for src in range(len(compute)) for dst in range(len(compute))}

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


# ---------------------------------------------------------------- building
def placement_for(name: str, workers: int, virtual: int = 1) -> tuple[int, ...]:
    """Which rank holds each stage: one stage per rank, or ``v`` interleaved (stage s on rank s mod p)."""
    stages = workers * (virtual if name in VIRTUAL else 1)
    return tuple(s % workers for s in range(stages))


def layout_problem(name: str, workers: int, microbatches: int, virtual: int = 1) -> str | None:
    """Why schedule ``name`` cannot run this layout (None if it can), in words for the user."""
    if name in TORCH_ONLY:
        return (f"{name} is run by torch-pipeline only (PyTorch's schedule); ours are {', '.join(SCHEDULES)}: "
                f"'paralab train torch-pipeline --schedule {name}'")
    if name not in SCHEDULES:
        return f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    if name in VIRTUAL:
        if virtual < 2:
            return f"{name} holds several stages per rank: give --virtual-stages 2 or more"
        if microbatches % workers:
            return (f"{name} feeds microbatches in groups of one per pipeline rank: --microbatches "
                    f"{microbatches} must be a multiple of the {workers} pipeline stages")
    elif virtual != 1:
        return f"--virtual-stages {virtual} applies to {', '.join(VIRTUAL)} only, not {name}"
    return None


def build_schedule(name: str, workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Every rank's ordered action list for schedule ``name``.

    ``interleaved-1f1b`` with ``m`` not a multiple of ``p`` (only an epoch's
    short last batch: the configured ``m`` is checked before start) runs
    GPipe's order over the same interleaved layout.
    """
    if workers < 1 or microbatches < 1:
        raise ValueError("workers and microbatches must be positive")
    problem = layout_problem(name, workers, microbatches, virtual)
    short_batch = name in VIRTUAL and virtual >= 2 and microbatches % workers
    if problem and not short_batch:
        raise ValueError(problem)
    placement = placement_for(name, workers, virtual)
    if name == "gpipe":
        compute = gpipe(workers, microbatches)
    elif name == "1f1b":
        compute = one_f_one_b(workers, microbatches)
    elif name == "zb-h1":
        compute = zb_h1(workers, microbatches)
    elif name == "zb-h2":
        compute = zb_h2(workers, microbatches)
    elif short_batch:
        compute = virtual_gpipe(workers, microbatches, virtual)
    else:
        compute = interleaved_1f1b(workers, microbatches, virtual)
    return Schedule(name, microbatches, placement, with_transfers(compute, placement))


# ---------------------------------------------------------------- reading a list
def in_flight(actions: list[Action]) -> list[int]:
    """(Stage, microbatch) pairs whose activations are alive after each action: from the forward to
    the compute that completes the weight gradients (``B``, or ``W`` when the backward is split)."""
    alive, trace = 0, []
    for a in actions:
        if a.kind is Kind.FORWARD:
            alive += 1
        elif a.kind.completes_weights:
            alive -= 1
        trace.append(alive)
    return trace


def peak_in_flight(actions: list[Action]) -> int:
    return max(in_flight(actions), default=0)


def check_local(actions: list[Action], rank: int, world: int, microbatches: int,
                placement: tuple[int, ...] | None = None) -> None:
    """One rank's list on its own: complete, and every action after what it depends on.

    For every stage it holds and every microbatch: one ``F``, then either one
    ``B`` or one ``I`` followed by one ``W``; the receives it needs before
    them; the sends after the compute that produces them.
    """
    placement = tuple(range(world)) if placement is None else tuple(placement)
    last = len(placement) - 1
    held = [s for s, r in enumerate(placement) if r == rank]
    done: set[tuple[Kind, int, int]] = set()
    for a in actions:
        s = rank if a.stage is None else a.stage
        if s not in held:
            raise ScheduleError(f"rank {rank}: {a.label()} runs on stage {s}, which rank {rank} does not hold")
        if not 0 <= a.microbatch < microbatches:
            raise ScheduleError(f"rank {rank}: {a.label()} names microbatch {a.microbatch} of {microbatches}")
        if (a.kind, s, a.microbatch) in done:
            raise ScheduleError(f"rank {rank}: {a.label()} appears twice")
        remote = {Kind.SEND_ACT: s + 1, Kind.RECV_GRAD: s + 1, Kind.RECV_ACT: s - 1, Kind.SEND_GRAD: s - 1}
        if a.kind in remote:
            other = remote[a.kind]
            if not 0 <= other <= last:
                raise ScheduleError(f"rank {rank}: {a.label()} talks to a rank outside the pipeline")
            if placement[other] == rank or a.peer != placement[other]:
                raise ScheduleError(f"rank {rank}: {a.label()} should have peer {placement[other]}"
                                    + (" (a stage on this rank: no transfer)" if placement[other] == rank else ""))
        elif a.peer is not None:
            raise ScheduleError(f"rank {rank}: {a.label()} is compute and names a peer")
        mb = a.microbatch
        local_prev = s > 0 and placement[s - 1] == rank
        local_next = s < last and placement[s + 1] == rank
        grad_in = [] if s == last else (
            [(Kind.BACKWARD, s + 1, mb), (Kind.BACKWARD_INPUT, s + 1, mb)] if local_next
            else [(Kind.RECV_GRAD, s, mb)])
        needs: list[list[tuple[Kind, int, int]]] = {  # each inner list: one of them must be done
            Kind.FORWARD: [] if s == 0 else [[(Kind.FORWARD, s - 1, mb)] if local_prev else [(Kind.RECV_ACT, s, mb)]],
            Kind.SEND_ACT: [[(Kind.FORWARD, s, mb)]],
            Kind.BACKWARD: [[(Kind.FORWARD, s, mb)]] + ([grad_in] if grad_in else []),
            Kind.BACKWARD_INPUT: [[(Kind.FORWARD, s, mb)]] + ([grad_in] if grad_in else []),
            Kind.BACKWARD_WEIGHT: [[(Kind.BACKWARD_INPUT, s, mb)]],
            Kind.SEND_GRAD: [[(Kind.BACKWARD, s, mb), (Kind.BACKWARD_INPUT, s, mb)]],
        }.get(a.kind, [])
        for options in needs:
            if not any(n in done for n in options):
                k, st, m = options[0]
                raise ScheduleError(f"rank {rank}: {a.label()} comes before {k.short} of microbatch {m} "
                                    f"on stage {st}")
        if a.kind is Kind.BACKWARD and (Kind.BACKWARD_INPUT, s, mb) in done or \
                a.kind is Kind.BACKWARD_INPUT and (Kind.BACKWARD, s, mb) in done:
            raise ScheduleError(f"rank {rank}: microbatch {mb} on stage {s} has both a whole and a split backward")
        done.add((a.kind, s, a.microbatch))
    want = set()
    for s in held:
        split = any((Kind.BACKWARD_INPUT, s, m) in done for m in range(microbatches))
        kinds = [Kind.FORWARD] + ([Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT] if split else [Kind.BACKWARD])
        if s > 0 and placement[s - 1] != rank:
            kinds += [Kind.RECV_ACT, Kind.SEND_GRAD]
        if s < last and placement[s + 1] != rank:
            kinds += [Kind.SEND_ACT, Kind.RECV_GRAD]
        want |= {(k, s, m) for k in kinds for m in range(microbatches)}
    if done != want:
        show = lambda items: sorted(f"{k.short}{m}s{s}" for k, s, m in items)[:4]  # noqa: E731
        raise ScheduleError(f"rank {rank}: missing {show(want - done)} extra {show(done - want)}")


@dataclass
class Timed:
    """One action placed on an ideal clock (``simulate``); recv waits are its idle time."""
    rank: int
    action: Action
    t0: float
    t1: float


def simulate(schedule: Schedule | list[list[Action]], forward_time: float | list[float] = 1.0,
             backward_time: float | list[float] = 2.0, comm_time: float = 0.0,
             input_time: float | list[float] | None = None,
             weight_time: float | list[float] | None = None) -> list[list[Timed]]:
    """Run the lists on an ideal machine and return every action's start and end.

    Times may be one number or one per stage (``B`` whole; ``I`` and ``W``
    default to half of it each). Sends take no time on the sender and arrive
    ``comm_time`` later; a receive waits (idle) until its message is there.
    Raises ScheduleError if a list is inconsistent, if a receive would take
    a message meant for another stage or microbatch (the channel between two
    ranks is first-in-first-out), if some rank can never proceed (deadlock)
    or if a message is never received. The result draws the ideal timeline
    of a schedule.
    """
    sched = as_schedule(schedule)
    world, stages = sched.ranks, sched.stages
    for rank, acts in enumerate(sched):
        check_local(acts, rank, world, sched.microbatches, sched.placement)

    def per_stage(t, default):
        t = default if t is None else t
        return list(t) if isinstance(t, (list, tuple)) else [float(t)] * stages

    bwd = per_stage(backward_time, None)
    cost = {Kind.FORWARD: per_stage(forward_time, None), Kind.BACKWARD: bwd,
            Kind.BACKWARD_INPUT: per_stage(input_time, [b / 2 for b in bwd]),
            Kind.BACKWARD_WEIGHT: per_stage(weight_time, [b / 2 for b in bwd])}
    clock = [0.0] * world
    pos = [0] * world
    channels: dict[tuple[int, int], deque] = {}
    timeline: list[list[Timed]] = [[] for _ in range(world)]
    while True:
        progressed = False
        for rank in range(world):
            while pos[rank] < len(sched[rank]):
                a = sched[rank][pos[rank]]
                t = clock[rank]
                if a.kind.is_compute:
                    clock[rank] = t + cost[a.kind][a.stage]
                elif a.kind.is_send:
                    channels.setdefault((rank, a.peer), deque()).append((message_of(a), t + comm_time))
                else:
                    queue = channels.get((a.peer, rank))
                    if not queue:
                        break  # blocked: the message has not been sent yet
                    message, ready = queue.popleft()
                    if message != message_of(a):
                        raise ScheduleError(f"rank {rank}: {a.label()} would receive {message[0]} of microbatch "
                                            f"{message[2]} for stage {message[1]} (sends and receives on "
                                            f"{a.peer}->{rank} are out of order)")
                    clock[rank] = max(t, ready)
                timeline[rank].append(Timed(rank, a, t, clock[rank]))
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(sched[r]) for r in range(world)):
            break
        if not progressed:
            stuck = [f"rank {r} at {sched[r][pos[r]].label()}" for r in range(world) if pos[r] < len(sched[r])]
            raise ScheduleError("deadlock: " + ", ".join(stuck))
    left = {k: list(q) for k, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages never received: {left}")
    return timeline


def simulated_bubble(timeline: list[list[Timed]]) -> list[float]:
    """Per rank: 1 - compute time / makespan of the simulated step."""
    end = max((t.t1 for row in timeline for t in row), default=0.0)
    if end <= 0:
        return [0.0 for _ in timeline]
    return [1 - sum(t.t1 - t.t0 for t in row if t.action.is_compute) / end for row in timeline]
