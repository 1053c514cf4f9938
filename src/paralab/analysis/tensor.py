"""Tensor parallelism's cost model: communication, activation memory and FLOPs of the gpt model.

Symbols: b sequences per microbatch, s tokens per sequence, h model width,
a attention heads, L blocks, V vocabulary, t the tp size, e bytes per
element. Each :class:`~paralab.analysis.cost.Formula` carries its source.

- Communication (Shoeybi et al. 2019, sec. 3): a block runs two sharded
  regions (attention, MLP), each entered by ``f`` and left by ``g``: two
  all-reduces of the ``b x s x h`` activation forward (``g``) and two
  backward (``f``). The vocabulary-parallel embedding adds one forward
  all-reduce, the head's ``f`` one backward. Under sequence parallelism
  (Korthikanti et al. 2022, sec. 4.2.2) each all-reduce becomes an all-gather
  plus a reduce-scatter of the same activation: the same bytes per ring.
  The loss adds an all-gather of ``b x s`` log-sum-exps (``t`` of them) and
  an all-reduce of ``b x s`` target logits. Message sizes are what paralab
  records for each call (the full activation).
- Activation memory per block (Korthikanti et al. 2022, Table 2; 16-bit
  activations, dropout masks, no recomputation): no tp ``s b h (34 + 5 a s / h)``;
  tp ``s b h (10 + 24 / t + 5 a s / (h t))``; tp + sequence parallelism
  ``s b h (34 / t + 5 a s / (h t))`` bytes. paralab's gpt has no dropout and
  runs fp32, so its own figures differ; the formula shows what the split buys.
- FLOPs per token (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, app. B):
  ``6 N + 12 L h s`` for a training step (forward + backward), N the
  parameters (embeddings included here: paralab's output layer is untied).
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


def activation_memory(b: int, s: int, h: int, a: int, t: int, sequence_parallel: bool) -> Formula:
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


def flops_per_token(parameters: int, layers: int, h: int, s: int) -> Formula:
    v = 6 * parameters + 12 * layers * h * s
    return Formula("training FLOPs per token (PaLM app. B)", "6 N + 12 L h s",
                   f"6 x {parameters:,} + 12 x {layers} x {h} x {s}", v, "FLOP")


def mfu(tokens_per_second: float, per_token: float, peak_flops: float) -> Formula:
    v = tokens_per_second * per_token / peak_flops
    return Formula("model FLOPs utilisation", "MFU = tokens/s x FLOPs/token / peak FLOP/s",
                   f"MFU = {g(tokens_per_second)} x {g(per_token)} / {g(peak_flops)}", 100 * v, "%")
