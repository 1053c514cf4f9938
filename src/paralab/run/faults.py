"""Injected faults, for testing restarts: ``PARALAB_FAULT``, one listener of the training loop.

``PARALAB_FAULT=RANK:STEP[:KIND[:ATTEMPT]]`` makes rank RANK fail at step STEP (0 to N - 1: as many steps
done before it; STEP = N, the run's steps: after its last checkpoint, before it evaluates and writes its
records). Several faults: comma-separated. KIND:

- ``raise`` (the default): a RuntimeError at the start of the step, reported with its traceback;
- ``kill``: SIGKILL to itself there (no traceback, as ``kill -9`` or the kernel's out-of-memory killer);
- ``oom``: the process ends there at once with exit code 137 (= 128 + SIGKILL) and no Python error, as a
  shell or container runtime reports a process the out-of-memory killer took;
- ``save``: SIGKILL while saving the checkpoint of step STEP, its own file written and the generation not
  yet committed;
- ``records``: SIGKILL while the run's records are written (its step records written, not
  ``summary.json``);
- ``done``: SIGKILL once the run's records are written (a finished run is finished: nothing restarts);
- ``nan``: that step's loss made NaN on that rank (the non-finite guard's fault point, ``--on-nonfinite``):
  during that step, the rank's cross-entropy (``Context.cross_entropy``) is multiplied by NaN, so the guard
  sees what a real overflow gives it.

ATTEMPT: only in that start of the group (``--max-restarts``: 1 is the first); every start if left out.

The loop, the save and the records know nothing of faults: the loop tells :class:`Faults` (a listener,
``loop.py``) where a step starts and ends, and hands :meth:`Faults.at` to the save and the records as the
moment they call back (``written``, ``midway``).
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from ..errors import UsageError
from ..strategies.base import Context
from .loop import Listener

KINDS = ("raise", "kill", "oom", "save", "records", "done", "nan")
#: kinds that fire at a moment of their own (the save, the records, their end), not at a step's start
MOMENTS = ("save", "records", "done")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str = "raise"
    attempt: int | None = None  # None: every start of the group


def parse(spec: str | None) -> list[Fault]:
    """The faults ``PARALAB_FAULT`` asks for (none for an empty or absent spec)."""
    faults = []
    for item in spec.split(",") if spec else ():
        rank, step, *rest = item.split(":")
        kind = rest[0] if rest else "raise"
        if kind not in KINDS:
            raise UsageError(f"PARALAB_FAULT={spec}: the kind must be {', '.join(KINDS[:-1])} or {KINDS[-1]}")
        faults.append(Fault(int(rank), int(step), kind, int(rest[1]) if len(rest) > 1 else None))
    return faults


class Faults(Listener):
    """This rank's injected faults in this start of the group (``attempt``: 1 is the first; ``total``: the
    run's steps), as a listener of the training loop."""

    def __init__(self, rank: int, attempt: int, total: int, spec: str | None = None):
        spec = os.environ.get("PARALAB_FAULT") if spec is None else spec
        self.rank, self.total = rank, total
        self.faults = [f for f in parse(spec) if f.rank == rank and f.attempt in (None, attempt)]

    def at(self, moment: str, step: int) -> None:
        """Fire the fault set for this ``moment`` (``step``: its start; or a moment of :data:`MOMENTS`) of
        ``step``, if any."""
        for f in self.faults:
            # a moment's kind fires at that moment, the others at the step's start; nan poisons a loss instead
            if f.step != step or f.kind == "nan" or (f.kind if f.kind in MOMENTS else "step") != moment:
                continue
            if f.kind in ("kill", *MOMENTS):
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "oom":
                os._exit(137)
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step} (PARALAB_FAULT)")

    # ------------------------------------------------------------ the loop's listener
    def start_step(self, index: int) -> None:
        self.at("step", index)

    def around_step(self, step):
        if not any(f.kind == "nan" and f.step == step.index for f in self.faults):
            return nullcontext()
        return _poisoned()

    def end_steps(self) -> None:
        """STEP = the run's steps: after the last checkpoint, before the evaluation and the records."""
        self.at("step", self.total)


@contextmanager
def _poisoned():
    """Every strategy context's cross-entropy in this process (the rank's, and those a composed strategy derives
    from it) NaN while inside."""
    loss = Context.cross_entropy
    Context.cross_entropy = lambda ctx, logits, target: loss(ctx, logits, target) * float("nan")
    try:
        yield
    finally:
        Context.cross_entropy = loss
