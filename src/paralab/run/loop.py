"""The training loop: one driver, and what else happens at each step as listeners.

:func:`run_steps` is the whole loop, the same for every strategy: for each
step it sets the learning rate, builds the step value from this rank's shard
(``training/step.py``, inside a ``data`` span), and hands it to the strategy
(``run_step``: forward, backward, synchronise, optimizer step, each timed by
the strategy). Everything else a step may need hooks in as a
:class:`Listener`, told of the step in a fixed order:

=================  =============================================================================
``Reached``        how many steps this rank has done (what the launcher reports if it fails)
``Kept``           the step's row of ``steps.jsonl``, its loss and gradient norm
``FirstStep``      what the rank holds over its first step (``run/held.py``, the ``held`` record)
``Logged``         the loss at log points, a non-finite loss stopping every rank alike, progress
``Checked``        ``--check``: the reference beside the run, compared at the checked steps
``Checkpoints``    ``--checkpoint-every`` and the run's last step: the records journaled, then committed
``faults.Faults``  ``PARALAB_FAULT``'s injected faults (testing restarts: ``run/faults.py``)
=================  =============================================================================

A listener's :meth:`~Listener.end_step` may return an error: the loop stops
there (every rank takes the same decision: those that can stop are
collective). The order matters where one reads another's work: a step's row
is kept before the log reads its loss, and journaled before its checkpoint
commits; the faults come last, so that the fault "after the last step"
fires once the run's last checkpoint is committed.
"""
from __future__ import annotations

import math
import sys
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

from ..progress import Progress
from ..strategies.base import StepResult
from ..training import step as steps
from ..training.grad_norm import NonFinite
from ..training.lr_schedule import set_lr
from . import checkpoint, held, records


@dataclass
class Taken:
    """A step the loop took: its value, the strategy's result, and when it began and ended (the recorder's
    clock: the data, the step, not the listeners)."""
    step: steps.Step
    result: StepResult
    t0: float
    t1: float


class Listener:
    """One concern of the loop; each method is optional."""

    def start_step(self, index: int) -> None:
        """Step ``index`` begins (before its data is loaded)."""

    def around_step(self, step: steps.Step):
        """A context the strategy's step runs inside."""
        return nullcontext()

    def end_step(self, taken: Taken) -> str | None:
        """The step is done; an error stops the loop (every rank must return it alike)."""
        return None

    def end_steps(self) -> str | None:
        """Every step is done (the loop was not stopped); an error stops what follows."""
        return None


def run_steps(s, first: int, listeners: list, seed: int, device, progress: Progress) -> str | None:
    """Steps ``first .. s.total_steps - 1`` of the rank's :class:`~paralab.run.worker.Setup` ``s``; the error
    that stopped them (said on stderr), or None. ``progress``: the bar, closed when the steps end."""
    rec = s.recorder
    for index in range(first, s.total_steps):
        rec.step, t0 = index, rec.now()
        for each in listeners:
            each.start_step(index)
        lr = s.lr_for(index)
        set_lr(s.optimizers, lr)
        with rec.span("data", "load"):  # this rank's shard, where it sits in the global batch, its documents
            step = steps.of_shard(s.source, index, *s.source.batch(index), seed=seed, lr=lr).on(device, s.dtype)
        try:
            with steps.entered(step), ExitStack() as around:
                for each in listeners:
                    around.enter_context(each.around_step(step))
                result = s.strategy.run_step(step.x, step.y)  # forward, backward, synchronise, optimizer step
        except NonFinite as exc:  # --on-nonfinite stop: every rank raised it in the same step, before its update
            progress.close()
            print(f"paralab: rank {s.comm.rank}: {exc}", file=sys.stderr, flush=True)
            return str(exc)
        taken = Taken(step, result, t0, rec.now())
        rec.step = -1  # what follows (a check, a save) is outside the step's timing
        for each in listeners:
            error = each.end_step(taken)
            if error:
                progress.close()
                return error
    progress.close()
    for each in listeners:
        error = each.end_steps()
        if error:
            return error
    return None


# ---------------------------------------------------------------- the listeners
class Reached(Listener):
    """The steps this rank has done, or during one, the step it is in (as many done before it): what the
    launcher's report says if the rank fails (a restart's steps done twice are counted from it)."""

    def __init__(self, steps_done: int | None = None):
        self.steps = steps_done

    def start_step(self, index: int) -> None:
        self.steps = index

    def end_step(self, taken: Taken) -> None:
        self.steps = taken.step.index + 1  # a failure from here on (a check, a save) comes after these steps


class Kept(Listener):
    """This start's step records: a row of ``steps.jsonl`` per step (``records.step_row``), the [step, loss]
    pairs (``losses``: the checkpoint's, from the run's first step) and [step, gradient norm] pairs (``norms``:
    ``--check`` compares them); :meth:`journal` writes what is not yet in the rank's journal."""

    def __init__(self, rank: int, recorder, attempt: int, losses: list, run_dir):
        self.rank, self.recorder, self.attempt, self.run_dir = rank, recorder, attempt, run_dir
        self.rows: list[dict] = []
        self.losses, self.norms = losses, []
        self.journaled = (0, 0)  # this start's rows and spans already in the journal

    def end_step(self, taken: Taken) -> None:
        i, result = taken.step.index, taken.result
        self.rows.append(records.step_row(self.rank, i, taken.t0, taken.t1, result, self.recorder.split(i),
                                          self.attempt, taken.step.lr, taken.step.valid))
        if result.skipped:  # --on-nonfinite skip: every rank skipped this step's update, and counts it
            self.rows[-1]["skipped"] = True
        self.losses.append([i, result.loss])
        self.norms.append([i, result.grad_norm])

    def journal(self) -> None:
        """What this rank recorded since its last journaled checkpoint, to its journal (fsync'ed)."""
        records.journal_append(self.run_dir, self.rank, self.attempt, self.rows[self.journaled[0]:],
                               self.recorder.dump(self.journaled[1]))
        self.journaled = (len(self.rows), len(self.recorder.spans))


class FirstStep(Listener):
    """The first step of this start (warm-up) also measures what the rank holds (``record``: the ``held``
    record, ``run/held.py``)."""

    def __init__(self, first: int, strategy, optimizers: list):
        self.first, self.strategy, self.optimizers = first, strategy, optimizers
        self.record = None

    @contextmanager
    def around_step(self, step):
        if step.index != self.first:
            yield
            return
        probe = held.Probe([self.strategy], self.optimizers)
        with probe.watch():
            yield
        self.record = probe.record(step.index)


class Logged(Listener):
    """The loss: every rank's gathered at each log point (every step of a single process), their mean said at
    ``--log-every`` steps; a loss that became non-finite on any rank stops every rank there. And the progress
    bar, and the note of a skipped update."""

    def __init__(self, cfg, comm, progress: Progress, say, total: int):
        self.cfg, self.comm, self.progress, self.say, self.total = cfg, comm, progress, say, total
        self.first_bad = None  # the first step whose loss was not finite, on this rank

    def end_step(self, taken: Taken) -> str | None:
        i, result = taken.step.index, taken.result
        if result.skipped:
            why = "every rank skipped its update" if self.cfg.precision == "fp16" else \
                "--on-nonfinite skip: every rank skipped its update"  # fp16: its loss scale's overflow, or the guard
            self.say(f"{self.progress.clear()}{result.skipped} ({why})")
        elif self.first_bad is None and result.loss is not None and not math.isfinite(result.loss):
            self.first_bad = i
        last = i + 1 == self.total
        # every rank must take the same decision to stop, so the check is collective
        if self.comm.world == 1 or (i + 1) % self.cfg.log_every == 0 or last:
            error = self.log_or_stop(i, result.loss)
            if error:
                return error
        self.progress.update(i + 1)
        return None

    def log_or_stop(self, i: int, loss) -> str | None:
        seen = self.comm.all_gather_objects((loss, self.first_bad))
        bad = [b for _, b in seen if b is not None]
        if bad:
            error = (f"loss became non-finite at step {min(bad)}; lower --lr or check the data "
                     "(the records up to here are kept)")
            self.progress.close()
            print(f"paralab: rank {self.comm.rank}: {error}", file=sys.stderr, flush=True)
            return error
        if (i + 1) % self.cfg.log_every == 0 or i + 1 == self.total:
            values = [value for value, _ in seen if value is not None]
            mean = sum(values) / len(values)
            self.say(f"{self.progress.clear()}step {i + 1:>6}/{self.total}  loss {mean:.4f}")
            self.progress.event("loss", step=i + 1, total=self.total, loss=mean)
        return None


class Checked(Listener):
    """``--check``: the single-process reference advanced beside the run and compared at the checked steps
    (``check/verdict.py``), outside the steps' timing."""

    def __init__(self, check):
        self.check = check

    def end_step(self, taken: Taken) -> None:
        self.check.saw(taken.step, taken.result)
        self.check.after_step(taken.step.index + 1)


#: how the error of a run whose checkpoint could not be written begins (exit code 4)
CHECKPOINT_FAILED = "could not save"


class Checkpoints(Listener):
    """Every ``--checkpoint-every`` steps but the last, and after the last step: one commit. What the rank
    recorded since its last checkpoint goes to its journal (on disk) before the generation's manifest is
    written, so a checkpoint is never committed without its records (a journal's rows past the checkpoint a
    start resumes from are left out: ``records.journal_read``). ``saving``: called back once this rank's file
    of a generation is written, before the commit (a fault point)."""

    def __init__(self, cfg, run_dir, rank: int, strategy, comm, kept: Kept, first: int, total: int,
                 progress: Progress, saving=None):
        self.cfg, self.run_dir, self.rank, self.strategy, self.comm = cfg, run_dir, rank, strategy, comm
        self.kept, self.first, self.total, self.progress, self.saving = kept, first, total, progress, saving

    def end_step(self, taken: Taken) -> str | None:
        done = taken.step.index + 1
        every = self.cfg.checkpoint_every
        if every and done % every == 0 and done != self.total:
            return self.commit(done)
        return None

    def end_steps(self) -> str | None:
        if self.first >= self.total:  # the resume of a run stopped after its last checkpoint: saved
            return None
        return self.commit(self.total)  # the last steps' records, then their commit (every run's last checkpoint)

    def commit(self, done: int) -> str | None:
        """Journal, then save and commit this step's checkpoint with every rank (a collective); where any rank
        could not write its part, the error that stops every rank alike (said once, with what is intact and
        how to resume)."""
        self.kept.journal()
        try:
            checkpoint.save(self.run_dir, self.rank, done, self.cfg, self.strategy.state_dict(), self.comm,
                            losses=self.kept.losses, written=(lambda: self.saving(done)) if self.saving else None,
                            loss_scale=self.strategy.ctx.loss_scale)
            return None
        except checkpoint.WriteError as exc:
            from .failures import resume_hint
            intact = checkpoint.resumable_step(self.run_dir, self.cfg)
            hint = resume_hint(self.cfg, self.run_dir) if intact is not None else None
            error = (f"{CHECKPOINT_FAILED}: {exc}; " + (f"step {intact}'s is intact: {hint[0]}" if hint and hint[0]
                                                       else "no checkpoint of this run was committed before it"))
            self.progress.close()
            if self.rank == 0:
                print(f"paralab: {error}", file=sys.stderr, flush=True)
            return error
