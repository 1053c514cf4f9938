import pytest
import torch
import torch.nn as nn

from paralab.models import MODALITY, MODELS, build_model, count_parameters


@pytest.mark.parametrize("name,expected", [
    ("vgg11", 9_231_114),      # CS744's VGG-11 with BatchNorm
    ("vgg13", 9_416_010),
    ("vgg16", 14_728_266),
    ("vgg19", 20_040_522),
    ("resnet18", 11_173_962),  # CIFAR ResNet-18
    ("vgg16-cs1390", 33_638_218),        # CS1390's torchvision VGG-16, no BatchNorm (its own default)
    ("vgg16-cs1390-pool", 134_301_514),  # with the 7x7 average pool and Linear(25088, 4096)
])
def test_parameter_counts(name, expected):
    assert count_parameters(build_model(name)) == expected


@pytest.mark.parametrize("name", [m for m in MODELS if MODALITY[m] == "image"])
@pytest.mark.parametrize("norm", ["batch", "none"])
def test_flat_units_and_output_shape(name, norm):
    model = build_model(name, width=0.125, norm=norm)
    assert isinstance(model, nn.Sequential)
    # units are applied one after another: running them in order equals the model
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    h = x
    for unit in model:
        h = unit(h)
    assert h.shape == (2, 10)
    assert torch.equal(h, model(x))
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert has_bn == (norm == "batch")


def test_width_scales_channels():
    small = build_model("vgg11", width=0.25)
    assert small[0][0].out_channels == 16
    assert small[-1][-1].in_features == 128
    assert count_parameters(small) < count_parameters(build_model("vgg11")) / 10


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("alexnet")


def test_default_norm_is_the_models_own():
    from paralab.models import DEFAULT_NORM
    assert DEFAULT_NORM["vgg11"] == "batch" and DEFAULT_NORM["vgg16-cs1390"] == "none"
    assert not any(isinstance(m, nn.BatchNorm2d) for m in build_model("vgg16-cs1390-pool", width=0.125).modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in build_model("vgg11", width=0.125).modules())
