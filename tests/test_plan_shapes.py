"""The planner counts real shapes (issue 35): FFN width, grouped-query attention, SwiGLU, flash attention's
activations, and blocks that the pipeline stages do not divide.

References not written here: the published parameter counts of Llama 2 70B and Llama 3 8B (their model cards:
68,976,648,192 and 8,030,261,248 parameters; paralab's gpt adds biases, two-parameter LayerNorms and a learned
position table, a fraction of a percent), Korthikanti et al. 2022's Table 2 at the default shape (the
published formula paralab's ``calc tp`` prints), and Llama 3 405B's placement of 126 layers on 16 stages (Dubey
et al. 2024, sec. 3.3.2: one fewer on the first and the last stage).
"""
from __future__ import annotations

import pytest

from conftest import run_paralab
from paralab.analysis.plan.workload import gpt_workload, published_block_bytes, stage_blocks
from paralab.analysis.tensor import activation_memory
from paralab.models.gpt import parameter_counts


def test_the_default_shape_is_paralabs_gpt_and_korthikantis_table():
    w = gpt_workload(4, 128, 4, 64, 256)
    assert w.parameters == parameter_counts(4, 128, 64)["total"]
    assert w.describe().startswith("gpt L=4 h=128 a=4 s=64 V=256:")  # nothing beyond the default named
    for t in (1, 2, 4):
        for sp in (False, True):
            for recompute in ("none", "selective", "full"):
                if t == 1 and sp:
                    continue
                assert published_block_bytes(8, 2048, 12288, 96, t, sp, recompute, kv_heads=96,
                                             ffn_hidden=4 * 12288, mlp="gelu", attention="eager") == \
                    pytest.approx(activation_memory(8, 2048, 12288, 96, t, sp, recompute).value, rel=1e-12)


@pytest.mark.parametrize("name,shape,published", [
    ("Llama 2 70B", dict(layers=80, embed=8192, heads=64, kv_heads=8, ffn_hidden=28672, context=4096, vocab=32000),
     68_976_648_192),
    ("Llama 3 8B", dict(layers=32, embed=4096, heads=32, kv_heads=8, ffn_hidden=14336, context=8192, vocab=128256),
     8_030_261_248),
])
def test_grouped_query_swiglu_models_have_their_published_parameters(name, shape, published):
    w = gpt_workload(shape["layers"], shape["embed"], shape["heads"], shape["context"], shape["vocab"],
                     kv_heads=shape["kv_heads"], ffn_hidden=shape["ffn_hidden"], mlp="swiglu")
    extra = w.parameters - published
    # what paralab's gpt has that Llama has not: the learned positions, biases, LayerNorm biases
    h, L = shape["embed"], shape["layers"]
    kv = h * shape["kv_heads"] // shape["heads"]
    ours = shape["context"] * h + L * (2 * h + 2 * kv + 2 * shape["ffn_hidden"] + h + 2 * h) + h
    assert extra == ours, name
    assert abs(extra) / published < 0.006
    plain = gpt_workload(shape["layers"], shape["embed"], shape["heads"], shape["context"], shape["vocab"])
    assert w.parameters != plain.parameters and "G=8" in w.describe() and "swiglu" in w.describe()


def test_flash_attention_keeps_no_scores():
    kw = dict(kv_heads=8, ffn_hidden=14336, mlp="swiglu")
    for s in (2048, 8192, 32768):
        eager = published_block_bytes(1, s, 4096, 32, 8, True, "none", attention="eager", **kw)
        flash = published_block_bytes(1, s, 4096, 32, 8, True, "none", attention="flash", **kw)
        selective = published_block_bytes(1, s, 4096, 32, 8, True, "selective", attention="eager", **kw)
        assert flash < eager and flash > selective  # the log-sum-exp is kept
        assert published_block_bytes(1, 2 * s, 4096, 32, 8, True, "none", attention="flash", **kw) == \
            pytest.approx(2 * flash)  # linear in the sequence: no s x s term
    # grouped-query attention keeps smaller K and V: 2 G / a each instead of 2
    mha = published_block_bytes(1, 4096, 4096, 32, 1, False, "none", kv_heads=32, ffn_hidden=16384, mlp="gelu",
                                attention="flash")
    gqa = published_block_bytes(1, 4096, 4096, 32, 1, False, "none", kv_heads=8, ffn_hidden=16384, mlp="gelu",
                                attention="flash")
    assert mha - gqa == pytest.approx(4096 * 4096 * 4 * (1 - 8 / 32))


def test_tensor_parallelism_keeps_key_value_heads_whole():
    w = gpt_workload(2, 4096, 32, 128, 256, kv_heads=4)
    assert w.tp_options() == [1, 2, 4]


@pytest.mark.parametrize("layers,stages,held", [
    (126, 16, [7] + [8] * 14 + [7]),           # Llama 3 405B (Dubey et al. 2024)
    (61, 16, [3, 3] + [4] * 13 + [3]),         # one fewer on the first, the last, then the second
    (96, 16, [6] * 16),                        # divides: equal
    (5, 4, [1, 1, 2, 1]),
])
def test_blocks_the_stages_do_not_divide_go_to_the_middle(layers, stages, held):
    assert stage_blocks(layers, stages) == held
    w = gpt_workload(layers, 64, 4, 16, 256)
    cut = w.cut(stages)
    assert cut[0][0] == 0 and cut[-1][1] == len(w.units)
    assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
    assert [w.blocks_in(lo, hi) for lo, hi in cut] == held
    assert (w.stages_note(stages) is None) == (layers % stages == 0)
    assert isinstance(w.cut(layers + 1), str)


def test_a_plan_of_a_real_shape_names_its_stages_and_prints_no_command_it_cannot_run():
    r = run_paralab("plan", "--model", "gpt", "--layers", "30", "--embed", "4096", "--heads", "32", "--kv-heads", "8",
                    "--ffn-hidden", "14336", "--mlp", "swiglu", "--attention", "flash", "--context", "4096", "--vocab",
                    "128256", "--workers", "64", "--cluster", "h100-sxm", "--global-batch", "64",
                    "--layout", "dp2 tp8+sp pp4 1f1b m32xb1 zero1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "F=14336 G=8 swiglu flash-attention" in r.stdout
    assert "stages: 4 stages do not divide the 30 blocks: 8 on each, 7 on stages 0, 3" in r.stdout
    assert "run it: none: paralab's gpt builds a GELU MLP" in r.stdout


@pytest.mark.parametrize("argv,says", [
    (["--model", "gpt", "--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
    (["--model", "gpt", "--experts", "4", "--ffn-hidden", "100"], "give their width with --expert-hidden"),
    (["--model", "gpt", "--mlp", "swiglu", "--activations", "paralab"], "--activations paralab counts"),
    (["--model", "vgg11", "--kv-heads", "2"], "shape a gpt; --model vgg11 has none"),
    (["--model", "gpt", "--mlp", "relu"], "--mlp"),
    (["--model", "gpt", "--ffn-hidden", "0"], "--ffn-hidden"),
    (["--model", "gpt", "--shared-experts", "2"], "--shared-experts 2 are a mixture of experts'"),
    (["--model", "gpt", "--experts", "4", "--top-k", "2", "--shared-experts", "-1"], "--shared-experts"),
    (["--model", "gpt", "--experts", "4", "--top-k", "2", "--shared-experts", "1", "--activations", "paralab"],
     "--activations paralab counts"),
    (["--model", "vgg11", "--shared-experts", "1"], "shape a gpt; --model vgg11 has none"),
    (["--model", "vgg11", "--tied-embeddings"], "shape a gpt; --model vgg11 has none"),
    (["--model", "gpt", "--tied-embeddings", "--activations", "paralab"], "--activations paralab counts"),
])
def test_shape_options_that_do_not_fit_are_refused(argv, says):
    r = run_paralab("plan", *argv, "--workers", "8", "--cluster", "h100-sxm")
    assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]
    assert r.stdout == ""


def test_shared_experts_are_counted_as_experts_every_token_runs():
    """S shared experts (DeepSeekMoE's) add S expert MLPs to every block, run by every token: parameters and
    active parameters grow by L S (2 h H + H + h) (GELU), forward FLOPs by twice that per token, the
    published activations by each token's expert input and GELU input and output per shared expert, and
    they are held whole on every rank (tp and ep split them not), as the router is."""
    L, h, a, s, V, E, K, H = 4, 256, 8, 128, 1000, 8, 2, 512
    base = gpt_workload(L, h, a, s, V, experts=E, top_k=K, expert_hidden=H)
    shared = gpt_workload(L, h, a, s, V, experts=E, top_k=K, expert_hidden=H, shared_experts=2)
    one = 2 * h * H + H + h
    assert shared.parameters - base.parameters == L * 2 * one
    assert shared.active_parameters - base.active_parameters == L * 2 * one
    assert shared.model_flops_per_sample() - base.model_flops_per_sample() == pytest.approx(3 * L * 2 * 2 * one * s)
    n = len(base.units)
    (rest0, experts0), (rest1, experts1) = base.held_parameters(0, n, 4, 2), shared.held_parameters(0, n, 4, 2)
    assert experts1 == experts0 and rest1 - rest0 == L * 2 * one  # whole on each of 4 tp and 2 ep ranks
    kept = [w.activation_bytes(1, n - 1, 1, 1, False, "none", 2) for w in (base, shared)]  # the L blocks
    assert kept[1] - kept[0] == pytest.approx(L * s * 2 * (2 * h + 4 * H))  # 16-bit: per token, per shared expert
    assert shared.shape_extras() == " shared-experts=2" and "+ 2 shared" in shared.describe()


def test_eager_attention_pays_for_its_scores_in_memory_bound_time():
    """Eager attention's softmax and dropout read and write the a s^2 scores: memory-bound time flash attention
    does not spend. The same layout is slower eager than flash, by a share of the step that grows with the
    context (the scores grow with s, the matmuls with s and h)."""
    from paralab.analysis.plan import PRESETS, Layout, Setting, predict
    lay = Layout(dp=8, tp=2, pp=1, microbatch=1, microbatches=1)
    share = []
    for s in (2048, 8192):
        eager, flash = (predict(gpt_workload(8, 4096, 32, s, 50257, attention=a), lay, PRESETS["h100-sxm"],
                                Setting(8)) for a in ("eager", "flash"))
        assert eager.step > flash.step and eager.mfu < flash.mfu
        share.append(1 - flash.compute / eager.compute)
    assert 0 < share[0] < share[1]


def test_tied_embeddings_are_one_matrix_on_one_stage_and_a_copy_kept_in_step_across_a_pipeline():
    """--tied-embeddings: the model counts the output layer once (V h fewer parameters). Without a pipeline one
    rank holds one matrix: fewer model states and fewer gradient bytes for data parallelism to move. Across
    stages the last keeps a copy (Megatron-LM's), so its memory is the untied one's, and every step pays one
    all-reduce of that copy's gradient with the first stage (V h / tp elements, 2 ranks) in pp comm."""
    from paralab.analysis.plan import PRESETS, Layout, Setting, predict
    h100, setting = PRESETS["h100-sxm"], Setting(64)
    L, h, a, s_, V = 8, 2048, 16, 2048, 50257
    untied, tied = (gpt_workload(L, h, a, s_, V, tied_embeddings=t) for t in (False, True))
    assert untied.parameters - tied.parameters == V * h == tied.tied_parameters
    assert "tied-embeddings" in tied.describe() and untied.tied_parameters == 0

    one = Layout(dp=8, tp=2, pp=1, microbatch=1, microbatches=8)
    u, t = (predict(w, one, h100, setting) for w in (untied, tied))
    assert t.memory_parts["model_states"] < u.memory_parts["model_states"] and t.dp_total < u.dp_total
    assert t.pp_comm == u.pp_comm == 0

    two = Layout(dp=4, tp=2, pp=2, microbatch=1, microbatches=16, schedule="1f1b")
    u, t = (predict(w, two, h100, setting) for w in (untied, tied))
    assert t.memory_by_rank == u.memory_by_rank  # the last stage's copy is held as the untied layer was
    link = h100.link(two.tp * two.dp * two.pp)
    tie = h100.collective("all_reduce", V * h / two.tp * setting.element, 2, link)
    assert tie > 0 and t.pp_comm - u.pp_comm == pytest.approx(tie) and t.step - u.step == pytest.approx(tie)


def test_a_tied_plan_prints_no_command_paralabs_untied_gpt_would_not_match():
    r = run_paralab("plan", "--model", "gpt", "--layers", "4", "--embed", "256", "--heads", "4", "--context", "256",
                    "--vocab", "50257", "--tied-embeddings", "--workers", "8", "--cluster", "h100-sxm",
                    "--global-batch", "16", "--layout", "dp4 pp2 1f1b m4xb1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tied-embeddings" in r.stdout and "an output layer of its own (untied)" in r.stdout


@pytest.mark.parametrize("context", [1, 3, 7, 2047])
def test_any_context_is_plannable_without_context_parallelism(context):
    """An odd context cannot be cut into 2 cp chunks, which asks nothing of a layout without cp (issue 49: every
    odd context was refused, blaming the global batch)."""
    from paralab.analysis.plan.layouts import enumerate_layouts
    layouts = enumerate_layouts(gpt_workload(4, 128, 4, context, 256), 8, 16, 8)
    assert layouts and all(x.cp == 1 for x in layouts)
    assert {x.tp for x in layouts} == {1, 2, 4} and {x.pp for x in layouts} >= {1, 2, 4}


def test_tensor_parallelism_across_nodes_is_plannable_when_pinned_and_priced_at_the_network():
    """tp 16 on two nodes of 8 (a 3.6B gpt of 32 heads on 64 workers): listed when pinned, not refused blaming
    the batch (issue 49), and its all-reduces priced on the link between nodes."""
    from paralab.analysis.plan import PRESETS, Setting, make_plan
    w = gpt_workload(30, 3072, 32, 2048, 51200)
    cluster = PRESETS["a100-sxm"]
    tp16 = make_plan(w, cluster, Setting(512), 64, fixed={"tp": 16}, top=1).ranked[0]
    tp8 = make_plan(w, cluster, Setting(512), 64, fixed={"tp": 8, "pp": 2}, top=1).ranked[0]
    assert tp16.layout.tp == 16 and tp16.layout.dp * tp16.layout.pp == 4
    assert cluster.link(16) == cluster.link(64) != cluster.link(8)
    assert tp16.tp_comm > tp8.tp_comm * 2  # the same all-reduced activations, over the slower link


@pytest.mark.parametrize("span,inside", [(1, True), (2, True), (4, True), (8, True), (5, False), (6, False),
                                         (16, False), (3, False)])
def test_a_group_is_inside_a_node_only_where_every_group_of_its_span_is(span, inside):
    """Groups of consecutive ranks on nodes of 8: spans dividing 8 stay inside; tp 5 puts ranks 5-9 on two
    nodes, a group of 6 ranks 6-11, so their collectives wait on the network (issue 49)."""
    from paralab.analysis.plan import PRESETS
    c = PRESETS["a100-sxm"]
    assert (c.link(span) == (c.intra_gbps, c.intra_latency_us * 1e-6)) == inside


def test_ulysses_needs_whole_key_value_heads_per_rank():
    """Ulysses's all-to-all gives each cp rank a / (tp cp) query heads and G / (tp cp) key/value heads: with
    G = 4 key/value heads, tp 2 x cp 4 is ring-only (issue 49: it was accepted on the query heads alone)."""
    from paralab.analysis.plan.layouts import enumerate_layouts
    layouts = enumerate_layouts(gpt_workload(4, 1024, 32, 4096, 256, kv_heads=4), 8, 8, 8)
    methods = {(x.tp, x.cp): {y.cp_method for y in layouts if (y.tp, y.cp) == (x.tp, x.cp)}
               for x in layouts if x.cp > 1}
    assert methods[(2, 4)] == {"ring"} and methods[(1, 4)] == {"ring", "all-to-all"}
    assert methods[(2, 2)] == {"ring", "all-to-all"}
