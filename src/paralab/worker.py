"""One rank's life: process group, data, model, strategy, training loop, evaluation, records.

The loop is the same for every strategy: for each step it loads this rank's
samples (a ``data`` span), hands them to ``strategy.train_step`` (which
records its own compute/comm/optimizer spans) and notes the step's wall time.
Rank 0 gathers every rank's records at the end and writes the run directory.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint, records
from .comm import Comm
from .config import RunConfig
from .data import BatchSource, load_dataset, to_device
from .evaluate import evaluate, headline
from .models import build_model, count_parameters, model_shape
from .progress import Progress
from .recorder import Recorder
from .schedule import lr_at, set_lr
from .mesh import Mesh
from .strategies import plan
from .strategies.base import Context


def pick_device(cfg: RunConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer_factory(cfg: RunConfig, created: list | None = None):
    """A factory strategies call on the parameters they own; ``created`` collects the
    optimizers so the loop can drive the learning-rate schedule of all of them."""
    def make(params):
        if cfg.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if created is not None:
            created.append(opt)
        return opt
    return make


def build_model_factory(cfg: RunConfig, num_classes: int):
    def make():
        torch.manual_seed(cfg.seed)  # every rank and the reference start from the same weights
        model = build_model(cfg.model, width=cfg.width, norm=cfg.norm, num_classes=num_classes, **model_shape(cfg))
        return model.double() if cfg.precision == "fp64" else model
    return make


def make_lr_for(cfg: RunConfig, global_batch: int, steps_per_epoch: int):
    return functools.partial(lr_at, lr=cfg.lr, scaling=cfg.lr_scaling, global_batch=global_batch,
                             warmup_epochs=cfg.warmup_epochs, steps_per_epoch=steps_per_epoch)


def fault_injection(rank: int, step: int) -> None:
    """Testing only: PARALAB_FAULT=RANK:STEP[:KIND] makes that rank fail at the start of that step.

    KIND: ``raise`` (the default: a RuntimeError, reported with its traceback), ``kill`` (SIGKILL to
    itself: no traceback, as ``kill -9`` or the kernel's out-of-memory killer) or ``oom`` (an
    out-of-memory-style exit: the process ends at once with exit code 137 = 128 + SIGKILL and no
    Python error, as a shell or container runtime reports a process the out-of-memory killer took).
    """
    spec = os.environ.get("PARALAB_FAULT")
    if spec:
        fault_rank, fault_step, *kind = spec.split(":")
        kind = kind[0] if kind else "raise"
        if kind not in ("raise", "kill", "oom"):
            raise ValueError(f"PARALAB_FAULT={spec}: the kind must be raise, kill or oom")
        if rank == int(fault_rank) and step == int(fault_step):
            if kind == "kill":
                import signal
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "oom":
                os._exit(137)
            raise RuntimeError(f"injected fault on rank {rank} at step {step} (PARALAB_FAULT)")


def init_group(cfg: RunConfig, rank: int, world: int, device: torch.device, init_method: str | None):
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    kwargs = dict(backend=backend, timeout=timedelta(seconds=cfg.timeout))
    if init_method is None:  # torchrun: env://
        dist.init_process_group(**kwargs)
    else:
        dist.init_process_group(init_method=init_method, rank=rank, world_size=world, **kwargs)
    return backend


def run_worker(cfg: RunConfig, rank: int, world: int, local_rank: int, init_method: str | None,
               run_dir: str) -> None:
    """Entry point of every rank (local spawn, manual --rank, or torchrun)."""
    run_dir = Path(run_dir)
    device = pick_device(cfg, local_rank)
    backend = init_group(cfg, rank, world, device, init_method)
    try:
        train(cfg, rank, world, device, backend, run_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg: RunConfig, rank: int, world: int, device: torch.device, backend: str, run_dir: Path):
    recorder = Recorder(rank, device)
    comm = Comm(recorder, rank, world)
    if world > 1:
        if cfg.out is None:
            # without --out, each process (torchrun, --rank) named its own default
            # directory from the clock; rank 0's name wins so they agree
            run_dir = Path(comm.broadcast_object(str(run_dir)))
        dist.barrier()  # a common time origin, so the ranks' timelines line up
        recorder.origin = time.perf_counter()
    main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)

    data = load_dataset(cfg.dataset, Path(cfg.data_dir) if cfg.data_dir else None,
                        synthetic_size=cfg.synthetic_size, seed=cfg.seed, model=cfg.model, context=cfg.context)
    shape, strategy_cls, composition = plan(cfg, world)
    mesh = Mesh(shape, rank, comm, new_group=dist.new_group if world > 1 else None)
    model_fn = build_model_factory(cfg, len(data.classes))
    optimizers: list = []
    optim_fn = build_optimizer_factory(cfg, optimizers)
    ctx = Context(rank, world, device, comm, recorder, cfg.precision, cfg.strategy_options(), mesh,
                  batch_size=cfg.global_batch())
    strategy = strategy_cls(ctx, model_fn, optim_fn, **composition)
    replicas, replica = strategy.replicas()
    global_batch = cfg.global_batch()
    source = BatchSource(data, per_rank_batch=global_batch // replicas, replicas=replicas,
                         rank=replica, seed=cfg.seed, augment=cfg.augment, drop_last=cfg.drop_last)
    total_steps = cfg.num_batches or cfg.epochs * source.steps_per_epoch
    lr_for = make_lr_for(cfg, global_batch, source.steps_per_epoch)
    parameters = count_parameters(model_fn())
    say(f"paralab: {cfg.strategy} on {world} worker(s), {backend}, {device.type}; {cfg.model} "
        f"(width {cfg.width}, norm {cfg.norm}, {parameters:,} parameters); {data.describe()}; "
        f"global batch {global_batch}, {total_steps} steps")
    say(f"paralab: {mesh.shape.describe()}"
        + (f"; each of the {shape.pp} stages wrapped in {cfg.strategy}'s data-parallel flavour"
           if composition else ""))

    start_step = 0
    if cfg.resume:
        saved = checkpoint.load(Path(cfg.resume), rank)
        strategy.load_state_dict(saved["state"])
        start_step = saved["step"]
        if start_step >= total_steps:  # every rank reads the same step: the same decision everywhere
            raise RuntimeError(f"--resume: the checkpoint has already trained {start_step} steps and this "
                               f"run asks for {total_steps}; ask for more steps (--epochs/--num-batches)")
        say(f"resumed from {cfg.resume} at step {start_step}")
    elif cfg.save_init:  # the starting weights, for `paralab export RUN --init` (a collective for some)
        checkpoint.save(run_dir, rank, 0, cfg, strategy.state_dict(), tag="init")

    note = source.data_note(start_step, total_steps)  # uneven data: samples repeated, or left out
    if note:
        say(f"paralab: note: {note}")

    reference, history = None, []  # --check: the single-process reference; --check-every: its deviations
    if cfg.check:
        from .check import Reference, weight_deviation
        reference = Reference(strategy, source, model_fn, build_optimizer_factory(cfg), lr_for)

    step_rows: list[dict] = []
    progress = Progress(total_steps, "train", enabled=main and cfg.progress, start=start_step)
    error = None
    first_bad = None  # first step whose loss was not finite, on this rank
    for step in range(start_step, total_steps):
        recorder.step = step
        t0 = recorder.now()
        fault_injection(rank, step)
        set_lr(optimizers, lr_for(step))
        with recorder.span("data", "load"):
            x, y = source.batch(step)
            x, y = to_device(x, device, ctx.dtype, non_blocking=True), y.to(device, non_blocking=True)
        result = strategy.train_step(x, y)
        t1 = recorder.now()
        recorder.step = -1
        step_rows.append(records.step_row(rank, step, t0, t1, result, recorder.split(step)))
        if first_bad is None and result.loss is not None and not math.isfinite(result.loss):
            first_bad = step
        # Every rank must take the same decision to stop, so the check is collective
        # (a single process checks every step; several ranks at each log point).
        if world == 1 or (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
            seen = comm.all_gather_objects((result.loss, first_bad))
            bad = [b for _, b in seen if b is not None]
            if bad:
                error = (f"loss became non-finite at step {min(bad)}; lower --lr or check the data "
                         "(the records up to here are kept)")
                progress.close()
                print(f"paralab: rank {rank}: {error}", file=sys.stderr, flush=True)
                break
            if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
                losses = [loss for loss, _ in seen if loss is not None]
                say(f"{progress.clear()}step {step + 1:>6}/{total_steps}  loss {sum(losses) / len(losses):.4f}")
                progress.event("loss", step=step + 1, total=total_steps, loss=sum(losses) / len(losses))
        progress.update(step + 1)
        if reference is not None and cfg.check_every and (step + 1) % cfg.check_every == 0 \
                and step + 1 < total_steps:  # outside the step's timing (recorder.step is -1)
            reference.advance_to(step + 1)
            history.append((step + 1, weight_deviation(strategy, reference, cfg.precision).max_abs))
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < total_steps:
            checkpoint.save(run_dir, rank, step + 1, cfg, strategy.state_dict())
    else:
        progress.close()
        checkpoint.save(run_dir, rank, total_steps, cfg, strategy.state_dict())

    recorder.step = -1
    result_eval = None
    check = None
    if error is None:
        result_eval = evaluate(strategy, source, data.classes, comm, cfg.eval_batch_size, cfg.eval_batches,
                               device, progress=main and cfg.progress)
        if main and result_eval is not None:
            say(headline(result_eval))
        if reference is not None:
            from .check import run_check
            check = run_check(cfg, strategy, reference, total_steps, comm, say, history)

    records.write_run(run_dir, cfg, comm, recorder, step_rows, strategy, parameters=parameters,
                      world=world, backend=backend, device=device, dataset=data, evaluation=result_eval,
                      check=check, error=error, global_batch=global_batch, is_main=main)
    if main:
        say(f"records written to {run_dir}")
    if error is not None:
        raise SystemExit(3)
    if check is not None and not check["passed"]:
        raise SystemExit(1)
