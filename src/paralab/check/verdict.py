"""``--check`` on one rank: the reference beside the run, compared at the checked steps, one verdict.

Rank 0 trains the single-process reference alongside the run (or loads one an
earlier run kept, ``--check-cache``), and every rank compares, after each
checked step (:func:`checked_steps`: the first, the second, the last, and every
K-th with ``--check-every K``):

- ``weights``: this rank's view of the strategy's whole weights and buffers
  (``full_state_dict``, gathered where sharded) against the reference's. Rank 0
  compares its own; every other rank first compares its view's bits with rank
  0's, and a view with the same bits has the same deviation (rank 0's, sent as a
  line), so nothing large crosses the network and no other rank trains the
  reference; a rank whose view differs is sent the reference's weights and
  compares its own;
- ``optimizer``: every parameter's optimizer state (momentum, Adam's moments
  and step count), whole. Every rank's resumable state (``state_dict``, what a
  checkpoint holds) is gathered on rank 0 and put together by the strategy's
  own ``portable``, the same code a resume into another layout runs, so a
  state that is lost, wrong or not saved fails here, not after a resume;
- ``replicas``: where every rank holds a full replica, each rank's weights
  bit-identical to rank 0's.

At the end it also compares the ``loss`` every rank reported at every step
with its shard's loss in the reference (a loss that is reported wrong while
the gradients are right is caught here, and nowhere else), and the next
batch's ``outputs`` (logits): rank 0 sends the reference's losses, norms and
logits, which are small. The verdict is the worst deviation of any kind, at any
step, on any rank: a deviation that comes and goes still fails. It is said in
three words: ``exact`` (within fp64's tolerances), ``within rounding`` (below
fp64, or for a strategy with a lossy ``gradient_wire``: beyond them, but inside
the noise band rank 0 measures beside the run, ``check/band.py``) or ``bug``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn as nn

from ..data.loader import to_device
from ..models import structure_only
from ..strategies.base import AUTOCAST
from ..strategies.compression import reference_for
from ..strategies.tensor.strategy import tp_of
from ..training import step as steps
from ..training.loss_scale import torch_scaler
from ..training.lr_schedule import LRSchedule
from . import kept
from .band import Band, held_exact
from .routing import Following, Recording, Routes, followed_line, modules_held, not_followed_line
from .reference import (ADAMS, SCALE_DIFFERS, TOLERANCES, Comparison, banded, TorchSchedule, bits_deviation,
                        compare_optimizer, Replay, compare_tensors, optimizer_state, ratio_of, reference_train, worst)

#: the kinds of comparison, in the order their lines are printed
KINDS = ("weights", "optimizer", "replicas", "loss", "grad_norm", "outputs")


def checked_steps(start: int, total: int, every: int | None) -> list[int]:
    """The steps after which a run starting at ``start`` (a resumed one: its checkpoint's step) and
    ending at ``total`` is compared: the first and second of its own (the second is the first where
    momentum or Adam's moments carry history), the last, and every ``every``-th step."""
    steps = {start + 1, start + 2, total}
    if every:
        steps |= set(range(every, total + 1, every))
    return sorted(s for s in steps if start < s <= total)


def unexercised(cfg, strategy, start: int, total: int) -> list[str]:
    """The paths this run leaves trivial, so its check says nothing about them: the run's own (its steps,
    compression, recomputation) and its strategy's (``Strategy.unexercised``), each with the option that
    would exercise it."""
    from ..models import MODALITY
    notes = []
    if total - start == 1 and (cfg.optimizer in ADAMS or cfg.momentum > 0):
        notes.append("one step: the optimizer's state (momentum, Adam's moments) has no history yet, so what "
                     "carries it from step to step is not exercised: --num-batches 2 or more")
    if cfg.compress == "powersgd" and total <= cfg.powersgd_start_iter:
        notes.append(f"--compress powersgd: PowerSGD starts after {cfg.powersgd_start_iter} uncompressed steps and "
                     f"this run has {total}, so nothing was compressed: --num-batches {cfg.powersgd_start_iter + 2} "
                     "or more, or a smaller --powersgd-start-iter")
    if cfg.recompute != "none" and MODALITY[cfg.model] == "text" and not cfg.dropout:
        notes.append(f"--recompute {cfg.recompute}: the gpt draws no random numbers (--dropout 0), so what a "
                     "recompute restores for them is not exercised: --dropout 0.1")
    return notes + strategy.unexercised()


def short_batch_note(source, total: int) -> list[str]:
    """An epoch's short last batch (its rows fewer than the others', each rank's share too) when the run's steps
    held none: why, and what would reach one. Nothing with --drop-last, whose batches are all full by design."""
    if source.drop_last:
        return []
    n, B = len(source.data.train_y), source.global_batch
    synthetic = source.data.name.startswith("synthetic")
    size = 2 * B + B // 2  # a synthetic epoch of three steps, the third half full
    what = "so an epoch's short last batch (fewer rows on every rank than the batch configured) is not exercised"
    if n % B == 0:
        smaller = f"--synthetic-size {size} and --num-batches 3, or " if synthetic else ""
        return [f"every batch held all {B} samples (the {n} training samples divide into them), {what}: "
                f"{smaller}a --batch-size that does not divide {n}, with --num-batches reaching an epoch's end"]
    s = source.steps_per_epoch
    smaller = f" (or a smaller --synthetic-size, e.g. {size} with --num-batches 3)" if synthetic else ""
    return [f"the run ends at step {total}, before the epoch's short last batch (step {s}: {n - (s - 1) * B} "
            f"samples, the others {B}), {what}: --num-batches {s}{smaller}"]


def overflowed_too_often(followed: list[str]) -> str | None:
    """fp16: why the steps whose overflow the run decided otherwise than the reference (``followed``, as
    ``reference._scaler_step`` says them) are a bug, or None. Rounding crosses the overflow threshold now and
    then, and the halved scale then keeps the run away from it; a run that overflows where the reference does
    not at two steps or more is scaling, unscaling or skipping wrong (followed every time, such a run would
    pass with the reference skipping alike)."""
    differs = [why.split(":")[0] for why in followed if SCALE_DIFFERS in why]
    if differs:
        return (f"the run's loss scale is not torch's GradScaler's after {', '.join(differs)}: how the run grows, "
                "backs off or restores its scale is wrong")
    steps = [why.split(":")[0] for why in followed if "the run's gradient overflowed" in why]
    if len(steps) < 2:
        return None
    return (f"the run overflowed where the reference did not at {len(steps)} steps ({', '.join(steps)}): more than "
            "rounding crosses; how the run scales, unscales or skips its gradients is wrong")


def word_of(words: list[str]) -> str:
    """The verdict of many comparisons: ``bug`` if any is, else ``within rounding`` if any is, else ``exact``."""
    return next((w for w in ("bug", "within rounding") if w in words), "exact")


def cancelled_by_batchnorm(model: nn.Module) -> set[str]:
    """Names of the biases that feed a BatchNorm directly (in training it subtracts them right back)."""
    names = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (name, a), (_, b) in zip(children, children[1:]):
            if isinstance(b, nn.modules.batchnorm._BatchNorm) and getattr(a, "bias", None) is not None:
                names.add(f"{prefix}.{name}.bias" if prefix else f"{name}.bias")
    return names


class Reference:
    """The single-process reference, trained on the run's own batches, as far as it is asked.

    It replays the strategy's split (its data-parallel shards, the
    microbatches inside each, its BatchNorm rule) and learning-rate schedule,
    and keeps each step's loss per shard (``losses``).
    """

    def __init__(self, strategy, source, model_fn, optim_fn, lr_for, seed: int = 0, precision: str = "fp64",
                 perturb: str | None = None, unit: float = 0.0, wire: torch.dtype | None = None,
                 follow: dict | None = None, routes: Routes | None = None):
        self.model = model_fn()
        # the noise band's references (check/band.py): one change each; "exact" trains in float64, no autocast
        self.perturb, self.unit, self.wire = perturb, unit, wire
        if perturb == "exact":
            self.model = self.model.double()
        # a mixture of experts below fp64: the run's near-ties followed (check/routing.py), by the band's too
        self.routes = routes
        self.following = Following(routes, self.model) if routes is not None else None
        self.autocast = AUTOCAST.get(precision) if perturb != "exact" else None
        self.precision_name = precision
        # fp16: torch's own GradScaler, from where the run's loss scale stands (a resumed run's included), each
        # step's scale and skip kept in ``scales``; the band's references follow them (``follow``)
        scale = getattr(strategy.ctx, "loss_scale", None)
        self.scaler = torch_scaler(next(self.model.parameters()).device, scale.state_dict()) \
            if scale is not None and perturb is None else None
        self.scales = {} if self.scaler is not None else follow
        self.run_scales: dict | None = None  # the run's overflow decisions, which the scaler follows (Check.saw)
        self.seed = seed  # the run's: the gpt's dropout masks are drawn from it
        self.optimizer = optim_fn(list(self.model.parameters()))
        self.replicas, _ = strategy.replicas()
        self.microbatches, self.bn_rule = strategy.microbatches, strategy.bn_rule
        self.source = source
        # the run's schedule rebuilt from torch's schedulers (not the run's code), where torch's can express it
        self.own_schedule = isinstance(lr_for, LRSchedule) and TorchSchedule.expressible(lr_for)
        self.lr_for = TorchSchedule(lr_for) if self.own_schedule else lr_for
        self.packing = source.packing if source.documents else None  # documents: packed, padded; None: not
        self.step = 0
        self.losses: dict[int, list[float]] = {}  # step -> each shard's training loss
        self.clip = getattr(strategy.ctx, "clip_grad", None)
        self.norms: dict[int, float] = {}  # --clip-grad: step -> the gradient norm before clipping
        # gradient compression: the reference applies the same to each shard's gradient (or None)
        self.compression = reference_for(strategy.ctx.options, self.replicas)

    def describe(self) -> str:
        return (f"{self.replicas} shard(s) x {self.microbatches} microbatch(es), BN rule {self.bn_rule}, "
                f"{str(next(self.model.parameters()).dtype).replace('torch.', '')}"
                + (f" under {self.precision_name} autocast" if self.autocast is not None else "")
                + (" with torch's GradScaler" if self.scaler is not None else "")
                + (f"; {self.compression.describe()}" if self.compression else ""))

    def advance_to(self, step: int) -> None:
        how = Replay(replicas=self.replicas, microbatches=self.microbatches, bn_rule=self.bn_rule,
                     compression=self.compression, seed=self.seed, clip=self.clip,
                     packing=self.packing, autocast=self.autocast, scaler=self.scaler, scales=self.scales,
                     run=self.run_scales, perturb=self.perturb, unit=self.unit, wire=self.wire)
        losses = reference_train(self.model, self.optimizer, lambda s, r: self.source.batch(s, rank=r), step, how,
                                 self.lr_for, first_step=self.step, norms=self.norms)
        self.losses.update(zip(range(self.step, step), losses))
        self.step = step

    def band(self, strategy, source, model_fn, optim_fn, lr_for) -> Band:
        """The noise band beside this reference (``check/band.py``): its three references, each this training
        changed once (built on first need), an fp16 run's following this one's loss scale and skips."""
        wire = strategy.gradient_wire
        return Band(lambda perturb, unit: Reference(strategy, source, model_fn, optim_fn, lr_for, self.seed,
                                                    self.precision_name, perturb, unit, wire, self.scales,
                                                    self.routes),
                    self.precision_name, next(self.model.parameters()).device, wire)

    def snapshot(self, copy: bool = False) -> kept.Snapshot:
        """The weights and optimizer state now: the live tensors (read before the reference trains on), or
        copies to keep."""
        weights = {k: v.detach().clone() if copy else v.detach() for k, v in self.model.state_dict().items()}
        return kept.Snapshot(self.step, weights, optimizer_state(self.model, self.optimizer, copy))


class Check:
    """``--check`` on this rank: call :meth:`after_step` after every step, :meth:`finish` at the end."""

    def __init__(self, cfg, strategy, source, model_fn, optim_fn, lr_for, comm, say, start: int, total: int,
                 run_dir=None):
        self.cfg, self.strategy, self.comm, self.say = cfg, strategy, comm, say
        #: where the ranks leave their saved states for rank 0 at a checked step (removed at the end)
        self.folder = Path(run_dir or ".") / ".check-states"
        self.model_fn, self.source = model_fn, source
        self.start, self.total = start, total
        self.steps = checked_steps(start, total, cfg.check_every)
        # fp64: fixed tolerances; below it, fp64's tolerances say "exact" and a band measured for this run says
        # what rounding may do (check/band.py), but for a layout the reference replays op for op: held to exact
        below = banded(cfg.precision, strategy.gradient_wire)
        self.held = held_exact(cfg, strategy, source, comm, start) if below else None
        self.banded = below and self.held is None
        self.tol = TOLERANCES["fp64" if below else cfg.precision]
        self.band: Band | None = None
        self.bands: dict[int, tuple[dict, dict]] = {}  # rank 0: step -> (each weight's band, each state's)
        self.end_bands: dict | None = None  # rank 0: the bands of the logits, every step's losses and norms
        self.found: list[Comparison] = []     # every comparison this rank made, each at its step
        self.kept: dict[int, kept.Snapshot] | None = None  # loaded from --check-cache: no training
        self.keeping: dict[int, kept.Snapshot] = {}        # what rank 0 keeps for later runs
        self.norms: dict[int, float] = {}  # the reference's gradient norms (--clip-grad), on every rank at the end
        # what this rank's steps reached (:meth:`saw`): choices the capacity dropped, whether a step routed tokens
        # (a mixture of experts) or was cut into microbatches of unequal sizes, and per share of the vocabulary this
        # rank's tp embedding holds, [tp rank, first id, last id, tokens of the steps in it]
        tp = tp_of(strategy)
        self.seen = {"dropped": 0, "routed": False, "uneven": False, "short": False, "overflowed": False,
                     "shares": [[tp.group.rank, a, b, 0] for a, b in tp.vocabulary_shares()] if tp else []}
        # a mixture of experts below fp64: every rank records its routers' choices, and rank 0's references
        # follow them at the near-ties the run's own scores explain (check/routing.py)
        # (a tp rank > 0 routes the same tokens as its tp rank 0, which sends them)
        self.recording = Recording(modules_held(strategy), sends=strategy.ctx.mesh.coords.get("tp", 0) == 0) \
            if self.banded and getattr(cfg, "experts", 0) else None
        if comm.rank != 0:  # the reference lives on rank 0 (see the module's docstring)
            self.ref, self.key = None, None
            return
        self.ref = Reference(strategy, source, model_fn, optim_fn, lr_for, cfg.seed, cfg.precision,
                             routes=Routes() if self.recording is not None else None)
        if self.ref.scaler is not None:
            self.ref.run_scales = {}
        self.key = kept.digest(cfg, self.ref, self.steps, strategy.gradient_wire, self.held is not None) \
            if kept.usable(cfg, self.ref) else None
        if self.key is not None:
            loaded, why = kept.load(cfg.check_cache, self.key, self.ref.model, self.steps, self.ref.replicas)
            if loaded is not None and (loaded["bands"] is not None) == self.banded:
                self.kept = loaded["snapshots"]
                self.ref.losses, self.ref.step = loaded["losses"], total
                if self.banded:  # and the bands that run measured
                    self.bands, self.end_bands = loaded["bands"]["tensors"], loaded["bands"]["end"]
                say(f"check: the single-process reference ({self.ref.describe()}) is the one an earlier run "
                    f"trained on the same weights and batches ({kept.path_for(cfg.check_cache, self.key).name})"
                    + (", and so is its noise band" if self.banded else ""))
        if self.kept is None:
            say(f"check: the single-process reference trains beside the run ({self.ref.describe()}); compared "
                f"after step{'s' if len(self.steps) > 1 else ''} {', '.join(map(str, self.steps))}")
            if self.banded:  # its references trained where a comparison is first beyond exact (or to be kept)
                self.band = self.ref.band(strategy, source, model_fn, optim_fn, lr_for)
                say(f"check: {cfg.precision}: where a comparison is beyond exact, {self.band.describe()}")
            elif self.held:
                say(f"check: {cfg.precision}: held to exact, no noise band: {self.held}")
        if self.ref.compression:
            say(f"check: {self.ref.compression.caveat()}")
        if self.recording is not None and start > 0:
            say(f"check: experts: the run resumed at step {start}, and its routers' choices before it were not "
                "recorded, so a near-tie rounding crossed there is not followed (docs/correctness.md)")
        if not self.ref.own_schedule and isinstance(lr_for, LRSchedule):  # a fractional cosine warm-up
            say(f"check: the reference takes the run's own learning-rate schedule (a cosine warm-up of "
                f"{lr_for.warmup_steps:g} steps, which torch's schedulers cannot express), so the schedule itself "
                "is not checked: a --warmup-epochs of a whole number of steps is")

    # ------------------------------------------------------------ at the checked steps
    def after_step(self, step: int) -> None:
        """After step ``step`` (counted from 1) of the loop: compare if it is a checked step but the last
        (:meth:`finish` compares the last). Collective; outside the step's timing."""
        if step in self.steps and step != self.total:
            self.compare_at(step)

    def saw(self, step: steps.Step, result) -> None:
        """A step the loop took (its value and the strategy's ``StepResult``): what it reached, for the paths
        the verdict says were not exercised."""
        self.seen["dropped"] += sum(layer["dropped"] for layer in result.moe or ())
        self.seen["routed"] |= bool(result.moe)
        m = self.strategy.microbatches
        self.seen["uneven"] |= m > 1 and step.x is not None and len(step.x) % m != 0
        self.seen["short"] |= 0 < step.rows < self.source.global_batch
        scale = self.strategy.ctx.loss_scale
        self.seen["overflowed"] |= scale is not None and bool(result.skipped)
        if scale is not None and self.ref is not None:  # fp16: the run's overflow decision, which the reference follows
            self.ref.run_scales[step.index] = (bool(result.skipped), scale.state_dict())
        if step.x is not None and not step.x.is_floating_point():  # tokens: how many fell in each share
            for share in self.seen["shares"]:
                share[3] += int(((step.x >= share[1]) & (step.x <= share[2])).sum())

    def reference_at(self, step: int) -> kept.Snapshot:
        if self.kept is not None:
            return self.kept[step]
        self.ref.advance_to(step)
        keep = self.key is not None and self.comm.rank == 0
        snap = self.ref.snapshot(copy=keep)
        if self.band is not None and keep:  # kept for later runs: every checked step's band
            self.bands_at(step)
        if keep:
            self.keeping[step] = snap
        return snap

    def bands_at(self, step: int) -> tuple[dict, dict]:
        """Rank 0, the reference standing at ``step``: each weight's band and each optimizer state's there,
        measured on first need (the band's references trained this far)."""
        if step not in self.bands:
            self.band.advance_to(step)
            snap = self.ref.snapshot()
            self.bands[step] = self.band.tensors(snap.weights, snap.optimizer)
        return self.bands[step]

    def compare_at(self, step: int) -> None:
        if self.recording is not None:  # the routers' choices so far, to rank 0's references (a collective)
            taken = self.comm.gather_objects(self.recording.take())
            if self.ref is not None:
                self.ref.routes.add(taken)
        ref = self.reference_at(step) if self.ref is not None else None  # rank 0
        whole = self.strategy.full_state_dict()
        self.found.append(self.weights_comparison(whole, ref, step))
        states = self.saved_states()
        if states is not None:  # rank 0
            self.found.append(self.optimizer_comparison(states, ref, step))
        if self.recording is not None and self.ref is not None:  # the routing every reference has passed
            self.ref.routes.forget_passed(self.ref, self.band)

    def weights_comparison(self, whole: dict, ref: kept.Snapshot | None, step: int) -> Comparison:
        """This rank's view of the weights against the reference's (a collective). Rank 0 compares its own;
        another rank whose view holds the same bits as rank 0's has the same deviation, which rank 0 sends; only
        where a view differs (a replica that drifted, a bug) is the reference's whole weights sent, and that
        rank compares its own with them."""
        mine = None
        if ref is not None:  # rank 0; below fp64 judged by the band where it is beyond exact
            mine = compare_tensors("weights", whole, ref.weights, self.tol["weights"], step)
            if self.banded and mine.word != "exact":
                mine = compare_tensors("weights", whole, ref.weights, self.tol["weights"], step, self.bands_at(step)[0])
        if self.comm.world == 1:
            return mine
        same = self.replicas_comparison(whole, step)
        if self.strategy.replicated:
            self.found.append(same)
        sent = self.comm.broadcast_object(vars(mine) if mine is not None else None)
        differ = self.comm.all_gather_objects(same.max_abs != 0.0)
        if not any(differ):
            return mine if mine is not None else Comparison(**sent)
        weights, bands = self.comm.broadcast_object(  # rare: a rank whose bits differ compares its own
            (ref.weights, self.bands_at(step)[0] if self.banded else None) if ref is not None else None)
        if mine is not None:
            return mine
        if differ[self.comm.rank]:
            return compare_tensors("weights", whole, weights, self.tol["weights"], step, bands)
        return Comparison(**sent)

    def saved_states(self) -> list[dict] | None:
        """Every rank's resumable state (``state_dict``, what its checkpoint holds), on rank 0; None elsewhere.
        Each other rank writes its own to a folder of the run's and rank 0 maps them back (``weights_only``,
        ``mmap``) beside its own, so no rank holds another's state in memory; where rank 0 cannot see the files
        (ranks on hosts that share no folder) they come over the wire instead."""
        state = self.strategy.state_dict()
        if self.comm.world == 1:
            return [state]
        path = self.folder / f"rank{self.comm.rank}.pt"
        if self.comm.rank != 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save(state, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
            del state
        self.comm.barrier(name="check_states_written")
        paths = [self.folder / f"rank{r}.pt" for r in range(1, self.comm.world)]
        shared = self.comm.broadcast_object(all(p.exists() for p in paths) if self.comm.rank == 0 else None)
        if not shared:
            return self.comm.gather_objects(self.strategy.state_dict())
        if self.comm.rank != 0:
            return None
        return [state] + [torch.load(p, map_location="cpu", weights_only=True, mmap=True) for p in paths]

    def replicas_comparison(self, whole: dict, step: int) -> Comparison:
        """This rank's view of the weights and buffers against rank 0's: bit-identical (a collective). Views
        whose names, shapes or dtypes differ from rank 0's are not compared bit by bit: infinitely far."""
        layouts = self.comm.all_gather_objects([[k, str(v.dtype), list(v.shape)] for k, v in whole.items()])
        if any(layout != layouts[0] for layout in layouts):
            far = layouts[self.comm.rank] != layouts[0]
            return Comparison("replicas", float("inf") if far else 0.0,
                              "other tensors than rank 0's" if far else "bit-identical to rank 0", 0.0, step)
        mine = [v.detach().contiguous().reshape(-1) for v in whole.values()]
        if not mine:
            return Comparison("replicas", 0.0, "bit-identical to rank 0", 0.0, step)
        if mine[0].device.type == "cpu":  # where hashing the model's bytes costs less than sending them (gloo)
            # every rank's SHA-256 of its bits first (a few bytes each): where all equal rank 0's, the copies are
            # bit-identical and nothing model-sized crosses; else rank 0's bits come over and say how far each is
            digest = hashlib.sha256()
            for t in mine:
                digest.update(t.view(torch.uint8).numpy())
            digests = self.comm.all_gather_objects(digest.hexdigest())
            if all(d == digests[0] for d in digests):
                return Comparison("replicas", 0.0, "bit-identical to rank 0", 0.0, step)
        root = torch.cat([t.view(torch.uint8) for t in mine])  # the weights' bits, whatever their dtypes
        self.comm.broadcast(root, 0, name="check_replicas")
        return Comparison("replicas", bits_deviation(mine, root), "bit-identical to rank 0", 0.0, step)

    def optimizer_comparison(self, states: list[dict], ref: kept.Snapshot, step: int) -> Comparison:
        """Every rank's saved state, put together by the strategy's own ``portable``, against the reference.
        ``portable`` takes the model for its structure (names, shapes, units, a tp twin's slices it loads the
        states into), never its fresh weights, so it is built :func:`structure_only` and given memory unfilled: no
        weights drawn (at 134M parameters a real build took about 1.8 s at every checked step)."""
        try:
            with structure_only():
                model = self.model_fn()
            model = model.to_empty(device="cpu")
            mine = type(self.strategy).portable(states, model).optimizer
        except Exception as exc:  # noqa: BLE001 - a state that cannot be put together is a failed comparison
            return Comparison("optimizer", float("inf"), f"the ranks' states could not be put together "
                              f"({type(exc).__name__}: {exc})", self.tol["optimizer"], step)
        c = compare_optimizer(mine, ref.optimizer, self.tol["optimizer"], step)
        if self.banded and c.word != "exact":
            c = compare_optimizer(mine, ref.optimizer, self.tol["optimizer"], step, self.bands_at(step)[1])
        return c

    # ------------------------------------------------------------ at the end
    def finish(self, losses: list, replica: int, norms: list | None = None) -> dict:
        """Compare the last step, the next batch's logits, this rank's losses (``[step, loss]`` pairs;
        ``replica``: its data-parallel shard) and gradient norms (``[step, norm]``, ``--clip-grad``); agree on
        one verdict over the ranks (a collective)."""
        self.compare_at(self.total)
        x, _ = self.source.batch(self.total)
        packed = bool(self.source.documents and self.source.packing)  # packed documents: each row's attention mask
        with steps.entered(steps.whole(x, packed)):
            out = self.strategy.predict(to_device(x, self.strategy.ctx.device, self.strategy.ctx.dtype))
        expected = None
        if self.ref is not None:  # rank 0: the reference's logits for every shard, its losses and norms, sent
            expected = {"logits": self.logits(self.ref, packed), "losses": self.ref.losses, "norms": self.ref.norms}
        sent = self.comm.broadcast_object(expected)
        self.norms = sent["norms"]
        ends = self.end_comparisons(out, losses, norms, replica, sent)
        # below fp64, where any rank's is beyond exact (or the band is kept), each judged by its band: rank 0's
        if self.banded and any(self.comm.all_gather_objects(any(c.word != "exact" for c in ends) or
                                                            bool(self.keeping))):
            bands = self.comm.broadcast_object(self.end_bands_now(packed, expected) if self.ref is not None
                                               else None)
            ends = self.end_comparisons(out, losses, norms, replica, sent, bands)
        self.found += ends
        if self.comm.world > 1:  # every rank is done with the saved states: each removes its own
            self.comm.barrier(name="check_states_read")
            (self.folder / f"rank{self.comm.rank}.pt").unlink(missing_ok=True)
            self.comm.barrier(name="check_states_removed")
            if self.comm.rank == 0 and self.folder.is_dir():
                self.folder.rmdir()
        if self.keeping and self.comm.rank == 0:
            why = kept.keep(self.cfg.check_cache, self.key, self.keeping, self.ref.losses,
                            {"tensors": self.bands, "end": self.end_bands} if self.banded else None)
            if why:
                self.say(f"check: --check-cache: the reference is {why}")
        return self.verdict()

    def end_comparisons(self, out, losses: list, norms: list | None, replica: int, sent: dict,
                        bands: dict | None = None) -> list[Comparison]:
        """This rank's logits, reported losses and gradient norms against the reference's (``sent``); below
        fp64 with ``bands`` (rank 0's :meth:`end_bands_now`)."""
        found = []
        if out is not None:
            found.append(compare_tensors("outputs", {"logits": out.cpu()}, {"logits": sent["logits"][replica]},
                                         self.tol["outputs"], self.total,
                                         {"logits": bands["logits"][replica]} if bands else None))
        mine = [(s, v) for s, v in losses if s >= self.start and v is not None]
        if mine:
            found.append(compare_losses(mine, sent["losses"], replica, self.tol["loss"],
                                        {s: b[replica] for s, b in bands["losses"].items()} if bands else None))
        mine = [(s, v) for s, v in norms or () if s >= self.start and v is not None and s in self.norms]
        if mine:
            found.append(compare_norms(mine, self.norms, self.tol["grad_norm"], bands["norms"] if bands else None))
        return found

    def end_bands_now(self, packed: bool, expected: dict) -> dict:
        """Rank 0 at the end: the band of the logits of every shard, of every step's loss per shard and of every
        step's gradient norm (the band's references trained to the last step, or as a kept run measured them)."""
        if self.end_bands is None:
            band = self.band
            band.advance_to(self.total)
            theirs = [self.logits(ref, packed) for ref in band.refs]
            self.end_bands = {
                "logits": {r: band.of(t, [o[r] for o in theirs]) for r, t in expected["logits"].items()},
                "losses": {s: [band.of(v, [ref.losses[s][i] for ref in band.refs]) for i, v in enumerate(row)]
                           for s, row in self.ref.losses.items()},
                "norms": {s: band.of(v, [ref.norms[s] for ref in band.refs]) for s, v in self.ref.norms.items()}}
        return self.end_bands

    def logits(self, ref: Reference, packed: bool) -> dict[int, torch.Tensor]:
        """A reference's logits for every shard of the batch after the last step, as the run predicts them (in
        eval mode, under the run's autocast, in its dtype)."""
        ref.model.eval()
        device = next(ref.model.parameters()).device
        dtype = next(ref.model.parameters()).dtype
        expected = {}
        for r in range(ref.replicas):
            xr, _ = self.source.batch(self.total, rank=r)
            with torch.no_grad(), steps.entered(steps.whole(xr, packed)), \
                    torch.autocast(device.type, dtype=ref.autocast, enabled=ref.autocast is not None):
                expected[r] = ref.model(to_device(xr, xr.device, dtype)).to(dtype)
        return expected

    def verdict(self) -> dict:
        by_kind = {k: worst([c for c in self.found if c.what == k]) for k in KINDS
                   if any(c.what == k for c in self.found)}
        history: dict[int, dict] = {}  # per checked step: the weights' largest deviation; below fp64 the worst
        for c in self.found:           # ratio to the band of the weights' and the optimizer state's
            if c.what in ("weights", "optimizer") and c.step is not None:
                h = history.setdefault(c.step, {})
                if c.what == "weights":
                    h["max_weight_dev"] = max(h.get("max_weight_dev", 0.0), c.max_abs)
                if c.ratio is not None:
                    h[f"{c.what}_ratio"] = max(h.get(f"{c.what}_ratio", 0.0), c.ratio)
        ratios = [c.ratio for c in self.found if c.ratio is not None]
        mine = {"rank": self.comm.rank, "passed": all(c.ok for c in self.found),
                "verdict": word_of([c.word for c in self.found]), "worst_ratio": max(ratios) if ratios else None,
                "lines": [c.line() for c in by_kind.values()], "failed": [k for k, c in by_kind.items() if not c.ok],
                "worst_weight": by_kind["weights"].worst,
                "max": {k: max(c.max_abs for c in self.found if c.what == k) for k in by_kind},
                "history": sorted(history.items()),
                "unexercised": unexercised(self.cfg, self.strategy, self.start, self.total) + self.unclipped(),
                "seen": self.seen, "followed": self.followed(), "experts": self.experts_followed()}
        verdicts = self.comm.all_gather_objects(mine)
        for v in verdicts:
            self.say(f"check rank {v['rank']}: {'PASS' if v['passed'] else 'FAIL'}  " + "; ".join(v["lines"]))
        passed = all(v["passed"] for v in verdicts)
        word = word_of([v["verdict"] for v in verdicts])
        followed = [why for v in verdicts for why in v["followed"]]
        for why in followed:
            self.say(f"check: fp16: {why}")
        too_many = overflowed_too_often(followed)
        if too_many:
            passed, word = False, "bug"
            self.say(f"check: fp16: {too_many}")
        experts = verdicts[0]["experts"]  # rank 0's references: the run's near-ties followed (and any not)
        for line in experts:
            self.say(f"check: {line}")
        ratios = [v["worst_ratio"] for v in verdicts if v["worst_ratio"] is not None]
        worst_ratio = max(ratios) if ratios else None
        band = f", worst {worst_ratio:.3g} of the band" if word != "exact" and worst_ratio is not None else ""
        self.say(f"check: {'PASS' if passed else 'FAIL'} ({word}{band})")
        notes = list(dict.fromkeys([n for v in verdicts for n in v["unexercised"]] + self.unreached(verdicts)))
        for note in notes:
            self.say(f"check: not exercised: {note}")
        self.explain(verdicts)
        largest = {k: max((v["max"][k] for v in verdicts if k in v["max"]), default=None) for k in KINDS}
        by_step: dict[int, dict] = {}
        for v in verdicts:
            for step, h in v["history"]:
                mine = by_step.setdefault(step, {"step": step})
                for k, x in h.items():
                    mine[k] = max(mine.get(k, 0.0), x)
        return {"passed": passed, "result": "PASS" if passed else "FAIL", "precision": self.cfg.precision,
                "verdict": word, "worst_ratio": worst_ratio,
                "tolerances": self.tol, "steps": self.steps,
                "failed": sorted({k for v in verdicts for k in v["failed"]}, key=KINDS.index),
                "max_weight_dev": largest["weights"], "max_optimizer_dev": largest["optimizer"],
                "max_loss_dev": largest["loss"], "max_grad_norm_dev": largest["grad_norm"],
                "max_output_dev": largest["outputs"],
                "history": [by_step[s] for s in sorted(by_step)],
                "unexercised": notes, "ranks": verdicts} | ({"held_exact": self.held} if self.held else {}) \
            | ({"loss_scale_followed": followed} if followed else {}) \
            | ({"experts_followed": experts} if experts else {})

    def followed(self) -> list[str]:
        """fp16, rank 0: the steps whose overflow the reference decided otherwise than the run (each said by
        ``reference._scaler_step``); [] elsewhere or where the reference came from --check-cache."""
        scales = self.ref.scales if self.ref is not None and self.kept is None else None
        return [step[2] for _, step in sorted((scales or {}).items()) if len(step) > 2 and step[2]]

    def experts_followed(self) -> list[str]:
        """A mixture of experts below fp64, rank 0: the line saying at which tokens the reference took the run's
        choice of experts (and one for any it did not); [] elsewhere (``check/routing.py``)."""
        following = getattr(self.ref, "following", None)
        if following is None:
            return []
        return [line for line in (followed_line(following.followed), not_followed_line(following.not_followed))
                if line]

    def unreached(self, verdicts: list[dict]) -> list[str]:
        """Paths that depend on the data, over every rank's steps (:meth:`saw`): a capacity that dropped nothing,
        microbatches that were all of one size, a tp rank's share of the vocabulary no token fell in (tp rank 1 of 2
        holds bytes 128-255, which ASCII text never has)."""
        notes = []
        seen = [v["seen"] for v in verdicts]
        factor = getattr(self.cfg, "capacity_factor", None)
        if factor is not None and any(s["routed"] for s in seen) and not any(s["dropped"] for s in seen):
            notes.append(f"--capacity-factor {factor:g} dropped no token's choice, so what a drop does (the choice's "
                         "expert output left out, the capacity's order of first and second choices) is not "
                         "exercised: a smaller --capacity-factor (e.g. 0.5)")
        m = self.strategy.microbatches
        if m > 1 and not self.strategy.equal_microbatches and not any(s["uneven"] for s in seen):
            notes.append(f"every step's {m} microbatches held equally many samples, so microbatches of unequal "
                         "sizes (each weighted by its share of the samples) are not exercised: a --batch-size whose "
                         f"shards {m} does not divide")
        if not any(s["short"] for s in seen):
            notes += short_batch_note(self.source, self.total)
        scale = self.strategy.ctx.loss_scale
        if scale is not None and not any(s["overflowed"] for s in seen):
            notes.append(f"fp16: no step's gradient overflowed (the loss scale is {scale.scale:g} now), so an overflow "
                         "(every rank skipping the update, the scale halved, the reference alike) is not exercised: "
                         f"a larger --initial-loss-scale (e.g. {2 ** 24})")
        for rank, first, last, tokens in (share for s in seen for share in s["shares"]):
            if tokens == 0:
                notes.append(f"tp: no token of this run fell in tp rank {rank}'s share of the vocabulary (ids "
                             f"{first}-{last}), so the vocabulary-parallel embedding and loss past the first share "
                             "are not exercised: a text with such bytes (--dataset jargon, whose UTF-8 reaches 255)")
        return notes

    def unclipped(self) -> list[str]:
        """``--clip-grad`` that never clipped (every norm of the checked steps at or below it): the norm was
        compared, but what the clip does to the gradients was not exercised."""
        clip, norms = self.cfg.clip_grad, self.norms
        if not clip or not norms or max(norms.values()) > clip:
            return []
        return [f"--clip-grad {clip:g} never clipped (the largest norm was {max(norms.values()):.4g}), so the "
                f"scaling of the gradients is not exercised: --clip-grad {max(norms.values()) / 10:.2g}"]

    def explain(self, verdicts: list[dict]) -> None:
        """Adam + BatchNorm: explain a failure only when the weights alone failed, on every rank that
        failed, at a bias that BatchNorm cancels (a wrong output or replica is a real bug, never explained
        away). Adam's moments of such a bias are noise too: an optimizer failure there is explained alike."""
        failing = [v for v in verdicts if not v["passed"]]
        if not failing or self.cfg.optimizer not in ADAMS or self.ref is None:  # rank 0 says it
            return
        cancelled = cancelled_by_batchnorm(self.ref.model)
        if all(set(v["failed"]) <= {"weights", "optimizer"} and v["worst_weight"] in cancelled for v in failing):
            self.say(f"check: hint: {failing[0]['worst_weight']} feeds a BatchNorm, which subtracts it again, so its "
                     "gradient is zero but for rounding noise, and Adam scales that noise up to steps of about --lr; "
                     "the two runs' noise differs. Check Adam runs with --norm none (the outputs comparison above is "
                     "the meaningful one here)")


def _compare_numbers(what: str, mine: list, ref: dict, atol: float, bands: dict | None, says) -> Comparison:
    """This rank's number at each of its steps (``[step, value]`` pairs) against the reference's (``ref[step]``);
    ``bands`` (below fp64): each step's band. The step that decides is the one furthest out (by its band, where
    there is one); ``says(value, reference)`` words it."""
    largest, at, rank_at = 0.0, None, -1.0
    mine = [(step, value) for step, value in mine if value is not None and step in ref]  # fp16: a skipped step's
    #                                                                                       norm is none, on both
    if not mine:
        return Comparison(what, 0.0, "no step to compare (each skipped)", atol)
    for step, value in mine:
        dev = abs(value - ref[step])
        dev = float("inf") if dev != dev else dev
        largest = max(largest, dev)
        rank_by = ratio_of(dev, bands[step]) if bands is not None else dev
        if at is None or rank_by > rank_at:
            at, rank_at = step, rank_by
    where = says(dict(mine)[at], ref[at])
    if bands is None:
        return Comparison(what, largest, where, atol, at + 1)
    return Comparison(what, largest, where, atol, at + 1, bands[at], rank_at)


def compare_losses(mine: list, ref: dict[int, list[float]], replica: int, atol: float,
                   bands: dict[int, float] | None = None) -> Comparison:
    """This rank's reported loss at each of its steps against its shard's loss in the reference."""
    return _compare_numbers("loss", mine, {s: v[replica] for s, v in ref.items()}, atol, bands,
                            lambda v, r: f"reported {v:.6g} vs {r:.6g}")


def compare_norms(mine: list, ref: dict[int, float], atol: float, bands: dict[int, float] | None = None
                  ) -> Comparison:
    """This rank's whole-model gradient norm at each of its steps (``--clip-grad``) against the reference's."""
    return _compare_numbers("grad_norm", mine, ref, atol, bands, lambda v, r: f"gradient norm {v:.6g} vs {r:.6g}")
