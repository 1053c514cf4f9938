"""A router's near-ties: where the check's reference takes the run's choice of experts.

A mixture of experts chooses each token's top-k experts from its router's
scores (``models/moe.py``): a threshold. Below fp64 the run's scores and the
reference's differ by rounding, and where a token's K-th and (K+1)-th scores
are that close the two choose differently; from there the experts learn from
different tokens and the run drifts outside its noise band, a correct layout
said to be a bug (the band's references cross such ties only by chance). An
fp16 overflow is the same kind of threshold, and there the reference follows
the run's decision (``reference._scaler_step``). So it does here, token by
token, but only where the run's own scores explain its choice:

- on every rank, the run's MoE layers record each training forward's scores
  and choices (:class:`Recording`), keyed by (step, block, the forward's first
  row in the global batch), and rank 0 gathers them before its reference
  trains (:class:`Routes`);
- at each forward of the reference (and of each of the band's references), a
  token whose top-k differs from the run's takes the run's where, at every
  position j of the k, the reference's own scores of its expert and the run's
  differ by at most ``2 d``, ``d`` the largest deviation of the run's scores
  of that token from the reference's (:class:`Following`). That is exactly
  the gap a deviation of ``d`` can cross: the j-th largest of a token's scores
  moves by at most ``d`` when every score does, so the run's j-th choice sits
  within ``2 d`` of the reference's j-th;
- the run records the top-k of its own scores, so at the same tokens every
  choice it made otherwise lies within ``2 d`` and is followed: the rule holds
  the two forwards to being the same tokens, and one beyond it is said, not
  followed (:func:`not_followed_line`). Following hides no bug: the scores
  come from the router's weights and its input, and whatever moved those
  moves the gates, the outputs and the weights the comparisons judge (the
  scoring itself is the model's code, which run and reference share).

In fp64 nothing is followed (no reference is banded there, but for a
strategy's lossy ``gradient_wire``): the router runs in float64, and a
correct layout's scores agree to the last bits.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..models.moe import moe_layers
from ..training import step as steps

#: float64's rounding of a score difference (scores are at most 1): the slack the 2 d test allows
SLACK = 4 * 2.0 ** -53


def key_of(module) -> tuple[int, int, int]:
    """Which forward this is: (step, the MoE's block, the first row of its tokens in the step's global batch)."""
    at = steps.current()
    return at.index, module.layer, at.first + (at.offset or 0)


def modules_held(strategy) -> list[nn.Module]:
    """The modules a strategy holds: the values of its attributes (and of its flavours', stages', ... the
    objects ``diverge.held_objects`` walks, and the dicts and lists they hold) that are modules."""
    from .diverge import held_objects
    found = []
    for o in held_objects(strategy, lambda o: True):
        values = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else \
            vars(o).values() if hasattr(o, "__dict__") else ()
        found += [v for v in values if isinstance(v, nn.Module)]
    return found


class Recording:
    """The run's side, on every rank: each training forward's scores and top-k choices of every MoE layer of
    ``roots`` (the modules a strategy holds, :func:`modules_held`), until :meth:`take` hands them over."""

    def __init__(self, roots: list[nn.Module], sends: bool = True):
        self.forwards: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sends = sends  # False: another rank routes the same tokens alike (tp rank > 0) and sends them
        self.layers = {id(m): m for root in roots for m in moe_layers(root)}
        for m in self.layers.values():
            m.choose = self

    def __call__(self, module, probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        if module.training and self.sends:
            self.forwards[key_of(module)] = (probs.detach().cpu(), expert.detach().cpu())
        return expert

    def take(self) -> dict:
        """The forwards recorded since the last call (then forgotten here)."""
        out, self.forwards = self.forwards, {}
        return out


class Routes:
    """Rank 0's: every rank's recorded forwards (:meth:`add`, each rank's :meth:`Recording.take`), kept until
    every reference has passed their step (:meth:`forget_before`): the band's references, trained on first
    need, replay from the first step, so a check whose comparisons all stay exact keeps them to its end,
    ``8 (E + K)`` bytes per token of each MoE layer's forwards."""

    def __init__(self):
        self.forwards: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, taken: list[dict] | None) -> None:
        for forwards in taken or ():
            self.forwards.update(forwards)

    def forget_before(self, step: int) -> None:
        """Drop the forwards of the steps before ``step`` (from 0), which every reference has passed."""
        self.forwards = {k: v for k, v in self.forwards.items() if k[0] >= step}

    def forget_passed(self, ref, band) -> None:
        """Drop what the reference ``ref`` and ``band``'s references (None: none) have all passed."""
        self.forget_before(min(ref.step, band.least_step() if band is not None else ref.step))


class Following:
    """A reference's side: its MoE layers' ``choose``, taking the run's choice at a token where the run's
    scores explain it (the module's docstring); what it followed and what it did not, each as
    ``(step, block, tokens, score gap, twice the deviation)`` of its forward's widest. ``counting``: False for
    a copy of the reference's model (the replay's module outputs), which follows alike but counts nothing."""

    def __init__(self, routes: Routes, model: nn.Module | None = None, counting: bool = True):
        self.routes, self.counting = routes, counting
        self.followed: list[tuple] = []
        self.not_followed: list[tuple] = []
        for m in moe_layers(model) if model is not None else ():
            m.choose = self

    def __deepcopy__(self, memo):  # a copy of the reference's model follows the same routes, uncounted
        return Following(self.routes, counting=False)

    def __call__(self, module, probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        key = key_of(module)
        run = self.routes.forwards.get(key) if module.training else None
        if run is None:
            return expert
        run_probs, run_expert = (t.to(probs.device) for t in run)
        if run_expert.shape != expert.shape or run_probs.shape != probs.shape:  # not the same tokens: no claim
            return expert
        differ = (run_expert != expert).any(1)
        if not bool(differ.any()):
            return expert
        probs = probs.detach()
        d = (run_probs - probs).abs().max(1).values                  # each token's largest score deviation
        gap = (probs.gather(1, expert) - probs.gather(1, run_expert)).abs().max(1).values
        explained = differ & (gap <= 2 * d + SLACK)
        for found, where in ((self.followed, explained), (self.not_followed, differ & ~explained)):
            if self.counting and bool(where.any()):
                worst = int(torch.argmax(torch.where(where, gap, -1.0)))
                found.append((key[0] + 1, key[1], int(where.sum()), float(gap[worst]), float(2 * d[worst])))
        return torch.where(explained[:, None], run_expert, expert)


def followed_line(followed: list[tuple]) -> str | None:
    """What the reference followed, as one line (None: nothing)."""
    if not followed:
        return None
    tokens = sum(f[2] for f in followed)
    per: dict[tuple[int, int], int] = {}  # (step, block) -> tokens, over that step's forwards (shards, microbatches)
    for s, b, n, _, _ in followed:
        per[(s, b)] = per.get((s, b), 0) + n
    where = ", ".join(f"step {s} block {b}: {n}" for (s, b), n in list(per.items())[:6]) + (
        ", ..." if len(per) > 6 else "")
    widest = max(followed, key=lambda f: f[3])
    return (f"experts: the reference took the run's choice at {tokens} token(s) whose top-k the two decided "
            f"otherwise ({where}): near-ties the run's scores explain (the widest: a score gap of {widest[3]:.3g} "
            f"within twice the run's deviation there, {widest[4]:.3g}), as rounding crosses a threshold")


def not_followed_line(not_followed: list[tuple]) -> str | None:
    """Choices the reference did not take, as one line (None: there were none). The run records the top-k of
    its own scores, so at the same tokens every choice it made otherwise is within 2 d; one beyond it says the
    two forwards did not hold the same tokens (a fault of the check's, not a verdict on the run)."""
    if not not_followed:
        return None
    s, b, n, gap, twice = not_followed[0]
    more = f" (and at {len(not_followed) - 1} more forward(s))" if len(not_followed) > 1 else ""
    return (f"experts: at step {s}, block {b}, the run chose otherwise than the reference for {n} token(s){more} "
            f"where the reference's scores of the two differ by {gap:.3g}, more than twice the run's deviation "
            f"({twice:.3g}): not a near-tie, so not followed (the run records the top-k of its own scores, so the "
            "two forwards did not hold the same tokens there)")
