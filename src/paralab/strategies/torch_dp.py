"""``torch-dp`` (HPML Lab 4): PyTorch's ``torch.nn.DataParallel``, one process driving several GPUs.

This is what HPML Lab 4 measures (Q1-Q4 at 1, 2 and 4 GPUs): a single Python
process holds the model on GPU 0 and, every step,

    scatter     the batch cut into one contiguous chunk per GPU
    replicate   the model copied from GPU 0 to the others (parameters and buffers)
    forward     each replica on its chunk, one thread per GPU (parallel_apply)
    gather      the outputs back onto GPU 0, where the loss is taken
    backward    through the replicas; replicate's backward sums every replica's
                gradient onto GPU 0's parameters (reduce-add)
    optimizer   on GPU 0 only

Each phase is DataParallel's own method (``scatter``, ``replicate``,
``parallel_apply``, ``gather``), called in the order its ``forward`` calls them,
so each gets a span: ``comm`` for the copies (with the bytes they move),
``compute`` for forward and backward (the reduce-add runs inside autograd,
so inside ``backward``).

One process: ``--gpus N`` picks the GPUs (0: every visible one) and
``--workers`` stays 1; sweeps and ``compare`` turn their worker counts into
``--gpus`` (:meth:`TorchDP.for_devices`). ``--check`` equals the
single-process reference on one GPU, and on several with ``--norm none``.
Without a CUDA device it refuses before start (exit 2), saying why.

Why, and how it compares with one process: docs/gpu.md#torch-dp-one-process-several-gpus
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import nbytes
from ..errors import UsageError
from ..options import option
from .base import StepResult, Strategy
from .portable import Portable, optimizer_by_name, optimizer_for


@dataclass
class DataParallelOptions:
    """torch-dp: one process, several GPUs"""
    gpus: int = option(0, "torch-dp: GPUs its one process drives with torch.nn.DataParallel "
                          "(0: every visible one)", minimum=0)


def visible_gpus() -> int:
    """CUDA devices this process can use (0 on a CPU-only machine or a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def refusal(cfg, world: int, gpus_visible: int) -> str | None:
    """Why torch-dp cannot run ``cfg`` on ``world`` processes with ``gpus_visible`` GPUs (None: it can)."""
    if cfg.device == "cpu":
        return "torch-dp drives CUDA GPUs (torch.nn.DataParallel); drop --device cpu or pick another strategy"
    if gpus_visible < 1:
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
        return (f"torch-dp runs torch.nn.DataParallel, one process driving CUDA GPUs, and this machine has none "
                f"(torch {torch.__version__}: {build}). Run it where a GPU is visible, or use ddp / torch-ddp "
                "for data parallelism on CPU")
    if world != 1:
        return (f"torch-dp is one process driving several GPUs (torch.nn.DataParallel), not {world} processes: "
                "use --workers 1 and choose the GPUs with --gpus N")
    if cfg.gpus > gpus_visible:
        return f"--gpus {cfg.gpus}: only {gpus_visible} GPU(s) visible here"
    gpus = cfg.gpus or gpus_visible
    if getattr(cfg, "dropout", 0) and gpus > 1:
        return (f"--dropout on {gpus} GPUs: DataParallel runs its replicas in threads, which would seed and draw "
                "from one CPU generator at once (models/dropout.py); use --gpus 1, or ddp / torch-ddp")
    if cfg.check and gpus > 1 and cfg.norm == "batch":
        return (f"--check on {gpus} GPUs with BatchNorm: DataParallel normalises each GPU's chunk apart (and keeps "
                "GPU 0's running statistics), which the single-process reference does not replay; check on one "
                "GPU (--gpus 1) or with --norm none")
    return None


class Phases:
    """DataParallel's four steps, as its ``forward`` runs them (a seam: tests pass CPU stand-ins)."""

    def __init__(self, dp: nn.DataParallel):
        self.dp = dp
        self.devices = list(dp.device_ids)

    def scatter(self, x):
        inputs, _ = self.dp.scatter((x,), {}, self.devices)
        return [i[0] for i in inputs]

    def replicate(self, module, n):
        return self.dp.replicate(module, self.devices[:n])

    def parallel_apply(self, replicas, chunks):
        return self.dp.parallel_apply(replicas, [(c,) for c in chunks], [{} for _ in chunks])

    def gather(self, outputs):
        return self.dp.gather(outputs, self.dp.output_device)


class TorchDP(Strategy):
    name = "torch-dp"
    options = (DataParallelOptions,)

    def __init__(self, ctx, model_fn, optim_fn, phases: Phases | None = None):
        super().__init__(ctx, model_fn, optim_fn)
        self.model = model_fn().to(ctx.device)
        if phases is None:
            gpus = ctx.options.gpus or visible_gpus()
            phases = Phases(nn.DataParallel(self.model, device_ids=list(range(gpus)), output_device=0))
        self.phases = phases
        self.optimizer = optim_fn(list(self.model.parameters()))
        self.state_bytes = sum(nbytes(t) for t in self.model.state_dict().values())

    # ------------------------------------------------------------ declarations
    @classmethod
    def validate(cls, cfg, world):
        reason = refusal(cfg, world, visible_gpus())
        if reason:
            raise UsageError(reason)

    @classmethod
    def for_devices(cls, cfg, n: int, per_device_batch: int | None = None):
        """``cfg`` for ``n`` GPUs driven by one process: what a sweep or comparison means by ``n``
        workers. ``per_device_batch`` (weak scaling): each GPU's batch, so the global one is ``n`` times it."""
        batch = {"batch_size": per_device_batch * n, "per_worker_batch": None} if per_device_batch else {}
        return dataclasses.replace(cfg, workers=1, gpus=n, **batch)

    # ------------------------------------------------------------ the step
    def train_step(self, x, y) -> StepResult:
        rec, ph = self.rec, self.phases
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with rec.span("comm", "scatter", nbytes(x), op="scatter"):
            chunks = ph.scatter(x)
        n = len(chunks)
        with self.ctx.autocast():
            if n == 1:  # DataParallel on one device calls the module itself
                with rec.span("compute", "forward", gpus=1):
                    out = self.model(chunks[0])
            else:
                with rec.span("comm", "replicate", self.state_bytes * (n - 1), op="broadcast"):
                    replicas = ph.replicate(self.model, n)
                with rec.span("compute", "forward", gpus=n):
                    outputs = ph.parallel_apply(replicas, chunks)
                with rec.span("comm", "gather", sum(nbytes(o) for o in outputs[1:]), op="gather"):
                    out = ph.gather(outputs)
            with rec.span("compute", "forward", what="loss"):
                loss = self.ctx.loss(out, y.to(out.device))
        with rec.span("compute", "backward", gpus=n):  # includes the reduce-add of the replicas' gradients
            loss.backward()
        with rec.span("optimizer", "step"):
            self.optimizer.step()
        return StepResult(loss.item(), len(y))

    def predict(self, x):
        return self.eval_logits(self.model, x)  # eval mode: running statistics, the same on every GPU

    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate(cls, states, model):
        return dict(states[0]["model"])

    @classmethod
    def portable(cls, states, model):
        return Portable(dict(states[0]["model"]), optimizer_by_name(states[0]["optimizer"],
                                                                    [n for n, _ in model.named_parameters()]))

    def load_portable(self, portable):
        names = [n for n, _ in self.model.named_parameters()]
        self.load_state_dict({"model": {k: portable.tensors[k] for k in self.model.state_dict()},
                              "optimizer": optimizer_for(self.optimizer, names, portable.optimizer)})

    def extra_summary(self) -> dict:
        return {"data_parallel": {"flavour": "torch.nn.DataParallel", "gpus": len(self.phases.devices),
                                  "devices": [str(d) for d in self.phases.devices]}}
