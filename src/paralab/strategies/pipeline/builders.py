"""The compute orders: what each rank of a pipeline computes, and in which order.

A builder takes the pipeline's ranks ``p`` and microbatches ``m`` (and ``v``,
the stages per rank, where it interleaves) and returns, per rank, its compute
actions (``F``, ``B``, ``I``, ``W``, each naming its stage) in order. It
writes no transfers: ``actions.with_transfers`` adds the sends and receives.
``schedules.py`` registers each builder under its name, with its paper and
its formulas; the tests hold each order to them (``simulate.py``).

``m = 1`` with gpipe or 1f1b is naive model parallelism.
"""
from __future__ import annotations

from collections import deque

from .actions import Action, Kind


def _c(kind: Kind, mb: int, stage: int) -> Action:
    return Action(kind, mb, stage=stage)


def gpipe(world: int, microbatches: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward, microbatches in order.

    Each stage keeps all ``m`` microbatches alive until its backwards start.
    """
    return [[_c(Kind.FORWARD, mb, r) for mb in range(microbatches)]
            + [_c(Kind.BACKWARD, mb, r) for mb in range(microbatches)] for r in range(world)]


def one_f_one_b(world: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): warm-up, one forward / one backward, drain.

    Stage ``k`` first runs ``p - 1 - k`` warm-up forwards, then alternates one
    forward and one backward, then runs the remaining backwards, so at most
    ``p - k`` microbatches are alive on it. With ``m < p`` the warm-up is cut
    to ``m`` forwards: handled, not refused.
    """
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
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into ``I`` and ``W``.

    Stage ``k`` runs its ``I`` where 1F1B runs its backward but holds back
    ``k`` of its ``W`` (the last stage the most), so the input gradients reach
    the earlier stages sooner, and runs the held-back ``W`` in the drain,
    where 1F1B idles. A ``W`` keeps its microbatch alive until it runs.
    """
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
    """ZB-H2 (Qi et al. 2024): up to ``2p - 1`` microbatches alive per stage, by a greedy list scheduler.

    Every action takes one unit of time on an ideal clock, transfers none. At
    each tick every free stage picks, in this order: the ``I`` of its oldest
    microbatch not yet back-propagated once its output gradient is there (the
    last stage: once its forward is done); else its next ``F`` once the input
    is there, while fewer than the memory bound are alive (forwarded, ``W``
    not yet run); else its oldest waiting ``W``. The per-rank orders it
    records are the schedule; the executor runs them whatever the real times.
    The early stages run more warm-up forwards and put their ``W`` off, so at
    (or near) equal times no stage waits once it has started.
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
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): rank ``r`` holds stages ``r + c·p`` (``c < v``).

    The k-th forward of a rank is chunk ``(k // p) % v`` of microbatch
    ``(k // (p·v))·p + k % p`` (groups of ``p`` microbatches go through the
    rank's chunks in order); the k-th backward the same with the chunks
    reversed. Rank ``r`` runs ``interleaved_warmup`` forwards first, then one
    forward / one backward. Needs ``m`` a multiple of ``p``.
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
