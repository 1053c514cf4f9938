"""Published training runs, each laid out as it was, beside what the planner predicts for that layout.

A run is its model's shape, its cluster, its global batch, the layout it used
(every dimension the planner prints, from the run's own scripts) and the
throughput it reached, each with its source. :func:`against` predicts the
published layout (simulated, as every row a plan shows), gives the ratio of
predicted to published throughput, and ranks the layout twice among every
layout that fits, by the search's first-pass closed forms (like against
like): among all the planner lists, and among those the published system
could run (its ``techniques``: Megatron-LM in 2021 had no sequence
parallelism, selective recomputation, ZeRO or context parallelism).

Every run ties its output layer to the token table (Megatron-LM's default,
kept by BigScience's Megatron-DeepSpeed), so each is planned with
``tied_embeddings``; the parameter counts then agree with the paper's (its
Table 1 names each model by them).

Published throughput is read as the run states it. Narayanan et al. give
TFLOP/s per GPU counted by their eq. 3, `96 B s l h^2 (1 + s/(6h) + V/(16lh))`
FLOPs per iteration (forward, backward and full recomputation), so the
published step is those FLOPs / (TFLOP/s x GPUs); BLOOM's log gives the
iteration time itself. ``bench/published.py`` prints the table docs/plan.md
holds and writes ``bench/results/published-runs.json``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from .plan.cluster import PRESETS, Cluster
from .plan.layouts import Layout, enumerate_layouts
from .plan.predict import Setting, predict
from .plan.search import evaluate, rough_many
from .plan.workload import gpt_workload

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM (arXiv:2104.04473), Table 1: shape, GPUs, batch, TFLOP/s per GPU; the layouts (tensor "
             "and pipeline sizes, microbatch size, layers per virtual stage, recomputation) from Megatron-LM's "
             "examples/sc21/run_table_1.sh; vocabulary 51,200 and sequence 2048 from Megatron-LM's README; "
             "80 GB A100s, 8 per node (README)")
BLOOM = ("BigScience tr11-176B-ml: train/tr11-176B-ml/tr11-176B-ml.slurm in bigscience-workshop/bigscience "
         "(TP 4, PP 12, micro-batch 2, global batch 2048, 70 layers, hidden 14336, 112 heads, sequence 2048, "
         "vocabulary padded to 250,880, bf16, ZeRO stage 0 whose bf16 optimizer shards its states as ZeRO-1 "
         "does, --checkpoint-activations, 48 nodes); chronicles.md: iteration 12695 at global batch 2048, "
         "105.22 s per iteration, 149.02 TFLOP/s per GPU; README.md: 8 A100 80GB per node, 4 Omni-Path links")

#: Megatron-LM in 2021 ran data, tensor and pipeline parallelism (1F1B or interleaved) with full recomputation
MEGATRON_2021 = dict(cp=1, sp=False, zero=0, recompute="full"), ("1f1b", "interleaved-1f1b")
#: Megatron-DeepSpeed for BLOOM: the same, with the bf16 optimizer's sharded states and DeepSpeed's 1F1B
DEEPSPEED_2022 = dict(cp=1, sp=False, zero=1, replicate=1, recompute="full"), ("1f1b",)

#: Jean Zay's A100 partition as BLOOM's README describes it: 4 Omni-Path links (100 Gb/s each) per node of 8
#: (examples/clusters/jean-zay-a100.toml is the same cluster as a file, for the command the page prints)
JEAN_ZAY = replace(PRESETS["a100-sxm"], name="jean-zay-a100", inter_gbps=4 * 100 / 8,
                   source="A100 80GB as the a100-sxm preset; between nodes 4 Omni-Path links of 100 Gb/s per 8 "
                          "GPUs (BLOOM's README: '4 OmniPath links'; 100 Gb/s is Omni-Path's link rate), so 50 Gb/s "
                          "per GPU")


@dataclass(frozen=True)
class Run:
    name: str
    layers: int
    embed: int
    heads: int
    vocab: int
    workers: int
    global_batch: int
    layout: str               # as the planner writes it
    source: str
    tflops: float             # published TFLOP/s per GPU
    step: float | None = None  # published seconds per iteration, where the run states it
    context: int = 2048
    cluster: Cluster = field(default_factory=lambda: PRESETS["a100-sxm"])
    techniques: tuple = MEGATRON_2021

    def eq3_flops(self) -> float:
        """Narayanan et al.'s eq. 3: FLOPs per iteration with full recomputation."""
        b, s, l, h, v = self.global_batch, self.context, self.layers, self.embed, self.vocab
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def published_step(self) -> float:
        return self.step if self.step is not None else self.eq3_flops() / (self.tflops * 1e12 * self.workers)

    def command(self) -> str:
        """The `paralab plan` command that evaluates this run's layout (from the repository's root)."""
        cluster = self.cluster.name if self.cluster.name in PRESETS else f"examples/clusters/{self.cluster.name}.toml"
        return (f"paralab plan --model gpt --layers {self.layers} --embed {self.embed} --heads {self.heads} "
                f"--context {self.context} --vocab {self.vocab} --workers {self.workers} --cluster {cluster} "
                f"--tied-embeddings --global-batch {self.global_batch} --layout \"{self.layout}\"")


def _table1(name, heads, h, layers, workers, batch, tflops, layout) -> Run:
    return Run(name, layers, h, heads, 51200, workers, batch, layout, NARAYANAN, tflops)


RUNS: list[Run] = [
    _table1("GPT 1.7B", 24, 2304, 24, 32, 512, 137, "dp32 m1xb16 rc-full"),
    _table1("GPT 3.6B", 32, 3072, 30, 64, 512, 138, "dp32 tp2 m1xb16 rc-full"),
    _table1("GPT 7.5B", 32, 4096, 36, 128, 512, 142, "dp32 tp4 m1xb16 rc-full"),
    _table1("GPT 18.4B", 48, 6144, 40, 256, 1024, 135, "dp32 tp8 m4xb8 rc-full"),
    _table1("GPT 39.1B", 64, 8192, 48, 512, 1536, 138, "dp32 tp8 pp2 1f1b m12xb4 rc-full"),
    _table1("GPT 76.1B", 80, 10240, 60, 1024, 1792, 140, "dp32 tp8 pp4 interleaved-1f1b v3 m28xb2 rc-full"),
    _table1("GPT 145.6B", 96, 12288, 80, 1536, 2304, 148, "dp24 tp8 pp8 interleaved-1f1b v2 m48xb2 rc-full"),
    _table1("GPT 310.1B", 128, 16384, 96, 1920, 2160, 155, "dp15 tp8 pp16 interleaved-1f1b v2 m144xb1 rc-full"),
    _table1("GPT 529.6B", 128, 20480, 105, 2520, 2520, 163, "dp9 tp8 pp35 interleaved-1f1b v3 m280xb1 rc-full"),
    _table1("GPT 1008B", 160, 25600, 128, 3072, 3072, 163, "dp6 tp8 pp64 1f1b m512xb1 rc-full"),
    Run("BLOOM 176B", 70, 14336, 112, 250880, 384, 2048, "dp8 tp4 pp12 1f1b m128xb2 zero1 rc-full", BLOOM,
        149.02, step=105.22, cluster=JEAN_ZAY, techniques=DEEPSPEED_2022),
]


def workload(run: Run):
    return gpt_workload(run.layers, run.embed, run.heads, run.context, run.vocab, "published", tied_embeddings=True)


def setting(run: Run) -> Setting:
    return Setting(run.global_batch, "mixed", "adam")


def predicted(run: Run) -> dict:
    """The published layout predicted (simulated): its step, memory, and the throughput ratio."""
    x = predict(workload(run), Layout.parse(run.layout), run.cluster, setting(run))
    return {"run": run.name, "layout": run.layout, "predicted_step": x.step, "published_step": run.published_step(),
            "ratio": run.published_step() / x.step, "memory_gb": x.memory / 1e9, "fits": x.fits, "mfu": x.mfu}


def against(run: Run) -> dict:
    """:func:`predicted`, with the layout's rank among every layout that fits and among those the published
    system could run (closed forms against closed forms), and the search's first row."""
    work, cfg = workload(run), setting(run)
    got = evaluate(work, run.cluster, cfg, run.workers, Layout.parse(run.layout))
    pins, schedules = run.techniques
    theirs = [x for x in enumerate_layouts(work, run.workers, run.global_batch, run.cluster.devices_per_node,
                                           fixed=pins) if x.schedule in (None, *schedules)]
    rough = sorted(step for step, _, fits, _ in rough_many(work, theirs, run.cluster, cfg) if fits)
    first = got.plan.ranked[0]
    return predicted(run) | {
        "rank": got.rank_all, "fitting": got.plan.fitting, "top_percent": got.top_percent,
        "rank_theirs": bisect.bisect_left(rough, got.rough_step) + 1, "fitting_theirs": len(rough),
        "first": first.layout.label(), "first_step": first.step, "first_mfu": first.mfu,
        "source": run.source, "command": run.command()}
