"""The gpt model: flat units, causal, GPT-2 initialisation, shape checks."""
import pytest
import torch
import torch.nn as nn

from paralab.models import build_model, count_parameters
from paralab.models.gpt import Block, gpt


def test_units_and_shapes():
    model = build_model("gpt", layers=2, heads=2, embed=32, context=16)
    assert isinstance(model, nn.Sequential) and len(model) == 4  # embedding, 2 blocks, head
    x = torch.randint(0, 256, (3, 16))
    h = x
    for unit in model:
        h = unit(h)
    assert h.shape == (3, 16, 256)
    assert torch.equal(h, model(x))


def test_parameter_count_formula():
    # embeddings V*D + T*D; per block 2 LayerNorms (4D) + q,k,v,proj (4D^2+4D) + MLP (8D^2+5D); head LN 2D + D*V
    L, D, T, V = 3, 48, 20, 256
    expected = V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D + D * V
    assert count_parameters(gpt(L, 4, D, T)) == expected


def test_causal():
    """Changing a later token never changes an earlier position's logits."""
    torch.manual_seed(0)
    model = gpt(2, 2, 32, 16).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    a, b = model(x), model(y)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_residual_projections_scaled():
    torch.manual_seed(0)
    model = gpt(8, 4, 256, 16)
    block = model[1]
    assert isinstance(block, Block)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)  # 0.02 / sqrt(2 * 8)
    assert block.attn.q.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(block.ln1.weight == 1) and torch.all(block.attn.q.bias == 0)


def test_heads_must_divide_embed():
    with pytest.raises(ValueError, match="divisible"):
        gpt(1, 3, 32, 8)
