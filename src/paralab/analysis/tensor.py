"""Tensor parallelism's cost model: communication, activation memory and FLOPs of the gpt model.

Symbols: b sequences per microbatch, s tokens per sequence, h model width,
a attention heads, L blocks, V vocabulary, t the tp size, e bytes per
element. Each :class:`~paralab.analysis.cost.Formula` carries its source.

- Communication (Shoeybi et al. 2019, sec. 3): per block two sharded regions
  (attention, MLP), each entered by ``f`` and left by ``g``: two all-reduces
  of the ``b x s x h`` activation forward and two backward; the vocabulary-
  parallel embedding and the head add one each. Under sequence parallelism
  (Korthikanti et al. 2022, sec. 4.2.2) each all-reduce is an all-gather plus
  a reduce-scatter: the same bytes per ring. The loss adds two small ones.
- Activation memory per block (Korthikanti et al. 2022, Table 2; 16-bit
  activations, dropout masks): none ``s b h (34 + 5 a s / h)``, tp
  ``s b h (10 + 24 / t + 5 a s / (h t))``, tp + sp ``s b h (34 / t + 5 a s /
  (h t))``; selective recomputation drops the ``5 a s / h`` attention terms
  (sec. 5), full recomputation keeps the block's input, ``2 s b h``. The model
  (sec. 4.3): L blocks, plus the embedding's dropout mask ``s b h / t`` and
  the final LayerNorm, output layer and fp32 loss ``4 s b h / t (1 + V / h)``.
  paralab's gpt runs fp32 without dropout: the formulas show what each buys.
- FLOPs per token for training (Kaplan et al. 2020 sec. 2.1; Narayanan et al.
  2021 sec. 5.1, eq. 3 without recomputation): ``6 N + 12 L h s``, N the
  parameters that multiply a matrix: the blocks and the output projection
  (untied here, a matmul), not the token and position tables (lookups).
  MFU = tokens per second x FLOPs per token / peak FLOP/s.
"""
from __future__ import annotations

from .cost import Formula, fmt_bytes, g


def tp_messages(b: int, s: int, h: int, layers: int, t: int, sequence_parallel: bool, e: int = 4) -> dict:
    """Per microbatch (forward + backward): ``{span name: (calls, bytes)}`` as paralab records them."""
    act = b * s * h * e
    n = 2 * layers + 1  # sharded regions' entries (blocks + head) = their exits (blocks + embedding)
    if sequence_parallel:
        msgs = {"sp_all_gather": (n, n * act), "sp_reduce_scatter": (n, n * act),
                "sp_reduce_scatter_backward": (n, n * act), "sp_all_gather_backward": (n, n * act),
                # replicated parameters used on sequence shards: their gradients summed by f
                # (per block 2 LayerNorms + 2 row-parallel biases; the head's LayerNorm; the positions)
                "tp_f_backward": (6 * layers + 3, (6 * layers + 2) * h * e + s * h * e)}
    else:
        msgs = {"tp_g_forward": (n, n * act), "tp_f_backward": (n, n * act)}
    msgs["vocab_lse_all_gather"] = (1, t * b * s * e)
    msgs["vocab_target_all_reduce"] = (1, b * s * e)
    return msgs


def tp_communication(b: int, s: int, h: int, layers: int, t: int, sequence_parallel: bool, e: int = 4) -> Formula:
    msgs = tp_messages(b, s, h, layers, t, sequence_parallel, e)
    count = sum(c for c, _ in msgs.values())
    total = sum(size for _, size in msgs.values())
    # ring bytes: 4L + 2 activation all-reduces, or as many all-gather + reduce-scatter pairs (the same bytes)
    wire = 2 * (t - 1) / t * (4 * layers + 2) * b * s * h * e
    if sequence_parallel:
        formula = "per block: 2 all-gathers + 2 reduce-scatters forward, the same backward, of b s h e bytes each"
    else:
        formula = "per block: 2 all-reduces (g) forward + 2 (f) backward of b s h e bytes each"
    return Formula("tensor-parallel communication per microbatch", formula,
                   f"b={b} s={s} h={h} e={e}: {b * s * h * e:,} B per activation message, L={layers} blocks "
                   f"(+ embedding, head, 2 small loss collectives)", total, "B",
                   note=f"{count} collective calls; activation bytes each rank sends on a ring: {fmt_bytes(wire)}",
                   parts={"messages": msgs, "calls": count, "wire_bytes": wire})


RECOMPUTE = ("none", "selective", "full")


def activation_memory(b: int, s: int, h: int, a: int, t: int, sequence_parallel: bool,
                      recompute: str = "none") -> Formula:
    """Korthikanti et al. 2022, Table 2: bytes one block keeps for its backward, per rank."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} (got {recompute!r})")
    if recompute != "none":
        return _recomputed(b, s, h, t, sequence_parallel, recompute)
    if t == 1:
        f, sub = "s b h (34 + 5 a s / h)", f"{s} x {b} x {h} x (34 + 5 x {a} x {s} / {h})"
        v = s * b * h * (34 + 5 * a * s / h)
    elif sequence_parallel:
        f, sub = "s b h (34 / t + 5 a s / (h t))", f"{s} x {b} x {h} x (34 / {t} + 5 x {a} x {s} / ({h} x {t}))"
        v = s * b * h * (34 / t + 5 * a * s / (h * t))
    else:
        f, sub = "s b h (10 + 24 / t + 5 a s / (h t))", \
            f"{s} x {b} x {h} x (10 + 24 / {t} + 5 x {a} x {s} / ({h} x {t}))"
        v = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    label = "no tensor parallelism" if t == 1 else f"tp {t}" + (" + sequence parallelism" if sequence_parallel else "")
    return Formula(f"activation memory per block per rank, {label} (Korthikanti et al. 2022, Table 2)", f, sub, v, "B",
                   note="16-bit activations with dropout masks, as published; paralab's gpt is fp32 without dropout")


def _recomputed(b: int, s: int, h: int, t: int, sequence_parallel: bool, recompute: str) -> Formula:
    if recompute == "full":
        f, sub, v = "2 s b h", f"2 x {s} x {b} x {h}", 2 * s * b * h
        why = "full recomputation: only the block's 16-bit input is kept (sec. 5, Table 2)"
    elif t == 1:
        f, sub, v = "34 s b h", f"34 x {s} x {b} x {h}", 34 * s * b * h
    elif sequence_parallel:
        f, sub, v = "34 s b h / t", f"34 x {s} x {b} x {h} / {t}", 34 * s * b * h / t
    else:
        f, sub, v = "s b h (10 + 24 / t)", f"{s} x {b} x {h} x (10 + 24 / {t})", s * b * h * (10 + 24 / t)
    if recompute == "selective":
        why = "selective recomputation: the attention scores, softmax and its dropout recomputed (sec. 5)"
    label = "no tensor parallelism" if t == 1 else f"tp {t}" + (" + sequence parallelism" if sequence_parallel else "")
    return Formula(f"activation memory per block per rank, {label}, {recompute} recomputation "
                   "(Korthikanti et al. 2022, Table 2)", f, sub, v, "B", note=why)


def activation_total(b: int, s: int, h: int, a: int, layers: int, t: int, sequence_parallel: bool,
                     recompute: str = "none", vocab: int = 256) -> Formula:
    """The whole model's activations on one rank (Korthikanti et al. 2022, sec. 4.3, no pipeline: p = 1):
    L blocks, the input embedding's dropout mask, the final LayerNorm, the output layer and the loss."""
    block = activation_memory(b, s, h, a, t, sequence_parallel, recompute).value
    ends = s * b * h / t + 4 * s * b * h / t * (1 + vocab / h)
    return Formula(f"activation memory of the model per rank, {recompute} recomputation "
                   "(Korthikanti et al. 2022, sec. 4.3)", "L x per block + s b h / t + 4 s b h / t (1 + V / h)",
                   f"{layers} x {g(block)} + {s} x {b} x {h} / {t} + 4 x {s} x {b} x {h} / {t} x (1 + {vocab} / {h})",
                   layers * block + ends, "B", parts={"per_block": block, "blocks": layers * block, "ends": ends},
                   note="ends: embedding dropout mask, final LayerNorm and output layer inputs, fp32 logits for "
                        "the loss, divided by t as published (with sequence parallelism)")


def gpt_saved_bytes(b: int, s: int, h: int, a: int, layers: int, recompute: str = "none", e: int = 4,
                    vocab: int = 256) -> Formula:
    """What paralab's own gpt keeps for backward on one process (no tensor parallelism), counted by
    ``saved_tensors_hooks`` in tests/test_recompute.py: Korthikanti et al.'s 16 s b h activations per
    block without their dropout masks, in ``e``-byte elements, with the fused CPU attention's log-sum-exp
    (``a s b``) in place of the ``5 a s^2 b`` scores, and the LayerNorms' means and reciprocal deviations
    (``4 s b``). Ends: the token ids and positions (int64), the head's LayerNorm (input and statistics)
    and output-layer input, the loss's log-softmax (``s b V``), targets and weight."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)} (got {recompute!r})")
    sb, sbh = s * b, s * b * h
    if recompute == "full":  # each unit keeps its input: the ids, every block's input, the head's input
        block, f = e * sbh, "e s b h"
        ends = 8 * 2 * sb + e * (sbh + sb * vocab + 1)
    else:
        block = e * (16 * sbh + 4 * sb + (a * sb if recompute == "none" else 0))
        f = "e (16 s b h + 4 s b" + (" + a s b)" if recompute == "none" else ")")
        ends = 8 * (2 * sb + s) + e * (2 * sbh + 2 * sb + sb * vocab + 1)
    return Formula(f"bytes paralab's gpt keeps for backward, {recompute} recomputation (measured by the tests)",
                   f"L x {f} + ends", f"{layers} x {g(block)} + {g(ends)}", layers * block + ends, "B",
                   parts={"per_block": block, "blocks": layers * block, "ends": ends},
                   note="fp32 (e=4) or fp64 (e=8), no dropout; selective drops the attention core's log-sum-exp "
                        "(its output is kept as the projection's input): the fused kernel keeps no a s^2 b scores")


def flops_per_token(parameters: int, layers: int, h: int, s: int, what: str = "") -> Formula:
    """``6 N + 12 L h s`` (Kaplan et al. 2020; Narayanan et al. 2021): N the parameters that multiply a
    matrix; ``what`` says what N counts."""
    v = 6 * parameters + 12 * layers * h * s
    return Formula("training FLOPs per token (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3)",
                   "6 N + 12 L h s", f"6 x {parameters:,} + 12 x {layers} x {h} x {s}", v, "FLOP",
                   note=what, parts={"N": parameters})


def gpt_flops_per_token(layers: int, h: int, s: int, vocab: int) -> Formula:
    """The gpt's ``6 N + 12 L h s``: N its parameters less the token and position embedding tables
    (lookups, no FLOPs); the untied output projection stays (a ``h x V`` matmul per token)."""
    from ..models.gpt import parameter_counts
    c = parameter_counts(layers, h, s, vocab)
    n = c["total"] - c["tokens"] - c["positions"]
    return flops_per_token(n, layers, h, s,
                           f"N = {n:,}: the blocks and the untied output projection, without the embedding "
                           f"tables ({c['total']:,} parameters - {vocab} x {h} tokens - {s} x {h} positions)")


def mfu(tokens_per_second: float, per_token: float, peak_flops: float) -> Formula:
    v = tokens_per_second * per_token / peak_flops
    return Formula("model FLOPs utilisation", "MFU = tokens/s x FLOPs/token / peak FLOP/s",
                   f"MFU = {g(tokens_per_second)} x {g(per_token)} / {g(peak_flops)}", 100 * v, "%")
