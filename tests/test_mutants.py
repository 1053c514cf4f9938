"""Seeded bugs that ``--check`` must catch: each a copy of the package with one realistic line changed.

A check that passes correct code proves little until it is seen to fail
wrong code. Each mutant below is a bug someone could write (or has: the
classes come from issue 34, found by hand in the newest strategies): a
gradient averaged twice, a loss reported wrong while its gradient is right,
momentum lost, a ring turned the wrong way, a stage's gradient left out...
For each, the package is copied, the one line is replaced (the original must
occur exactly once, so a moved line fails here rather than passing
vacuously), and the smallest check of that layout runs against the copy
(first on the path of a ``python -m paralab`` forked from a process that has imported torch, not paralab:
tests/zygote.py): it must end ``check: FAIL`` with exit
code 1, not crash. The same command against the unchanged copy must PASS,
so a mutant is caught by the check, not by a command that fails anyway.

Some mutants are invisible to a check that does not reach their path; their
command is the one that does, and the note says what a smaller one leaves
out (``check: not exercised: ...`` says so at run time):

- PowerSGD starts after ``--powersgd-start-iter`` steps;
- a ring of 2 cp ranks has next == previous (``--cp 4``);
- 2 workers give fsdp no padding at this width (``--workers 3``);
- recomputation's random state matters only with ``--dropout``;
- equal microbatches hide their weights (``--accumulate`` M of a shard M divides): an epoch's short last batch
  is where a shard M divides in every other step is cut unevenly, and a check that ends before it says so;
- a capacity that drops nothing hides what a drop does;
- packed documents dealt as the head + tail pairing hide a dealt layout;
- ASCII text never reaches tp rank 1's share of the byte vocabulary (``--dataset jargon`` does; its commands
  skip where Debian's jargon-text is not installed).

Every check runs at the default precision of ``--check`` (fp64): the fp32
course setting moves the weights less than its tolerance for the small-gradient
bugs (a key gradient 2.8 times too large, a router's gates detached). A bug in
the model itself (``models/``) is not among them: the reference runs the same
model, so a check compares layouts, not the model with a textbook.

``make mutants`` runs this module; it is in the slow selection (about 40
fresh processes).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from zygote import Zygote

import paralab

pytestmark = pytest.mark.slow

SRC = Path(paralab.__file__).parent
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")

CNN = ["--dataset", "synthetic", "--synthetic-size", "256", "--width", "0.125", "--batch-size", "16"]
GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "4",
       "--context", "16", "--batch-size", "8"]
DOCS = ["--model", "gpt", "--dataset", "synthetic-docs", "--doc-length", "10", "--layers", "2", "--embed", "32",
        "--heads", "4", "--context", "16", "--batch-size", "8"]  # short documents of unequal lengths
COMMON = ["--num-batches", "3", "--check", "--no-progress", "--eval-batches", "1", "--eval-batch-size", "16",
          "--timeout", "60"]


@dataclass
class Mutant:
    name: str
    file: str          # under src/paralab
    old: str           # a line (or part of one) that occurs exactly once
    new: str
    command: tuple     # `paralab train` arguments of the check that must FAIL
    why: str           # what the bug is, in words


def cnn(strategy, *args):
    """A check of a VGG-11 (the layout's own options after the defaults, so they win)."""
    return (strategy, *CNN, *args)


def gpt(strategy, *args):
    """A check of the gpt."""
    return (strategy, *GPT, *args)


def docs(strategy, *args):
    """A check of the gpt on documents (padded; ``--packing`` among ``args`` packs them)."""
    return (strategy, *DOCS, *args)


MUTANTS = [
    # ---- data parallelism
    Mutant("ddp-averaged-twice", "strategies/ddp.py",
           "torch.div(param.grad, self.comm.world, out=view)", "torch.div(param.grad, self.comm.world ** 2, out=view)",
           cnn("ddp", "--workers", "2"), "a bucket's gradients divided by N twice"),
    Mutant("allreduce-never-averages", "strategies/allreduce.py",
           "p.grad.div_(self.comm.world)", "p.grad.div_(1)",
           cnn("allreduce", "--workers", "2"), "the all-reduced sum used as the mean"),
    Mutant("gather-scatter-divides-by-one-less", "strategies/gather_scatter.py",
           "mean /= world", "mean /= world - 1",
           cnn("gather-scatter", "--workers", "3", "--batch-size", "24"), "the mean over N-1"),
    Mutant("momentum-freed-every-step", "strategies/base.py",
           "        optimizer.zero_grad(set_to_none=True)",
           "        optimizer.zero_grad(set_to_none=True); optimizer.state.clear()",
           cnn("ddp", "--workers", "2"), "the optimizer's state dropped after each step (momentum restarts)"),
    Mutant("checkpoint-without-momentum", "strategies/replicas.py",
           'return {"optimizer": self.optimizer.state_dict()}',
           'return {"optimizer": {**self.optimizer.state_dict(), "state": {}}}',
           cnn("allreduce", "--workers", "2"), "the saved state (a checkpoint) leaves the momentum out"),
    # ---- sharded data parallelism
    Mutant("fsdp-padding-in-front", "strategies/fsdp/flat.py",
           "flat_grad = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(pad)] if pad else []))",
           "flat_grad = torch.cat(([grads[0].new_zeros(pad)] if pad else []) + [g.reshape(-1) for g in grads])",
           cnn("fsdp", "--workers", "3", "--zero-stage", "3", "--batch-size", "24"),
           "a unit's flat gradient padded at the front, not the end: invisible where nothing is padded "
           "(2 workers at this width)"),
    Mutant("hsdp-mean-over-the-shard-group", "strategies/fsdp/flat.py",
           "shard_grad.div_(self.comm.world * (self.replicate.world if self.replicate is not None else 1))",
           "shard_grad.div_(self.comm.world)",
           cnn("fsdp", "--workers", "4", "--zero-stage", "2", "--replicate", "2"),
           "HSDP's gradient divided by the shard group's size, not by every replica's"),
    # ---- tensor and sequence parallelism
    Mutant("tp-f-backward-not-reduced", "strategies/tensor/ops.py",
           'ctx.comm.all_reduce(grad, name="tp_f_backward")', "pass",
           gpt("tp", "--workers", "2"), "Megatron's f: the input gradient of a column-parallel layer not summed"),
    Mutant("tp-mlp-bias-before-the-reduce", "strategies/tensor/gpt.py",
           "self.proj.weight)\n        return self.tp.leave(partial) + self.tp.replicated(self.proj.bias)\n\n\nclass TPHead",
           "self.proj.weight) + self.proj.bias\n        return self.tp.leave(partial)\n\n\nclass TPHead",
           gpt("tp", "--workers", "2", "--dropout", "0.1"),
           "the row-parallel MLP's bias added on every rank before the sum: tp times (named at the MLP, not at "
           "the block's dropout, whose second call follows it)"),
    Mutant("sp-layernorm-not-reduced", "strategies/tensor/group.py",
           "return copy_to_tp(p, self.comm) if self.sequence_parallel else p", "return p",
           gpt("tp", "--workers", "2", "--sequence-parallel"),
           "sequence parallelism: a LayerNorm's partial gradients not summed over tp"),
    Mutant("vocab-parallel-loss-forward", "strategies/tensor/ops.py",
           "        return lse - target_logit", "        return lse_local - target_logit",
           gpt("tp", "--workers", "2"),
           "the vocabulary-parallel cross-entropy's value uses the local log-sum-exp (its backward is right: only "
           "the loss shows it)"),
    # ---- context parallelism
    Mutant("cp-loss-summed", "strategies/context/strategy.py",
           "loss=loss.item() / self.cp.comm.world", "loss=loss.item()",
           gpt("cp", "--workers", "2"), "the ranks' losses summed, not averaged (gradients right: only the loss shows)"),
    Mutant("cp-ring-backwards", "strategies/context/ring.py",
           "nxt, prev = (comm.rank + 1) % comm.world, (comm.rank - 1) % comm.world",
           "nxt, prev = (comm.rank - 1) % comm.world, (comm.rank + 1) % comm.world",
           gpt("cp", "--workers", "4", "--cp-method", "ring"),
           "K/V sent the wrong way round the ring: invisible on a ring of 2 (next == previous)"),
    Mutant("cp-ring-key-gradient-unscaled", "strategies/context/ring.py",
           "dkv[0][ki] += ds.transpose(-2, -1) @ qb * scale",
           "dkv[0][ki] += ds.transpose(-2, -1) @ qb",
           gpt("cp", "--workers", "2"), "the key gradient sqrt(d) = 2.8 times too large"),
    Mutant("ulysses-combine-not-reversed", "strategies/context/ulysses.py",
           'HeadsToSeq.apply(out.index_select(2, back).contiguous(), comm, "cp_a2a_out")',
           'HeadsToSeq.apply(out.index_select(2, order).contiguous(), comm, "cp_a2a_out")',
           gpt("cp", "--workers", "2", "--cp-method", "all-to-all"),
           "the all-to-all back to sequence shards with the forward permutation, not its inverse"),
    # ---- experts
    Mutant("ep-experts-mean-over-edp", "strategies/expert/replicas.py",
           "p.grad.div_(self.ep)", "p.grad.div_(1)",
           gpt("allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2"),
           "experts' gradients averaged over the replicas holding them, not over every data-parallel replica"),
    Mutant("ep-combine-gates-detached", "strategies/expert/dispatch.py",
           "        return combine(tokens, index, gates, back)", "        return combine(tokens, index, gates.detach(), back)",
           gpt("allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2"),
           "the expert-parallel combine detaches the gates: the router learns only from the load-balancing loss "
           "(below fp32's tolerance at the course setting)"),
    # ---- pipelines
    Mutant("pipeline-microbatch-loss-unweighted", "strategies/pipeline/executor.py",
           "losses[i] = st.ctx.loss(out, ys) * weight", "losses[i] = st.ctx.loss(out, ys)",
           cnn("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "1f1b", "--norm", "none"),
           "each microbatch's loss taken whole: gradients M times too large"),
    Mutant("pipeline-reports-last-microbatch", "strategies/pipeline/executor.py",
           "loss_sum += losses[i].detach().to(self.dtype)", "loss_sum = losses[i].detach().to(self.dtype)",
           cnn("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "gpipe", "--norm", "none"),
           "the step's loss is the last microbatch's share (gradients right: only the loss shows)"),
    Mutant("zero-bubble-w-first-unit-only", "strategies/pipeline/stage.py",
           "for root, root_grad, params in self.weight_work.pop(mb):",
           "for root, root_grad, params in self.weight_work.pop(mb)[:1]:",
           gpt("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "zb-h1"),
           "a zero-bubble W computes the weight gradients of one unit of the stage"),
    # ---- compression
    Mutant("powersgd-no-error-feedback", "strategies/compression/buckets.py",
           "m = torch.add(v, method.error[k], alpha=self.scale)     # M = G/N + e",
           "m = torch.add(v, 0 * method.error[k], alpha=self.scale)",
           cnn("ddp", "--workers", "2", "--compress", "powersgd", "--powersgd-start-iter", "2", "--num-batches", "5"),
           "PowerSGD without error feedback: invisible before it starts (--powersgd-start-iter, 10 by default)"),
    # ---- recomputation and dropout
    Mutant("recompute-forgets-the-generator", "training/recompute.py",
           "            torch.set_rng_state(self.cpu_rng)", "            pass",
           gpt("single", "--recompute", "full", "--dropout", "0.1"),
           "a recomputed block draws other dropout masks: invisible without --dropout"),
    Mutant("recompute-forgets-where-samples-sit", "training/recompute.py",
           "steps.entered(self.step)", "steps.entered(steps.current())",
           gpt("pipeline", "--workers", "2", "--microbatches", "4", "--recompute", "full", "--dropout", "0.1"),
           "a recompute in backward takes the current microbatch's rows for its masks"),
    Mutant("recompute-batchnorm-twice", "training/recompute.py",
           "                b.copy_(saved)", "                pass",
           cnn("single", "--recompute", "full"), "a recompute updates BatchNorm's running statistics again"),
    Mutant("dropout-microbatch-rows", "strategies/base.py",
           "with around() if around else nullcontext(), steps.microbatch(i):",
           "with around() if around else nullcontext(), steps.microbatch(0):",
           gpt("ddp", "--workers", "2", "--accumulate", "2", "--dropout", "0.1"),
           "every accumulated microbatch draws the first one's dropout masks"),
    # ---- the whole model's gradient norm (--clip-grad 0.05 clips at every step: the weights depend on the norm)
    Mutant("clip-tp-replicas-counted-per-rank", "strategies/base.py",
           "return 1 if tp is None or key in tp.layout else tp.group.size", "return 1",
           gpt("tp", "--workers", "2", "--clip-grad", "0.05"),
           "a parameter every tp rank holds whole (a LayerNorm's) counted once per tp rank in the norm"),
    Mutant("clip-dp-replicas-counted-per-rank", "strategies/replicas.py",
           "return [(p.grad, self.comm.world * copies(keys[id(p)])) for p in self.params if p.grad is not None]",
           "return [(p.grad, copies(keys[id(p)])) for p in self.params if p.grad is not None]",
           gpt("ddp", "--workers", "2", "--clip-grad", "0.05"),
           "every data-parallel replica's copy of the averaged gradient added to the norm"),
    Mutant("clip-a-stage-left-out", "strategies/pipeline/strategy.py",
           "        return [held for s in sorted(self.flavours)",
           "        return [held for s in sorted(self.flavours)[:1]",
           gpt("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "interleaved-1f1b",
               "--virtual-stages", "2", "--layers", "4", "--clip-grad", "0.05"),
           "a rank's second (virtual) stage left out of the norm"),
    Mutant("clip-experts-averaged", "strategies/expert/replicas.py",
           "return [held for f in self.parts for held in f.held_gradients(keys, copies)]",
           "return [(g, c * (self.ep if f is self.sparse else 1)) for f in self.parts "
           "for g, c in f.held_gradients(keys, copies)]",
           gpt("allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--clip-grad", "0.05"),
           "the experts' squares averaged over data parallelism instead of summed over the ranks holding them"),
    # ---- documents (data/documents.py): the token-weighted loss, document-causal attention
    Mutant("loss-mean-per-microbatch", "strategies/base.py",
           "return self.tp.loss(logits, target) if self.tp is not None else cross_entropy(logits, target)",
           "return self.tp.loss(logits, target) if self.tp is not None else torch.nn.functional.cross_entropy("
           "logits.reshape(-1, logits.shape[-1]), target.reshape(-1))",
           docs("ddp", "--workers", "2", "--accumulate", "2"),
           "each microbatch's loss the mean over its own valid targets (unequal documents weigh unequally), not "
           "the sum over the step's global count"),
    Mutant("ring-attends-across-documents", "strategies/context/ring.py",
           "mask = documents.allowed(q.shape[0], q_pos[qs], k_pos[ks], q.device)", "mask = None",
           docs("cp", "--workers", "2", "--packing"),
           "ring attention's blocks causal only: a packed row's tokens see the documents before theirs"),
    # ---- the run's own code the reference does not share (check/reference.py rebuilds the schedule with torch's)
    Mutant("cosine-warmup-off-by-one", "training/lr_schedule.py",
           "return target * min(1.0, (step + 1) / warmup_steps)", "return target * min(1.0, step / warmup_steps)",
           cnn("ddp", "--workers", "2", "--lr-schedule", "cosine", "--warmup-epochs", "0.125"),
           "the warm-up's first step at rate 0, its last below the target: the schedule one step late"),
    Mutant("documents-loss-counts-padding", "training/losses.py",
           "return at.elements / (targets * at.valid) if at.valid else 1.0 / targets", "return 1.0 / targets",
           docs("ddp", "--workers", "2"),
           "every layout's loss over all its targets, padding counted: the mean over the wrong count (the "
           "reference's loss is torch's cross-entropy with ignore_index)"),
    # ---- paths only some data reaches (a smaller check says it left them out: HIDDEN)
    Mutant("microbatches-weighted-equally", "strategies/base.py",
           "return [(xs, ys, len(ys) / n) for xs, ys in", "return [(xs, ys, 1 / m) for xs, ys in",
           # 22 samples: steps of 4 rows a rank, the epoch's short last batch (step 3) 3 rows a rank, cut 2 + 1
           gpt("ddp", "--workers", "2", "--accumulate", "2", "--synthetic-size", "22"),
           "gradient accumulation's microbatches weighted 1/M, not by its share of the samples: wrong only where they "
           "differ in size, as on an epoch's short last batch"),
    Mutant("ep-all-gather-computes-dropped-choices", "strategies/expert/dispatch.py",
           "choice = torch.where(routing.kept, routing.expert, routing.expert.new_full((), -1)).contiguous()",
           "choice = routing.expert.contiguous()",
           gpt("allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--dispatcher",
               "all-gather", "--capacity-factor", "1"),
           "the all-gather dispatcher sends the choices the capacity dropped to their experts too"),
    Mutant("cp-dealt-positions-rebound", "strategies/context/strategy.py",
           "self.positions.copy_(self.layout.positions(self.comm.rank))",
           "self.positions = self.layout.positions(self.comm.rank)",
           docs("cp", "--workers", "2", "--packing", "--context", "32", "--doc-length", "5"),
           "the dealt chunks' positions bound to a new tensor the modules never see (they keep the head + tail "
           "pairing's): wrong only where a step is dealt otherwise"),
    Mutant("tp-vocabulary-share-off-by-its-rank", "strategies/tensor/gpt.py",
           "self.start = tp.rank * self.local_vocab", "self.start = tp.rank * (self.local_vocab + 1)",
           gpt("tp", "--workers", "2", "--dataset", "jargon"),
           "the vocabulary-parallel embedding's share on tp rank r starting r ids late: wrong only for tokens "
           "past the first share (bytes of 128 or more, which ASCII text never has)"),
]


#: where each mutant's run first diverges from the reference (check/diverge.py: the failed check replays the run),
#: as the line names it: the step, the rank, the direction and the module. Each is where the bug acts: a mean
#: over the wrong count shows in the first gradient backward meets (the classifier's), a lost momentum in the
#: second step's update, a loss misreported in the loss alone, a ring turned backwards in the attention's
#: output, detached gates in the router's gradient, a BatchNorm updated twice in its running statistics
FIRST = {
    "ddp-averaged-twice": "step 1, rank 0, backward of 13.1 (Linear) weight gradient",
    "allreduce-never-averages": "step 1, rank 0, backward of 13.1 (Linear) weight gradient",
    "gather-scatter-divides-by-one-less": "step 1, rank 0, backward of 13.1 (Linear) weight gradient",
    "momentum-freed-every-step": "step 2, rank 0, optimizer step of 0.0 (Conv2d) weight",
    "checkpoint-without-momentum": "none in 3 replayed steps",  # training is right: only the saved state is not
    "fsdp-padding-in-front": "step 1, rank 0, backward of 13.1 (Linear) weight gradient",
    "hsdp-mean-over-the-shard-group": "step 1, rank 0, backward of 13.1 (Linear) weight gradient",
    "tp-f-backward-not-reduced": "step 1, rank 0, backward of 3.ln (LayerNorm) weight gradient",
    "tp-mlp-bias-before-the-reduce": "step 2, rank 0, forward of 1.mlp (MLP) output",  # a zero bias at step 1
    "sp-layernorm-not-reduced": "step 1, rank 0, backward of 3.ln (LayerNorm) weight gradient",
    "vocab-parallel-loss-forward": "step 1, rank 0, forward of the loss",
    "cp-loss-summed": "step 1, rank 0, forward of the loss",
    "cp-ring-backwards": "step 1, rank 1, forward of 1.attn.proj (Linear) output",
    "cp-ring-key-gradient-unscaled": "step 1, rank 0, backward of 2.attn.k (Linear) weight gradient",
    "ulysses-combine-not-reversed": "step 1, rank 0, forward of 1.attn.proj (Linear) output",
    "ep-experts-mean-over-edp": "step 1, rank 0, backward of 2.mlp.experts.3.proj (Linear) weight gradient",
    "ep-combine-gates-detached": "step 1, rank 0, backward of 2.mlp.router (Linear) weight gradient",
    "pipeline-microbatch-loss-unweighted": "step 1, rank 1, forward of the loss",  # M times, as the gradients
    "pipeline-reports-last-microbatch": "step 1, rank 1, forward of the loss",
    "zero-bubble-w-first-unit-only": "step 1, rank 0, backward of 2.mlp.proj (Linear) weight gradient",
    "powersgd-no-error-feedback": "step 4, rank 0, backward of 13.1 (Linear) weight gradient",
    "recompute-forgets-the-generator": "step 1, rank 0, backward of 2.mlp.proj (Linear) weight gradient",
    "recompute-forgets-where-samples-sit": "step 1, rank 0, backward of 2.mlp.proj (Linear) weight gradient",
    "recompute-batchnorm-twice": "step 1, rank 0, forward of 0.1 (BatchNorm2d) running_mean buffer",
    "dropout-microbatch-rows": "step 1, rank 0, forward of 1.drop (Dropout) output",
    "clip-tp-replicas-counted-per-rank": "step 1, rank 0, backward of 3.out (Linear) weight gradient",
    "clip-dp-replicas-counted-per-rank": "step 1, rank 0, backward of 3.out (Linear) weight gradient",
    "clip-a-stage-left-out": "step 1, rank 0, backward of 5.out (Linear) weight gradient",
    "clip-experts-averaged": "step 1, rank 0, backward of 3.out (Linear) weight gradient",
    "loss-mean-per-microbatch": "step 1, rank 0, forward of the loss",
    "ring-attends-across-documents": "step 1, rank 0, forward of 1.attn.proj (Linear) output",
    "cosine-warmup-off-by-one": "step 1, rank 0, optimizer step of 0.0 (Conv2d) weight",
    "documents-loss-counts-padding": "step 1, rank 0, forward of the loss",
    "microbatches-weighted-equally": "step 3, rank 0, forward of the loss",  # the short last batch
    "ep-all-gather-computes-dropped-choices": "step 1, rank 0, forward of 1.mlp (MoE) output",
    "cp-dealt-positions-rebound": "step 2, rank 0, forward of 0 (Embedding) output",  # step 1 is paired
    "tp-vocabulary-share-off-by-its-rank": "step 1, rank 0, forward of 0 (Embedding) output",  # once named at 1.ln1
}


#: mutants a smaller check cannot see, that check, and the line it prints about the path it leaves out: the
#: check must PASS the mutant there and say so (so "not exercised" is true, and the command above is needed)
HIDDEN = [
    ("fsdp-padding-in-front", cnn("fsdp", "--workers", "2", "--zero-stage", "3"), "no shard is padded"),
    ("cp-ring-backwards", gpt("cp", "--workers", "2", "--cp-method", "ring"), "a ring of 2 ranks"),
    ("powersgd-no-error-feedback", cnn("ddp", "--workers", "2", "--compress", "powersgd"), "nothing was compressed"),
    ("recompute-forgets-the-generator", gpt("single", "--recompute", "full"), "draws no random numbers"),
    ("microbatches-weighted-equally", gpt("ddp", "--workers", "2", "--accumulate", "2"),
     "microbatches held equally many samples"),
    # its own command, ended before the epoch's short last batch: the one batch whose microbatches differ
    ("microbatches-weighted-equally", gpt("ddp", "--workers", "2", "--accumulate", "2", "--synthetic-size", "22",
                                          "--num-batches", "2"), "short last batch"),
    ("ep-all-gather-computes-dropped-choices",
     gpt("allreduce", "--workers", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--dispatcher", "all-gather",
         "--capacity-factor", "4"), "dropped no token's choice"),
    ("cp-dealt-positions-rebound", docs("cp", "--workers", "2", "--packing"), "dealt as the head + tail pairing"),
    ("tp-vocabulary-share-off-by-its-rank", gpt("tp", "--workers", "2"), "share of the vocabulary"),
]


def _copy(root: Path) -> Path:
    shutil.copytree(SRC, root / "paralab", ignore=IGNORE)
    return root


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _copy(tmp_path_factory.mktemp("pristine"))


def train(zygote: Zygote, root: Path, command: tuple, out: Path) -> subprocess.CompletedProcess:
    """``python -m paralab train ...`` with the copy ``root`` first on the path (forked from the zygote)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PARALAB_SERVE": "off", "PYTHONUNBUFFERED": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    # the layout's own options after the common ones, so they win (--num-batches)
    return zygote.run(root, ["train", command[0], *COMMON, *command[1:], "--out", str(out)], env, out.parent, 300)


def _needs_missing_jargon(command: tuple) -> bool:
    """The command reads the Jargon File, and Debian's jargon-text is not installed here."""
    from paralab.data import text
    return "jargon" in command and text.text_path("jargon", None) is None


@pytest.fixture(scope="module")
def ran(request, pristine, tmp_path_factory) -> dict:
    """Every command the selected tests need, two at a time, each from one of two zygotes (a command's start,
    importing its copy of the package, is one core's work; the other command uses the other core):
    ("pristine", command) | ("mutant", name) | ("hidden", name, command) -> CompletedProcess."""
    import queue

    from conftest import precision_args, selected, two_at_a_time
    root = tmp_path_factory.mktemp("ran")
    by_name = {m.name: m for m in MUTANTS}
    jobs = [(("pristine", p["command"]), None, p["command"])
            for p in selected(request, "test_the_unchanged_package_passes_each_command")]
    jobs += [(("mutant", p["mutant"].name), p["mutant"], p["mutant"].command)
             for p in selected(request, "test_the_check_catches_the_mutant")]
    jobs += [(("hidden", p["name"], p["command"]), by_name[p["name"]], p["command"])
             for p in selected(request, "test_a_smaller_check_misses_it_and_says_what_it_left_out")]
    jobs += [(("below", p["name"], p["precision"]), by_name[p["name"]],
              (*by_name[p["name"]].command, *precision_args(p["precision"])))
             for p in selected(request, "test_below_fp64_a_layout_held_to_exact_catches_what_its_band_cannot")]
    jobs = [j for j in jobs if not _needs_missing_jargon(j[2])]
    zygotes: queue.Queue = queue.Queue()
    for _ in range(2):
        zygotes.put(Zygote())

    def one(i, job):
        key, mutant, command = job
        folder = root / f"job{i}"
        folder.mkdir()
        copy = pristine if mutant is None else mutated(pristine, folder / "copy", mutant)
        z = zygotes.get()
        try:
            return key, train(z, copy, command, folder / "run")
        finally:
            zygotes.put(z)
    try:
        return dict(two_at_a_time(one, jobs))
    finally:
        while not zygotes.empty():
            zygotes.get().close()


def test_there_are_enough_mutants_and_each_names_a_distinct_bug():
    assert len(MUTANTS) >= 20 and set(FIRST) == {m.name for m in MUTANTS}
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert len({(m.file, m.old) for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("command", sorted({m.command for m in MUTANTS}), ids=lambda c: " ".join(c[:3]))
def test_the_unchanged_package_passes_each_command(ran, command):
    needs_jargon(command)
    r = ran[("pristine", command)]
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def needs_jargon(command: tuple) -> None:
    """A command over the Jargon File (real text, bytes past ASCII) skips where Debian's jargon-text is absent."""
    if _needs_missing_jargon(command):
        pytest.skip("Debian's jargon-text is not installed (apt-get install jargon-text; CI installs it)")


def mutated(pristine: Path, dest: Path, mutant: Mutant) -> Path:
    """A copy of the package with ``mutant``'s one change."""
    shutil.copytree(pristine / "paralab", dest / "paralab")
    path = dest / "paralab" / mutant.file
    text = path.read_text()
    assert text.count(mutant.old) == 1, f"{mutant.file}: the line to change occurs {text.count(mutant.old)} times"
    path.write_text(text.replace(mutant.old, mutant.new))
    return dest


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_check_catches_the_mutant(ran, mutant):
    needs_jargon(mutant.command)
    r = ran[("mutant", mutant.name)]
    output = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 1 and "check: FAIL" in r.stdout, f"{mutant.name} ({mutant.why}) not caught:\n{output}"
    assert f"check: first divergence: {FIRST[mutant.name]}" in r.stdout, output


@pytest.mark.parametrize("name,command,note", HIDDEN,
                         ids=[h[0] + ("-short-last-batch" if h[2] == "short last batch" else "") for h in HIDDEN])
def test_a_smaller_check_misses_it_and_says_what_it_left_out(ran, name, command, note):
    needs_jargon(command)
    r = ran[("hidden", name, command)]
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(line.startswith("check: not exercised:") and note in line for line in r.stdout.splitlines()), \
        r.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name,precision", [("powersgd-no-error-feedback", "bf16"),
                                            ("powersgd-no-error-feedback", "fp16")])
def test_below_fp64_a_layout_held_to_exact_catches_what_its_band_cannot(ran, name, precision):
    """PowerSGD without error feedback in bf16 lies at half its noise band (its projection turns a rounding of the
    gradient into a large change of the compressed one, so a correct run of another layout could land as far):
    on 2 shards of ddp the reference replays the run op for op, so the check holds it to exact (check/band.py),
    and it fails where fp64 names it (fp16: a step later, as its first step overflows at the starting loss scale
    and is skipped, so compression starts a step later)."""
    r = ran[("below", name, precision)]
    output = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 1 and "check: FAIL (bug)" in r.stdout and "held to exact" in r.stdout, output
    step = 4 + (precision == "fp16")
    assert f"check: first divergence: step {step}, rank 0, backward of 13.1 (Linear) weight gradient" in r.stdout, \
        output
