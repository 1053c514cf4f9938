"""What is trained, as the planner sees it: units with parameters, FLOPs and activations.

A :class:`Workload` is the model's flat units (as paralab cuts them: a
pipeline stage is a contiguous run of units), each with its parameters, its
forward FLOPs per sample and the elements it hands to the next unit, plus
what only the model knows: how tensor parallelism splits it, what a unit
keeps for its backward, what recomputation costs, and which cuts divide it.

- :func:`gpt_workload`: any gpt shape, counted from the shape
  (``models/gpt.parameter_counts``): nothing is built, so a published shape
  takes no memory. A block's forward is ``2 N_block s + 4 s^2 h`` FLOPs per
  sequence (its matmuls and the attention scores and their weighted sum), the
  head's ``2 (h V + 2 h) s``, the embedding's none: three times the sum is
  ``s (6 N + 12 L h s)``, ``calc tp``'s FLOPs per token times s. Activations
  per block: Korthikanti et al. 2022, Table 2 (``analysis/tensor.py``),
  published for 16-bit activations and scaled by the element size.
  Elementwise kernels (LayerNorms, residual adds, the MLP's activation,
  eager attention's softmax and dropout) as the bytes they move
  (:func:`block_elementwise`), which the planner times at the memory
  bandwidth. Pipeline cuts put ``L / (p v)`` blocks on each stage, the embedding on the
  first, the head on the last; where that does not divide, one fewer on the
  first and the last stage first (:func:`stage_blocks`).
  A mixture of experts (``experts``, ``top_k``, ``expert_hidden``,
  ``capacity_factor``, as ``paralab train`` takes them) replaces every block's
  MLP by a router and E expert MLPs (``models/gpt.moe_parameter_counts``):
  the block holds all E, a token runs the router and K of them (F·K with a
  capacity factor F < 1: the most an expert takes at an even load), so the
  FLOPs, and MFU, are the *active* ones. The MoE layer stays whole on every
  tp rank (its parameters, FLOPs and activations are not divided by tp);
  ``--ep`` divides its experts' parameters (``held_parameters``).
  Tied embeddings (``tied_embeddings``: GPT-2's, GPT-3's, BLOOM's, Megatron-LM's
  default) make the output layer the token table's matrix: the model counts
  it once, and so does a stage that holds both; under pipeline stages the
  last keeps a copy (``Unit.tied_parameters``), as Megatron-LM does, whose
  gradient the planner all-reduces with the first stage's every step.
- :func:`cnn_workload`: a course CNN run at batch 1 and 2 (on the meta device,
  nothing allocated, or on the CPU where it is small: the counts are the same):
  what each unit keeps for backward is counted by the saved-tensor probe,
  convolutions and linears are its FLOPs. Tensor parallelism is not planned for CNNs; any
  number of stages up to the units is a cut (balanced on FLOPs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

RECOMPUTE = ("none", "selective", "full")


def _per_range(method):
    """Keep a :class:`Workload` method's answers on the instance, by its arguments: a search predicts
    thousands of layouts over the same few stage cuts (a Workload is not changed once built)."""
    name = method.__name__

    @functools.wraps(method)
    def cached(self, *args, **kw):
        memo = self.__dict__.get("_answers")
        if memo is None:
            memo = self.__dict__["_answers"] = {}
        key = (name, *args, *sorted(kw.items())) if kw else (name, *args)
        try:
            return memo[key]
        except KeyError:
            memo[key] = answer = method(self, *args, **kw)
            return answer
    return cached


@dataclass(frozen=True)
class Unit:
    name: str
    parameters: int
    forward_flops: float      # per sample (one sequence or one image), forward only
    output_elements: int      # per sample: what crosses a stage boundary after this unit
    kept_elements: float = 0  # per sample, a CNN's: elements kept for backward (the gpt's come from its formula)
    expert_parameters: int = 0   # a MoE block's E experts (in ``parameters``): whole on tp ranks, split over ep
    router_parameters: int = 0   # a MoE block's router (in ``parameters``): whole on every rank
    shared_parameters: int = 0   # a MoE block's shared experts (in ``parameters``): whole on every rank, run by
    #                              every token
    moe_flops: float = 0.0       # per sample, a MoE block's router and experts (in ``forward_flops``): not split by tp
    tied_parameters: int = 0     # the head's, tied embeddings: the token table's matrix (in ``parameters``), a copy
    #                              held only where another stage holds the embedding
    kept_first: float = 0     # per sample, a CNN's: the same when the unit starts a stage (its input received)
    kept_fixed: float = 0     # per microbatch, whatever its size (BatchNorm's statistics), in the chain
    kept_first_fixed: float = 0  # and starting a stage


@dataclass
class Workload:
    name: str
    units: list[Unit]
    tokens_per_sample: int            # s for the gpt, 1 for an image
    kind: str                         # "gpt" or "cnn"
    shape: dict = field(default_factory=dict)  # the gpt's L, h, a, s, V (and a MoE's experts, top_k, ...)
    activations: str = "published"   # the gpt's: Korthikanti's block ("published") or paralab's ("paralab")

    @property
    def parameters(self) -> int:
        """The model's parameters: a tied output layer counted once, with the embedding."""
        return sum(u.parameters - u.tied_parameters for u in self.units)

    @property
    @_per_range
    def tied_parameters(self) -> int:
        """The output layer's parameters that are the embedding's (0 if untied)."""
        return sum(u.tied_parameters for u in self.units)

    def _copy_in(self, lo: int, hi: int) -> int:
        """The tied copy among units ``lo..hi-1``, but where they hold the embedding too (then it is one
        matrix)."""
        return 0 if lo == 0 else sum(u.tied_parameters for u in self.units[lo:hi])

    @property
    @_per_range
    def moe(self) -> dict | None:
        """A mixture of experts' shape (experts, top_k, expert_hidden, capacity_factor, shared_experts), None if
        dense."""
        if not self.shape.get("experts"):
            return None
        return {k: self.shape[k] for k in ("experts", "top_k", "expert_hidden", "capacity_factor",
                                           "shared_experts")}

    @property
    def active_parameters(self) -> int:
        """Parameters a token uses: all but the experts, and K of each block's E experts."""
        if self.moe is None:
            return self.parameters
        experts = sum(u.expert_parameters for u in self.units)
        return self.parameters - experts + experts // self.moe["experts"] * self.moe["top_k"]

    @_per_range
    def rank_flops(self, lo: int, hi: int, t: int, C: int = 1) -> float:
        """Forward FLOPs per sample of units ``lo..hi-1`` on one of ``t`` tp and ``C`` cp ranks: a MoE layer's
        are not split by tp (every tp rank runs it whole); at an even load each ep rank computes as many
        expert rows as its own tokens chose, so ep does not change them."""
        units = self.units[lo:hi]
        if self.moe is None:
            return sum(u.forward_flops for u in units) / (t * C)
        return (sum(u.forward_flops - u.moe_flops for u in units) / t + sum(u.moe_flops for u in units)) / C

    @_per_range
    def matmuls(self, lo: int, hi: int, t: int, C: int, b: int) -> tuple[tuple[float, int], ...]:
        """The weight matmuls of units ``lo..hi-1``' forward on one of ``t`` tp and ``C`` cp ranks, for a
        microbatch of ``b`` (``m = b s / C`` tokens): ``(FLOPs of one, how many)``. A gpt block's query, key
        and value projection (``2 m h (h + 2 kv) / t``), its output projection (``2 m h^2 / t``) and, dense,
        its MLP's matrices (``2 m h F / t`` each: SwiGLU's gate and up as one); the head's output layer
        (``2 m h V / t``). What they leave out of :meth:`rank_flops` (attention's scores, a mixture of
        experts' layer, LayerNorms, a CNN) is timed at the cluster's one ``efficiency``."""
        if self.kind != "gpt":
            return ()
        sh = self.shape
        m, h, F = b * sh["context"] / C, sh["embed"], sh["ffn_hidden"]
        kv = h * sh["kv_heads"] // sh["heads"]
        per_block = [2 * m * h * (h + 2 * kv) / t, 2 * m * h * h / t]
        if self.moe is None:
            per_block += [2 * m * h * F * (2 if sh["mlp"] == "swiglu" else 1) / t, 2 * m * F * h / t]
        blocks = self.blocks_in(lo, hi)
        out = [(f, blocks) for f in per_block] if blocks else []
        if hi == len(self.units):
            out.append((2 * m * h * sh["vocab"] / t, 1))
        return tuple(out)

    @_per_range
    def held_parameters(self, lo: int, hi: int, t: int, ep: int = 1) -> tuple[float, float]:
        """(the rest, experts) of units ``lo..hi-1``'s parameters one rank holds under ``t``-way tensor and
        ``ep``-way expert parallelism: the rest split over tp (as the dense gpt's) but a MoE layer's router and
        shared experts, whole; its routed experts split over ep only."""
        units = self.units[lo:hi]
        whole = sum(u.router_parameters + u.shared_parameters for u in units)
        rest = sum(u.parameters - u.expert_parameters - u.tied_parameters for u in units) - whole
        rest += self._copy_in(lo, hi)
        return rest / t + whole, sum(u.expert_parameters for u in units) / ep

    @_per_range
    def parameters_in(self, lo: int, hi: int) -> int:
        """Parameters of units ``lo..hi-1`` (a tied output layer's copy where they hold no embedding)."""
        return sum(u.parameters - u.tied_parameters for u in self.units[lo:hi]) + self._copy_in(lo, hi)

    @_per_range
    def blocks_in(self, lo: int, hi: int) -> int:
        """Transformer blocks among units ``lo..hi-1``."""
        return sum(1 for u in self.units[lo:hi] if u.name == "block")

    @_per_range
    def units_with_parameters(self, lo: int, hi: int) -> int:
        return sum(1 for u in self.units[lo:hi] if u.parameters)

    @_per_range
    def largest_unit(self, lo: int, hi: int) -> int:
        """The most parameters one unit of ``lo..hi-1`` holds (0 if none)."""
        return max((u.parameters for u in self.units[lo:hi]), default=0)

    def tp_collectives(self, blocks: int) -> int:
        """Activation collectives per microbatch, forward and backward, that ``blocks`` blocks run under tp:
        the attention's and the MLP's (2 + 2); a MoE layer is whole on every tp rank, so only the attention's."""
        return (2 if self.moe else 4) * blocks

    @_per_range
    def elementwise_bytes(self, lo: int, hi: int, t: int, C: int, sp: bool, e: int) -> tuple[float, float]:
        """Bytes one rank's memory-bound (elementwise) kernels move in the forward of one sample through the
        blocks of units ``lo..hi-1`` (:func:`block_elementwise`), and the part of them the attention scores
        take (selective recomputation runs that part again); 0 for a CNN, which the planner counts by FLOPs."""
        if self.kind != "gpt":
            return 0.0, 0.0
        sh, moe = self.shape, self.moe
        width = (moe["top_k"] * min(1.0, moe["capacity_factor"] or 1.0) + moe["shared_experts"]) * \
            moe["expert_hidden"] if moe else sh["ffn_hidden"]
        rest, scores = block_elementwise(sh["context"], sh["embed"], sh["heads"], t, C, sp, e, width=width,
                                         mlp=sh["mlp"], dropout=self.activations == "published", mlp_split=not moe,
                                         # paralab's gpt: PyTorch's fused attention, no dropout
                                         attention=sh["attention"] if self.activations == "published" else "flash")
        blocks = self.blocks_in(lo, hi)
        return blocks * (rest + scores), blocks * scores

    @_per_range
    def model_flops_per_sample(self) -> float:
        """Training FLOPs of one sample without recomputation: forward and twice it backward."""
        return 3 * sum(u.forward_flops for u in self.units)

    def tp_options(self) -> list[int]:
        """Tensor-parallel degrees that split the model: divisors of the heads (gpt); none for a CNN."""
        if self.kind != "gpt":
            return [1]
        a, g = self.shape["heads"], self.shape.get("kv_heads") or self.shape["heads"]
        return [t for t in range(1, a + 1) if a % t == 0 and g % t == 0]  # whole query and key/value heads

    def cut(self, stages: int) -> list[tuple[int, int]] | str:
        """The units of each of ``stages`` contiguous stages, or why this count does not divide the model."""
        n = len(self.units)
        if self.kind == "gpt":
            L = self.shape["layers"]
            if stages > L:
                return f"{stages} stages exceed the {L} blocks"
            ends, at = [], 1
            for held in stage_blocks(L, stages):
                at += held
                ends.append(at)
            starts = [1] + ends[:-1]
            return [(0 if i == 0 else a, n if i == stages - 1 else b) for i, (a, b) in enumerate(zip(starts, ends))]
        if stages > n:
            return f"{stages} stages exceed the {n} units of {self.name}"
        from ...strategies.pipeline.partition import split_costs
        return split_costs([max(u.forward_flops, 1.0) for u in self.units], stages,
                           [u.parameters > 0 for u in self.units])

    @_per_range
    def activation_bytes(self, lo: int, hi: int, b: int, tp: int, sp: bool, recompute: str, e: int,
                         ep: int = 1) -> float:
        """Bytes units ``lo..hi-1`` keep for backward, for one microbatch of ``b`` samples, per tp rank
        (``ep``: a mixture of experts' dispatch across ranks keeps two more index arrays)."""
        if self.kind != "gpt":
            units = self.units[lo:hi]
            kept = sum(u.kept_elements * b + u.kept_fixed for u in units)
            if lo > 0 and units:  # a stage's received input is a tensor of its own
                u = units[0]
                kept += (u.kept_first - u.kept_elements) * b + u.kept_first_fixed - u.kept_fixed
            if recompute == "full":  # only each unit's input kept
                kept = b * sum(self.units[i - 1].output_elements if i else 0 for i in range(lo, hi))
            return kept * e
        sh = self.shape
        s, h, a, V = sh["context"], sh["embed"], sh["heads"], sh["vocab"]
        blocks = self.blocks_in(lo, hi)
        moe = self.moe
        if self.activations == "paralab":
            kept = blocks * paralab_block_elements(b, s, h, a, tp, sp, recompute)
            if hi == len(self.units):  # final LayerNorm's input, output and statistics; the loss's logits
                kept += s * b * ((1 / tp + 1 if sp else 2) * h + V / tp + (2 / tp if sp else 2))
            if moe:  # the MLP's LayerNorm output and GELU input and output, replaced by what the MoE layer keeps
                kept -= blocks * s * b * (h + 8 * h / tp)
                return kept * e + blocks * paralab_moe_bytes(b * s, h, moe, e, ep)
            return kept * e
        per_block = published_block_bytes(b, s, h, a, tp, sp, recompute, kv_heads=sh["kv_heads"],
                                          ffn_hidden=sh["ffn_hidden"], mlp=sh["mlp"], attention=sh["attention"])
        if moe:  # Korthikanti's MLP rows (3 + 16 / t) s b h, replaced by the experts' (16-bit bytes)
            inner = (8 if sh["mlp"] == "swiglu" else 4) * sh["ffn_hidden"] / h
            per_block += published_moe_bytes(b * s, h, moe) - s * b * h * (3 + inner / tp)
        total = blocks * per_block
        if lo == 0:  # the embedding's output (its dropout mask, as published)
            total += s * b * h / tp
        if hi == len(self.units):  # final LayerNorm, output layer input, fp32 logits for the loss
            total += 4 * s * b * h / tp * (1 + V / h)
        return total * e / 2  # published for 16-bit activations

    @_per_range
    def recompute_transient(self, lo: int, hi: int, b: int, tp: int, sp: bool, recompute: str, e: int) -> float:
        """Bytes a recomputing stage holds beyond what it keeps, one unit at a time: a recomputed unit's
        activations (for a gpt block under selective recomputation its attention's, the s x s scores of eager
        attention among them) live from its recomputation through its backward, one block at a time, on top
        of every microbatch's kept activations. The largest unit of ``lo..hi-1``' (0 without recomputation,
        or without a block to recompute)."""
        if recompute == "none" or (self.kind == "gpt" and not self.blocks_in(lo, hi)):
            return 0.0
        if self.kind != "gpt":
            return max((u.kept_elements * b + u.kept_fixed for u in self.units[lo:hi]), default=0) * e
        sh = self.shape
        s, h, a = sh["context"], sh["embed"], sh["heads"]
        if self.activations == "paralab":
            return (paralab_block_elements(b, s, h, a, tp, sp) - paralab_block_elements(b, s, h, a, tp, sp, recompute)) * e
        shape = dict(kv_heads=sh["kv_heads"], ffn_hidden=sh["ffn_hidden"], mlp=sh["mlp"], attention=sh["attention"])
        return (published_block_bytes(b, s, h, a, tp, sp, "none", **shape)
                - published_block_bytes(b, s, h, a, tp, sp, recompute, **shape)) * e / 2

    @_per_range
    def recompute_flops(self, lo: int, hi: int, b: int, recompute: str) -> float:
        """Extra forward FLOPs a microbatch's backward spends recomputing, units ``lo..hi-1``."""
        if recompute == "none":
            return 0.0
        if recompute == "full":
            return b * sum(u.forward_flops for u in self.units[lo:hi] if u.name in ("block", "conv", "linear"))
        s, h = self.shape.get("context", 1), self.shape.get("embed", 1)
        blocks = sum(1 for u in self.units[lo:hi] if u.name == "block")
        return b * blocks * 4 * s * s * h  # selective: the attention scores and their weighted sum again

    def shape_extras(self) -> str:
        """What the gpt's shape holds beyond paralab's own (``gpt_workload``), as `` F=.. G=.. swiglu flash``
        ("": the shape `paralab train` builds, or a CNN)."""
        sh = self.shape
        if self.kind != "gpt":
            return ""
        out = ""
        if sh.get("ffn_hidden", 4 * sh["embed"]) != 4 * sh["embed"]:
            out += f" F={sh['ffn_hidden']}"
        if sh.get("kv_heads", sh["heads"]) != sh["heads"]:
            out += f" G={sh['kv_heads']}"
        out += " swiglu" if sh.get("mlp") == "swiglu" else ""
        out += f" shared-experts={sh['shared_experts']}" if sh.get("shared_experts") else ""
        out += " flash-attention" if sh.get("attention") == "flash" else ""
        out += " tied-embeddings" if sh.get("tied_embeddings") else ""
        return out

    def stages_note(self, stages: int) -> str | None:
        """Where the blocks go when ``stages`` do not divide them (None: they do)."""
        L = self.shape.get("layers", 0)
        if self.kind != "gpt" or not L or L % stages == 0:
            return None
        held = stage_blocks(L, stages)
        k = max(held)
        fewer = [i for i, n in enumerate(held) if n < k]
        return (f"{stages} stages do not divide the {L} blocks: {k} on each, {k - 1} on stage"
                f"{'s' if len(fewer) > 1 else ''} {', '.join(map(str, fewer))} (the first and last hold the "
                "embedding and the output layer besides)")

    def describe(self) -> str:
        if self.kind == "gpt":
            sh, moe = self.shape, self.moe
            if moe:
                cap = f", capacity factor {moe['capacity_factor']:g}" if moe["capacity_factor"] else ""
                return (f"gpt L={sh['layers']} h={sh['embed']} a={sh['heads']} s={sh['context']} V={sh['vocab']}"
                        f"{self.shape_extras()}, MoE E={moe['experts']} top-{moe['top_k']} H={moe['expert_hidden']}{cap}"
                        f"{' + ' + str(moe['shared_experts']) + ' shared' if moe['shared_experts'] else ''}: "
                        f"{self.parameters:,} parameters, {self.active_parameters:,} active per token (FLOPs and "
                        f"MFU count these), activations as {self.activations}")
            return (f"gpt L={sh['layers']} h={sh['embed']} a={sh['heads']} s={sh['context']} V={sh['vocab']}"
                    f"{self.shape_extras()}: {self.parameters:,} parameters, activations as {self.activations}")
        return f"{self.name}: {self.parameters:,} parameters in {len(self.units)} units"


def paralab_block_elements(b: int, s: int, h: int, a: int, t: int, sp: bool, recompute: str = "none") -> float:
    """Elements one block of paralab's gpt keeps for backward, per tp rank (measured by
    ``training/saved.py``'s probe in tests/test_plan.py). Per token: both LayerNorms' inputs and
    outputs (replicated, or under sequence parallelism their inputs split and the gathered outputs that
    the column-parallel projections keep), q, k, v and the attention's output, the MLP's 4h input to GELU
    and its output (split over tp); and per token and LayerNorm its mean and 1/std, per head the
    attention's log-sum-exp. Recomputed (``training/recompute.py``): selective recomputes the attention
    core, whose inputs and output the projections keep anyway, so only the log-sum-exp goes; full keeps
    only the block's input (split under sequence parallelism)."""
    if recompute == "full":
        return s * b * h / (t if sp else 1)
    wide = 2 + 14 / t if sp else 4 + 12 / t
    narrow = (4 / t if sp else 4) + (a / t if recompute == "none" else 0)
    return s * b * (h * wide + narrow)


def kept_choices(tokens: int, moe: dict) -> int:
    """A MoE layer's kept choices (expert rows) for a forward of ``tokens`` tokens at an even load: every
    token's K, or the capacity ``E ceil(F tokens K / E)`` if smaller (``analysis/moe.step_volume``)."""
    from ..moe import step_volume
    return step_volume(tokens, moe["top_k"], moe["experts"], 1, 1, 1, 1, moe["capacity_factor"])["choices"]


def paralab_moe_bytes(tokens: int, h: int, moe: dict, e: int, ep: int = 1) -> float:
    """Bytes paralab's MoE layer (``models/moe.py``) keeps for backward for one forward of ``tokens`` tokens
    at an even load (R kept choices; under ep each rank receives as many rows as it sends), counted by the
    saved-tensor probe in tests/test_plan_moe.py. The router runs in float64: its input and weight copies,
    the probabilities, the top-k margin's difference and minimum (freed only by garbage collection under the
    probe), one aux-loss operand; int64: the top-(K+1) indices, the choices' order and token index (and
    under ep the received rows' order and its inverse); per kept choice, at the element size: the gathered
    token, the expert's GELU input and output (H each), the gated output and the product before the sum,
    and the gate."""
    E, K, H = moe["experts"], moe["top_k"], moe["expert_hidden"]
    R = kept_choices(tokens, moe)
    doubles = h * E + tokens * h + tokens * E + E + (tokens + 1 if K < E else 0)
    indices = tokens * min(K + 1, E) + (2 if ep == 1 else 4) * R
    return 8 * (doubles + indices) + e * R * (3 * h + 2 * H + 1)


def published_moe_bytes(tokens: int, h: int, moe: dict) -> float:
    """A MoE layer's activations in Korthikanti et al.'s terms (16-bit, with a dropout mask; ours, not
    published): the layer's input and the dropout mask as the MLP's (3h bytes per token), the router's
    fp32 probabilities (4E), and per kept choice its expert's input (2h) and GELU input and output (2H
    each), as per token for each shared expert; whole on every tp rank."""
    R = kept_choices(tokens, moe) + tokens * moe.get("shared_experts", 0)
    return tokens * (3 * h + 4 * moe["experts"]) + R * (2 * h + 4 * moe["expert_hidden"])


def gpt_workload(layers: int, embed: int, heads: int, context: int, vocab: int,
                 activations: str = "published", *, experts: int = 0, top_k: int = 1, expert_hidden: int = 0,
                 capacity_factor: float | None = None, ffn_hidden: int = 0, kv_heads: int = 0, mlp: str = "gelu",
                 attention: str = "eager", shared_experts: int = 0, tied_embeddings: bool = False) -> Workload:
    """A gpt of any shape (module docstring). Beyond paralab's own gpt (``models/gpt.py``: a GELU MLP of
    ``4 h``, as many key/value heads as heads), the planner counts: ``ffn_hidden`` (the MLP's width),
    ``kv_heads`` (grouped-query attention: ``G`` key/value heads shared by the ``a`` query heads; 1 is
    multi-query), ``mlp="swiglu"`` (three ``h x F`` matrices, a gate, as Llama's), ``attention="flash"``
    (the s x s scores are never kept, nor passed over by a softmax and dropout of their own: activation
    memory and elementwise time), and a mixture of experts'
    ``shared_experts`` (DeepSeekMoE's: S more experts of ``expert_hidden`` every token runs beside its K
    routed ones, whole on every rank as the router is), and ``tied_embeddings`` (the output layer is the
    token table: module docstring)."""
    L, h, s, V = layers, embed, context, vocab
    F, G = ffn_hidden or 4 * h, kv_heads or heads
    kv = h * G // heads  # the key (and the value) projection's width
    attention_params = 2 * h * h + 2 * h + 2 * (h * kv + kv)   # q and the output projection; k and v
    norms = 4 * h
    from ...models.gpt import parameter_counts
    c = parameter_counts(L, h, s, V)
    shape = dict(layers=L, embed=h, heads=heads, context=s, vocab=V, ffn_hidden=F, kv_heads=G, mlp=mlp,
                 attention=attention, tied_embeddings=tied_embeddings)
    extra = {}
    if experts:
        H = expert_hidden or 4 * h
        one = mlp_parameters(h, H, mlp)
        router, shared = h * experts, shared_experts * one
        rest = attention_params + norms
        block = rest + router + shared + experts * one
        ran = min(1.0, capacity_factor or 1.0) * top_k  # experts a token runs (at most F K under a capacity)
        moe_flops = 2.0 * (router + shared + ran * one) * s
        extra = dict(expert_parameters=experts * one, router_parameters=router, shared_parameters=shared,
                     moe_flops=moe_flops)
        shape |= dict(experts=experts, top_k=top_k, expert_hidden=H, capacity_factor=capacity_factor,
                      shared_experts=shared_experts)
        block_flops = 2.0 * rest * s + moe_flops + 4.0 * s * s * h
    else:
        block = attention_params + norms + mlp_parameters(h, F, mlp)
        block_flops = 2.0 * block * s + 4.0 * s * s * h
    units = [Unit("embedding", c["tokens"] + c["positions"], 0.0, s * h)]
    units += [Unit("block", block, block_flops, s * h, **extra) for _ in range(L)]
    units.append(Unit("head", c["head"], 2.0 * c["head"] * s, s * V,
                      tied_parameters=V * h if tied_embeddings else 0))
    return Workload("gpt", units, s, "gpt", shape, activations)


def block_elementwise(s: int, h: int, a: int, t: int, C: int, sp: bool, e: int, *, width: int, mlp: str,
                      attention: str, dropout: bool, mlp_split: bool = True) -> tuple[float, float]:
    """Bytes one rank's elementwise kernels read and write in one block's forward of one sequence, as
    Megatron-LM fuses them, each reading its inputs and writing its output once (``e`` bytes an element, a
    dropout mask 1 byte a element), as (the rest, the attention scores'):

    - the two LayerNorms: read and write ``s h`` each (4 e s h);
    - the two bias-dropout-residual adds: read the output and the residual, write the sum (and the mask):
      (3 e + 1) s h each, (3 e) without dropout;
    - the MLP's activation: GELU reads and writes its ``s F`` input (2 e s F), SwiGLU reads gate and up and
      writes their product (3 e s F); a mixture of experts' is its kept choices' (``width``: K H);
    - the scores (eager attention): scale-mask-softmax reads and writes ``a s^2`` (2 e), the attention
      dropout reads and writes them with its mask (2 e + 1); flash attention keeps them in the kernel: 0.

    ``dropout`` is Korthikanti et al.'s block (``--activations published``); paralab's own gpt has none, and
    a fused attention.

    Tensor parallelism splits the heads and the MLP's width (a MoE layer, whole on every tp rank, excepted:
    ``mlp_split``); the LayerNorms and the residual adds stay whole unless sequence parallelism splits the
    tokens; context parallelism gives each rank ``s / C`` queries. These are memory-bound: the planner times
    them at the device's memory bandwidth beside the matmuls at their rate (``predict.py``), backward moving
    twice a forward's bytes."""
    tokens = s / C
    norms_and_adds = tokens * h * (4 * e + 2 * (3 * e + (1 if dropout else 0))) / (t if sp else 1)
    activation = tokens * width * (3 if mlp == "swiglu" else 2) * e / (t if mlp_split else 1)
    scores = 0.0 if attention == "flash" else tokens * s * a / t * (2 * e + (2 * e + 1 if dropout else 0))
    return norms_and_adds + activation, scores


def stage_blocks(layers: int, stages: int) -> list[int]:
    """Blocks per stage, in order: ``L / stages`` each where that divides; else ``ceil(L / stages)`` each, one
    fewer on the first stage, then the last, then the second, the second to last, ... until they add up to
    ``L``, as published runs place them (Llama 3 405B: 126 layers on 16 stages, 7 on the first and the last,
    which also hold the embedding and the output layer; Dubey et al. 2024, sec. 3.3.2)."""
    k = -(-layers // stages)
    held = [k] * stages
    for j in range(k * stages - layers):  # fewer than the stages: the j-th from the ends, alternately
        held[j // 2 if j % 2 == 0 else stages - 1 - j // 2] -= 1
    return held


def mlp_parameters(h: int, width: int, mlp: str) -> int:
    """An MLP of ``width`` hidden units, with biases as paralab's gpt has them: GELU's two matrices, or SwiGLU's
    three (gate and up ``h x F``, down ``F x h``)."""
    return 3 * h * width + 2 * width + h if mlp == "swiglu" else 2 * h * width + width + h


def published_block_bytes(b: int, s: int, h: int, a: int, t: int, sp: bool, recompute: str, *, kv_heads: int,
                          ffn_hidden: int, mlp: str, attention: str) -> float:
    """Korthikanti et al. 2022's Table 2 for one block (16-bit activations with dropout masks), its terms
    counted for any shape, per tp rank (``analysis/tensor.activation_memory`` is this at ``4 h``, GELU, as many
    key/value heads as heads and eager attention; tests/test_plan_shapes.py holds them equal). In units of
    ``s b h`` bytes: what stays whole on every tp rank (both LayerNorms' inputs 4, the QKV input 2, the
    attention's dropout mask 1, the MLP's input 2 and its dropout mask 1: 10), what tp splits (Q 2, K and V
    2 G / a each, the output projection's input 2, the MLP's inner activations: GELU's input and output
    ``4 F / h``, SwiGLU's gate, its activation, the up projection and their product ``8 F / h``), and the
    scores: eager keeps the softmax's output, its dropout mask and the dropout's output, ``5 a s / h``;
    flash keeps a log-sum-exp per head and token (fp32), ``4 a / h``. Selective recomputation drops the
    scores; full keeps only the block's input."""
    if recompute == "full":
        return 2 * s * b * h  # as published (sec. 5, Table 2)
    whole = 10.0
    split = 2 + 4 * kv_heads / a + 2 + (8 if mlp == "swiglu" else 4) * ffn_hidden / h
    scores = 0.0 if recompute == "selective" else (4 * a / h if attention == "flash" else 5 * a * s / h)
    if sp:
        return s * b * h * (whole + split + scores) / t
    return s * b * h * (whole + (split + scores) / t)


#: a CNN of at most this many parameters is probed on the CPU (real tensors at batch 1 and 2: 5-7x faster
#: than the meta device, whose BatchNorm is a Python decomposition), a larger one on the meta device
PROBE_ON_CPU_UP_TO = 1_000_000


def cnn_workload(name: str, width: float = 1.0) -> Workload:
    """A course CNN run at batch 1 and 2 (:data:`PROBE_ON_CPU_UP_TO`): per unit, parameters, forward FLOPs, and
    what it keeps for backward, counted by the saved-tensor probe (``training/saved.py``) as the bytes
    autograd holds after the unit, less those before it, in fp32 elements (a max-pool's int64 indices
    count as two), at batch 1 and 2: so much per sample, and so much per microbatch whatever its size
    (BatchNorm's statistics per channel). And the same when the unit starts a pipeline stage, run alone
    on an input of its own: the input it keeps is then a received copy, where in the chain it is often
    the previous unit's output that the previous unit keeps already (a ReLU's), one allocation."""
    import torch
    import torch.nn as nn

    from ...models import build_model
    with torch.device("meta"):
        model = build_model(name, width=width)
    device = "cpu" if sum(p.numel() for p in model.parameters()) <= PROBE_ON_CPU_UP_TO else "meta"
    if device == "cpu":  # the values play no part (only shapes, FLOPs and what autograd keeps): zeros
        model = model.to_empty(device=device)
        for tensor in model.state_dict().values():
            tensor.zero_()
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    units = []
    (one, first_one, outputs), (two, first_two, _) = (_kept_per_unit(model, parameters, b, device) for b in (1, 2))
    for i, unit in enumerate(model):
        flops = 0.0

        def hook(mod, inp, out):
            nonlocal flops
            if isinstance(mod, nn.Conv2d):
                k = mod.weight.shape[1] * mod.weight.shape[2] * mod.weight.shape[3]
                flops += 2.0 * k * out.numel()
            elif isinstance(mod, nn.Linear):
                flops += 2.0 * mod.in_features * out.numel()
        leaves = [m for m in unit.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        with torch.no_grad():
            unit(torch.zeros_like(outputs[i - 1]) if i else torch.zeros(1, 3, 32, 32, device=device))
        for hd in handles:
            hd.remove()
        kind = "conv" if any(isinstance(m, nn.Conv2d) for m in leaves) else \
            "linear" if any(isinstance(m, nn.Linear) for m in leaves) else "other"
        units.append(Unit(kind, sum(p.numel() for p in unit.parameters()), flops, outputs[i].numel(),
                          kept_elements=(two[i] - one[i]) / 4, kept_first=(first_two[i] - first_one[i]) / 4,
                          kept_fixed=(2 * one[i] - two[i]) / 4, kept_first_fixed=(2 * first_one[i] - first_two[i]) / 4))
    return Workload(name, units, 1, "cnn", dict(width=width))


def _kept_per_unit(model, parameters: set[int], batch: int, device: str) -> tuple[list[int], list[int], list]:
    """Bytes each unit keeps for backward at ``batch`` images, in the chain and run alone (a stage's
    first unit; the first unit's are the same), and each unit's output at batch 1."""
    import torch

    from ...training.saved import SavedActivations
    probe, chained, outputs = SavedActivations(parameters), [], []
    x = torch.zeros(batch, 3, 32, 32, device=device)
    with probe.watch():
        for unit in model:
            before = probe.live
            x = unit(x)
            outputs.append(x)  # alive until the end, so nothing the probe counted is let go
            chained.append(probe.live - before)
    alone = chained[:1]
    for i in range(1, len(outputs)):
        received = SavedActivations(parameters)
        with received.watch():
            out = model[i](torch.zeros_like(outputs[i - 1]).requires_grad_())
        alone.append(received.live)
        del out
    return chained, alone, [o[:1] for o in outputs]
