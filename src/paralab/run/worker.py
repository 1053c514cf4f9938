"""One rank's life: process group, data, model, strategy, training loop, evaluation, records.

:func:`train` reads top to bottom as a rank's run: :func:`set_up` builds the
data, the mesh and the strategy; :func:`resume_or_save_init` finds where to
start; the loop (``loop.py``: the same for every strategy) takes the steps,
with what else happens at a step (the records, the log, ``--check``,
checkpoints, injected faults) hooked in as its listeners; then the rank
evaluates, finishes ``--check``, and rank 0 gathers every rank's records and
writes the run directory.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import time
from dataclasses import astuple, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint, hangs, loop, records
from .faults import Faults
from .. import oplog
from ..comm import Comm
from .config import RunConfig, replay_too_large, slow_fp16
from .failures import GroupNotFormed, group_not_formed
from .rendezvous import bound_store, on_gpu
from ..data import BatchSource, load_dataset, to_device
from ..training.evaluate import evaluate, headline
from ..models import build_model, count_parameters, model_shape, structure_only
from ..progress import Progress
from ..recorder import Recorder
from ..training import recompute
from ..training.lr_schedule import LRSchedule, set_lr
from ..mesh import Mesh
from ..strategies import plan
from ..strategies.base import Context
from ..training.loss_scale import LossScale
from ..strategies.tensor.strategy import tp_of


def pick_device(cfg: RunConfig, local_rank: int) -> torch.device:
    if on_gpu(cfg):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer_factory(cfg: RunConfig, created: list | None = None):
    """A factory strategies call on the parameters they own (``how``: settings of the torch optimizer's
    implementation, e.g. ``foreach=False``, never of its arithmetic); ``created`` collects the
    optimizers so the loop can drive the learning-rate schedule of all of them."""
    def make(params, **how):
        if cfg.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **how)
        elif cfg.optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **how)
        else:
            opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **how)
        if created is not None:
            created.append(opt)
        return opt
    return make


def build_model_factory(cfg: RunConfig, num_classes: int, built: list | None = None):
    """The seeded model factory; ``built`` collects the models it makes (the first divergence names their
    modules)."""
    def make():
        torch.manual_seed(cfg.seed)  # every rank and the reference start from the same weights
        model = build_model(cfg.model, width=cfg.width, norm=cfg.norm, num_classes=num_classes, **model_shape(cfg))
        model = model.double() if cfg.precision == "fp64" else model
        if built is not None:
            built.append(model)
        return model
    return make


def make_lr_for(cfg: RunConfig, global_batch: int, steps_per_epoch: int, total_steps: int) -> LRSchedule:
    return LRSchedule(cfg.lr, cfg.lr_scaling, global_batch, cfg.warmup_epochs, steps_per_epoch, cfg.lr_schedule,
                    cfg.min_lr, total_steps)


def init_group(cfg: RunConfig, rank: int, world: int, device: torch.device, init_method: str | None):
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    kwargs = dict(backend=backend, timeout=timedelta(seconds=cfg.timeout))
    try:
        if init_method is None:  # torchrun: its store, under a prefix of this start of the group
            dist.init_process_group(store=torchrun_store(rank, world, cfg.timeout), rank=rank, world_size=world,
                                    **kwargs)
        elif init_method.startswith("tcp://"):  # rank 0 serves the store on that address alone, not every interface
            store = bound_store(init_method, rank, world, cfg.timeout)
            dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
        else:  # a file store (tests' in-process ranks): nothing listens
            dist.init_process_group(init_method=init_method, rank=rank, world_size=world, **kwargs)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:  # a rank never came, or rank 0 cannot be reached
        where = (f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}" if init_method is None
                 else init_method.removeprefix("tcp://"))
        raise group_not_formed(rank, world, where, cfg.timeout, exc) from None
    return backend


def torchrun_store(rank: int, world: int, timeout: float):
    """torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT: its agent's, or rank 0's), with this start's
    keys under ``/paralab/attempt_<TORCHELASTIC_RESTART_COUNT>``. ``env://`` would use the bare store,
    where torch 2.13 keeps the keys of a start torchrun has ended: a restarted rank then read a dead
    peer's address from them and failed to connect in about half the restarts (a 2-rank gloo script
    reproduces it; pytorch/pytorch#167288 reports the same with NCCL)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 serves the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"/paralab/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def run_worker(cfg: RunConfig, rank: int, world: int, local_rank: int, init_method: str | None,
               run_dir: str, reached: loop.Reached | None = None) -> None:
    """Entry point of every rank (local spawn, manual --rank, or torchrun).

    With several ranks, each keeps its op log in ``RUN/oplog/`` (``oplog.py``) while it runs, for
    ``hangs.py`` to read if the run hangs; a run that ends in order removes it. ``reached``: told how many
    steps this rank has done (what the launcher reports if it fails).
    """
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    if world > 1:
        oplog.open_log(hangs.log_path(run_dir, rank), rank, world)
    device = pick_device(cfg, local_rank)
    try:
        backend = init_group(cfg, rank, world, device, init_method)
    except GroupNotFormed:  # nothing ran: leave nothing behind
        hangs.remove_log(run_dir, created)
        raise
    try:
        train(cfg, rank, world, device, backend, run_dir, reached)
    except SystemExit:  # an orderly exit every rank takes together
        hangs.remove_log(run_dir, created)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hangs.remove_log(run_dir, created)


@dataclass
class Setup:
    """Everything one rank builds before its first step (see :func:`set_up`)."""
    recorder: Recorder
    comm: Comm
    mesh: Mesh
    data: object            # the dataset (train and test splits, classes)
    source: BatchSource     # this rank's data-parallel shard of every global batch
    strategy: object        # the strategy, on this rank
    model_fn: object        # the seeded model factory (the reference builds its model from it)
    roots: list             # a replay's: the models the strategy built from it (their modules, named)
    optimizers: list        # every optimizer the strategy made, for the learning-rate schedule
    lr_for: LRSchedule      # step -> learning rate
    dtype: torch.dtype       # the run's float type (inputs are cast to it)
    global_batch: int
    total_steps: int
    parameters: int
    run_dir: Path


def train(cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str, run_dir: Path,
          reached: loop.Reached | None = None):
    """One rank's training, in the order it happens: set up, resume, the loop, evaluate, check, write."""
    s = set_up(cfg, rank, world, device, backend, run_dir)
    main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
    start, losses = resume_or_save_init(cfg, rank, s, say)  # losses: [step, loss] of the steps before
    # which start of the group this is (1: the first), ours (--max-restarts) or torchrun's
    attempt = len(cfg.restarts or []) + 1 + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    carried: tuple[list, list] = ([], [])  # a run started again from its own checkpoint: its earlier records
    if cfg.resume and Path(cfg.resume).resolve() == Path(s.run_dir).resolve() or attempt > 1:
        carried = records.carried(s.run_dir, rank, start)
    covered = {r["step"] for r in carried[0]}
    earlier = [pair for pair in losses if pair[0] not in covered]  # the rest: summary's losses_before_resume
    kept = loop.Kept(rank, s.recorder, max([attempt] + [r["attempt"] + 1 for r in carried[0]]), losses, s.run_dir)

    progress = Progress(s.total_steps, "train", enabled=main and cfg.progress, start=start)
    check = None  # --check: the single-process reference beside the run, compared at the checked steps
    if cfg.check:
        from ..check.verdict import Check
        check = Check(cfg, s.strategy, s.source, s.model_fn, build_optimizer_factory(cfg), s.lr_for, s.comm, say,
                      start=start, total=s.total_steps, run_dir=s.run_dir)
    faults = Faults(rank, attempt, s.total_steps)  # PARALAB_FAULT (testing restarts)
    first = loop.FirstStep(start, s.strategy, s.optimizers)
    listeners = [reached or loop.Reached(), kept, first, loop.Logged(cfg, s.comm, progress, say, s.total_steps),
                 *([loop.Checked(check)] if check else []),
                 loop.Checkpoints(cfg, s.run_dir, rank, s.strategy, s.comm, kept, start, s.total_steps, progress,
                                  saving=lambda done: faults.at("save", done)),
                 faults]
    error = loop.run_steps(s, start, listeners, cfg.seed, device, progress)

    s.recorder.step = -1
    evaluation = verdict = None
    if error is None:
        evaluation = evaluate(s.strategy, s.source, s.data.classes, s.comm, cfg.eval_batch_size, cfg.eval_batches,
                              device, progress=main and cfg.progress)
        if main and evaluation is not None:
            say(headline(evaluation))
        if check is not None:
            verdict = check.finish(kept.losses, s.strategy.replicas()[1], kept.norms)
            if cfg.first_divergence and (not verdict["passed"] or cfg.replay):
                check = listeners = None  # the check's references freed before the replay trains its own
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                # declined on every rank where any rank's memory is short (each sees its own free memory)
                too_large = next((why for why in s.comm.all_gather_objects(
                    replay_too_large(cfg, s.parameters, s.strategy.gradient_wire)) if why), None)
                verdict["first_divergence"] = first_divergence(cfg, rank, world, device, backend, s.run_dir, say,
                                                               resumed=start > 0, too_large=too_large)
    try:
        records.write_run(s.run_dir, cfg, s.comm, s.recorder, kept.rows, s.strategy, earlier=earlier,
                          parameters=s.parameters, world=world, backend=backend, device=device, dataset=s.data,
                          evaluation=evaluation, check=verdict, error=error, global_batch=s.global_batch,
                          is_main=main, held=first.record, carried=carried,
                          midway=lambda: faults.at("records", s.total_steps))
    except records.RecordsNotWritten as exc:  # every rank alike: exit 4, one line
        if main:
            print(f"paralab: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(4) from None
    faults.at("done", s.total_steps)
    if main:
        untimed = s.strategy.extra_summary().get("untimed_collectives")
        if untimed:  # a user's file called torch.distributed itself (strategies/user.py counts those calls)
            say(untimed_line(untimed))
        say(f"records written to {s.run_dir}")
    if error is not None:  # 4: a checkpoint could not be written; 3: the loss diverged
        raise SystemExit(4 if error.startswith(loop.CHECKPOINT_FAILED) else 3)
    if verdict is not None and not verdict["passed"]:
        raise SystemExit(1)


def untimed_line(untimed: dict) -> str:
    calls = ", ".join(f"{op} x{n}" for op, n in untimed.items())
    return (f"paralab: the strategy's file called torch.distributed itself ({calls} on rank 0): paralab times "
            "only self.comm's collectives, so the time split counts these as other (as computation where a "
            "gradient hook calls them inside backward) and the timelines do not draw them (docs/own-strategy.md)")


def first_divergence(cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str, run_dir: Path,
                     say, resumed: bool = False, too_large: str | None = None) -> str:
    """After a failed ``--check``: the run built again and replayed from its first step beside a fresh
    reference until a module's output, a gradient or a weight first differs (``check/diverge.py``); that
    place as one line, said and returned. Collective."""
    from ..check import diverge
    from ..check.band import held_exact
    from ..check.reference import banded
    from ..check.routing import Recording, Routes
    from ..check.verdict import Reference
    why = "the run resumed from a checkpoint: replay it from the start" if resumed else too_large
    if why:
        line = f"first divergence: not looked for ({why})"
        say(f"check: {line}")
        return line
    s = set_up(cfg, rank, world, device, backend, run_dir, replay=True)
    replicas, replica = s.strategy.replicas()
    model_fn, optim_fn = build_model_factory(cfg, len(s.data.classes)), build_optimizer_factory(cfg)
    # below fp64 (or a lossy wire) judged by noise bands, but for a layout held to exact (check/band.py)
    below = banded(cfg.precision, s.strategy.gradient_wire)
    held = held_exact(cfg, s.strategy, s.source, s.comm) if below else None
    # a mixture of experts below fp64: the references follow the run's near-ties as the check's do (routing.py)
    routing = (Recording(s.roots, sends=s.mesh.coords.get("tp", 0) == 0), Routes()) \
        if below and not held and cfg.experts else None
    ref = Reference(s.strategy, s.source, model_fn, optim_fn, s.lr_for, cfg.seed, cfg.precision,
                    routes=routing[1] if routing else None)
    if ref.scaler is not None:  # fp16: it follows the run's overflow decisions (diverge.locate)
        ref.run_scales = {}
    # each compared quantity judged by its own noise band (check/band.py), or by fp64's tolerances
    band = ref.band(s.strategy, s.source, model_fn, optim_fn, s.lr_for) if below and not held else None
    judge = diverge.Judge("fp64" if below else cfg.precision, band)
    tp = tp_of(s.strategy)  # the modules tp built in a unit's place are hooked too, under the unit's name
    roots = s.roots + ([tp.modules()] if tp is not None else [])
    progress = Progress(s.total_steps, "first divergence", enabled=rank == 0 and cfg.progress)
    found = None
    for step in range(s.total_steps):
        set_lr(s.optimizers, s.lr_for(step))
        x, y = s.source.batch(step)
        x, y = to_device(x, device, s.dtype), y.to(device)
        mine = diverge.locate(step, x, y, s.strategy, roots, s.optimizers, ref, s.mesh, replica, judge, routing)
        if routing is not None:  # the routing every reference has passed
            routing[1].forget_passed(ref, band)
        every = [diverge.Finding(*f) for f in s.comm.all_gather_objects(astuple(mine) if mine else None) if f]
        progress.update(step + 1)
        if every:
            found = min(every)
            break
    progress.close()
    worst = max(s.comm.all_gather_objects(judge.worst))  # below fp64: the largest deviation over its band
    agreed = f"agreed within its band, the worst at {worst:.3g} of it" if worst else "agreed"
    line = found.line() if found else (f"first divergence: none in {s.total_steps} replayed steps (every module's "
                                       f"output, the loss, every gradient and weight {agreed}: what failed lies "
                                       "outside the steps, e.g. the state a checkpoint saves)")
    if ref.following is not None:  # rank 0's reference (every rank's replays every shard alike)
        followed, other = (sum(f[2] for f in said) for said in (ref.following.followed, ref.following.not_followed))
        if followed:
            line += f"; the reference took the run's choice of experts at {followed} near-tie token(s) (routing.py)"
        if other:
            line += f"; {other} token(s) the run routed otherwise were no near-tie, not followed (routing.py)"
    say(f"check: {line}")
    return line


def set_up(cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str, run_dir: Path,
           replay: bool = False) -> Setup:
    """The recorder and world communicator, a common time origin, the data, the mesh and its groups,
    the strategy (which builds and places the model), this rank's batches, the step count. ``replay`` (the
    first divergence's): said nothing, and the models the strategy built are kept whole (``Setup.roots``:
    their modules' names; a run keeps none, so a pipeline's stage holds only its own part)."""
    recorder = Recorder(rank, device)
    comm = Comm(recorder, rank, world)
    if world > 1:
        if cfg.out is None:
            # without --out, each process (torchrun, --rank) named its own default
            # directory from the clock; rank 0's name wins so they agree
            run_dir = Path(comm.broadcast_object(str(run_dir)))
        dist.barrier()  # a common time origin, so the ranks' timelines line up
        recorder.origin = time.perf_counter()

    data = load_dataset(cfg.dataset, Path(cfg.data_dir) if cfg.data_dir else None,
                        synthetic_size=cfg.synthetic_size, seed=cfg.seed, model=cfg.model, context=cfg.context,
                        packing=cfg.packing, doc_length=cfg.doc_length)
    shape, strategy_cls, composition = plan(cfg, world)
    # every group of the mesh waits --timeout at most, as the world does (new_group's own default is 30 min)
    new_group = functools.partial(dist.new_group, timeout=timedelta(seconds=cfg.timeout)) if world > 1 else None
    mesh = Mesh(shape, rank, comm, new_group=new_group)
    roots: list = []
    model_fn = build_model_factory(cfg, len(data.classes), built=roots if replay else None)
    optimizers: list = []
    optim_fn = build_optimizer_factory(cfg, optimizers)
    ctx = Context(rank, world, device, comm, recorder, cfg.precision, cfg.strategy_options(), mesh,
                  batch_size=cfg.global_batch(), clip_grad=cfg.clip_grad, on_nonfinite=cfg.on_nonfinite,
                  loss_scale=LossScale(cfg.initial_loss_scale) if cfg.precision == "fp16" else None)
    # the strategy's units recompute as --recompute says; the reference (model_fn) does not
    strategy = strategy_cls(ctx, recompute.factory(model_fn, cfg.recompute), optim_fn, **composition)
    replicas, replica = strategy.replicas()
    global_batch = cfg.global_batch()
    source = BatchSource(data, per_rank_batch=global_batch // replicas, replicas=replicas,
                         rank=replica, seed=cfg.seed, augment=cfg.augment, drop_last=cfg.drop_last)
    total_steps = cfg.num_batches or cfg.epochs * source.steps_per_epoch
    with structure_only():  # the count, not the weights
        parameters = count_parameters(build_model_factory(cfg, len(data.classes))())
    if rank == 0 and not replay:
        print(f"paralab: {cfg.strategy} on {world} worker(s), {backend}, {device.type}; {cfg.model} "
              f"(width {cfg.width}, norm {cfg.norm}, {parameters:,} parameters); {data.describe()}; "
              f"global batch {global_batch}, {total_steps} steps", flush=True)
        print(f"paralab: {mesh.shape.describe()}" + (f"; {composed(cfg, shape, composition)}" if composition else ""),
              flush=True)
        slow = slow_fp16(cfg, device)
        if slow:
            print(f"paralab: note: {slow}", flush=True)
    lr_for = make_lr_for(cfg, global_batch, source.steps_per_epoch, total_steps)
    return Setup(recorder, comm, mesh, data, source, strategy, model_fn, roots, optimizers, lr_for, ctx.dtype,
                 global_batch, total_steps, parameters, run_dir)


def composed(cfg: RunConfig, shape, composition: dict | None = None) -> str:
    """What wraps what in a composed run, for the start-up line."""
    from ..strategies import get_strategy
    if (composition or {}).get("inner_cls") is get_strategy(cfg.strategy):  # the strategy on its tp slices
        return f"{cfg.strategy} over each rank's tp slice of the units"
    what = f"the {'tp-sharded ' if shape.tp > 1 else ''}model" if shape.pp == 1 else \
        f"each of the {shape.pp} {'tp-sharded ' if shape.tp > 1 else ''}stages"
    twice = " twice: over dp, and for its experts (split over ep) over edp" if shape.ep > 1 else ""
    out = f"{what} wrapped in {cfg.strategy}'s data-parallel flavour{twice}"
    if shape.cp > 1:  # context parallelism (strategies/context/)
        out += (f", over dp x cp; each sample's sequence split over cp {shape.cp} "
                f"({cfg.cp_method} attention, {'balanced' if cfg.cp_balance else 'contiguous'} chunks)")
    return out


def resume_or_save_init(cfg: RunConfig, rank: int, s: Setup, say) -> tuple[int, list]:
    """The step to start from and this rank's [step, loss] pairs before it: a checkpoint's with --resume
    (its state loaded; under torchrun, a restarted group's own last checkpoint), else 0 and none (the
    starting weights saved with --save-init). Says what the data order does where batches are uneven."""
    start_step, losses = 0, []
    resume = cfg.resume or restarted_from(cfg, rank, s)
    # the generation to start from, agreed by every rank: the newest each of them can read (each picking the
    # newest for itself could start them from different steps, were one committed meanwhile)
    at = None
    if resume:
        usable = [set(steps) for steps in s.comm.all_gather_objects(checkpoint.usable_steps(Path(resume), cfg, rank))]
        at = max(set.intersection(*usable), default=None)
        if at is None:  # (every rank: the same gathered sets)
            raise RuntimeError(f"--resume: {resume} holds no committed checkpoint that every rank can read")
    if resume and checkpoint.another_layout(Path(resume), cfg, rank, at=at):  # resharded: every old rank's file
        portable, start_step, losses, saved = checkpoint.read_portable(Path(resume), cfg, s.model_fn(), at=at)
        s.strategy.load_portable(portable)
        scale = portable.loss_scale
        say(f"paralab: the checkpoint is {checkpoint.describe(saved)}; this run is "
            f"{checkpoint.describe(checkpoint.identity(cfg))}: resharded")
        for note in portable.notes:
            say(f"paralab: resharding: {note}")
        if start_step >= s.total_steps:
            raise RuntimeError(f"--resume: the checkpoint has already trained {start_step} steps and this "
                               f"run asks for {s.total_steps}; ask for more steps (--epochs/--num-batches)")
        say(f"resumed from {resume} at step {start_step}")
    elif resume:
        torn = checkpoint.torn_note(Path(resume), ours=True)  # (a source another run holds was refused)
        if torn:
            say(f"paralab: {torn}")
        saved = checkpoint.load(Path(resume), rank, at=at)
        s.strategy.load_state_dict(saved["state"])
        start_step, losses, scale = saved["step"], checkpoint.losses(saved), saved.get("loss_scale")
        if start_step >= s.total_steps and not checkpoint.finishing(Path(resume), cfg, start_step, s.total_steps):
            # every rank reads the same step: the same decision everywhere
            raise RuntimeError(f"--resume: the checkpoint has already trained {start_step} steps and this "
                               f"run asks for {s.total_steps}; ask for more steps (--epochs/--num-batches)")
        say(f"resumed from {resume} at step {start_step}")
    elif cfg.save_init:  # the starting weights, for `paralab export RUN --init` (a collective for some)
        checkpoint.save(s.run_dir, rank, 0, cfg, s.strategy.state_dict(), s.comm, tag="init",
                        loss_scale=s.strategy.ctx.loss_scale)
    if resume and s.strategy.ctx.loss_scale is not None and scale is not None:  # fp16: the scale where it was
        s.strategy.ctx.loss_scale.load_state_dict(scale)
    note = s.source.data_note(start_step, s.total_steps)  # uneven data: samples repeated, or left out
    if note:
        say(f"paralab: note: {note}")
    return start_step, losses


def restarted_from(cfg: RunConfig, rank: int, s: Setup) -> Path | None:
    """Under torchrun, a group torchrun started again (``TORCHELASTIC_RESTART_COUNT`` > 0) continues from
    its own run directory's last checkpoint, where every rank holds one of the same step (decided
    together: one rank's file alone must not make it resume while another starts over)."""
    if cfg.launched_by != "torchrun" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    mine = checkpoint.resumable_step(s.run_dir, cfg, ranks=[rank])
    steps = s.comm.all_gather_objects(mine)
    if None in steps or len(set(steps)) != 1:
        return None
    if rank == 0:
        print(f"paralab: restarted by torchrun (restart {os.environ['TORCHELASTIC_RESTART_COUNT']}): "
              f"continuing from {s.run_dir}'s checkpoint of step {steps[0]}", flush=True)
    return s.run_dir
