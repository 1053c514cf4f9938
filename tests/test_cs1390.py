"""CS1390's VGG-16 (``vgg16-cs1390``, ``vgg16-cs1390-pool``): parameters, split_vgg16's 13 units,
the boundary shapes of CS1390's communication test, torchvision's forward, and its runs with --check."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from paralab.cli import main
from paralab.errors import UsageError
from paralab.models import build_model, count_parameters
from paralab.strategies.pipeline.partition import analyze_partition, boundary_shapes, partition_model

# CS1390's partitions (split_vgg16's unit counts per worker) for 1..6 workers
PARTITIONS = {1: [13], 2: [5, 8], 3: [2, 3, 8], 4: [2, 2, 3, 6], 5: [1, 2, 2, 3, 5], 6: [1, 1, 2, 2, 2, 5]}
# per-sample output of each of the 13 units at width 1.0 (no average pool)
UNIT_OUTPUTS = [(64, 32, 32), (128, 16, 16), (256, 8, 8), (512, 4, 4), (512, 1, 1), (512,)] + [(4096,)] * 6 + [(10,)]
# what crosses each boundary for a batch of 32, activation forward and gradient back (the same shape)
EXPECTED = {
    1: [],
    2: [(32, 512, 1, 1)],
    3: [(32, 128, 16, 16), (32, 512, 1, 1)],
    4: [(32, 128, 16, 16), (32, 512, 4, 4), (32, 4096)],
    5: [(32, 64, 32, 32), (32, 256, 8, 8), (32, 512, 1, 1), (32, 4096)],
    6: [(32, 64, 32, 32), (32, 128, 16, 16), (32, 512, 4, 4), (32, 512), (32, 4096)],
}


@pytest.fixture(scope="module")
def cs1390():
    torch.manual_seed(0)
    return build_model("vgg16-cs1390", norm="none")


@pytest.fixture(scope="module")
def cs1390_pool():
    torch.manual_seed(0)
    return build_model("vgg16-cs1390-pool", norm="none")


def test_parameter_counts(cs1390, cs1390_pool):
    assert count_parameters(cs1390) == 33_638_218
    assert count_parameters(cs1390_pool) == 134_301_514
    assert count_parameters(build_model("vgg16-cs1390")) == 33_638_218  # the model's own norm: none
    assert not any(isinstance(m, nn.BatchNorm2d) for m in cs1390.modules())


@pytest.mark.parametrize("pool", [False, True])
def test_thirteen_units_as_split_vgg16(cs1390, cs1390_pool, pool):
    model = cs1390_pool if pool else cs1390
    assert isinstance(model, nn.Sequential) and len(model) == 13
    blocks = list(model)[:5]
    assert [sum(isinstance(m, nn.Conv2d) for m in b) for b in blocks] == [2, 2, 3, 3, 3]
    assert not isinstance(blocks[0][0], nn.MaxPool2d)
    assert all(isinstance(b[0], nn.MaxPool2d) for b in blocks[1:])  # the previous block's pool begins each
    assert isinstance(blocks[4][-1], nn.MaxPool2d)
    kinds = [type(u) for u in list(model)[6:]]
    assert kinds == [nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU, nn.Dropout, nn.Linear]
    assert all(u.p == 0 for u in model if isinstance(u, nn.Dropout))  # inactive, as in CS1390's eval mode
    assert model[6].in_features == (25088 if pool else 512)
    shapes = boundary_shapes(model)
    assert shapes[0] == (3, 32, 32)
    assert shapes[1:] == UNIT_OUTPUTS[:5] + [(25088,) if pool else (512,)] + UNIT_OUTPUTS[6:]


@pytest.mark.parametrize("workers", sorted(PARTITIONS))
def test_boundaries_of_cs1390_partitions(cs1390, workers):
    ranges = partition_model(cs1390, workers, PARTITIONS[workers])
    info = analyze_partition(cs1390, ranges, 32)
    assert [b.activation_shape for b in info.boundaries] == EXPECTED[workers]
    assert [b.gradient_shape for b in info.boundaries] == EXPECTED[workers]
    for b in info.boundaries:
        assert b.activation_bytes == b.gradient_bytes == 4 * torch.Size(b.activation_shape).numel()
    assert sum(s.parameters for s in info.stages) == 33_638_218
    # the gradient a stage receives is d loss / d (its input): the shape of what it was sent
    for (a, b), shape in zip(ranges[1:], EXPECTED[workers]):
        x = torch.zeros((2,) + shape[1:], requires_grad=True)
        out = x
        for i in range(a, b):
            out = cs1390[i](out)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert grad.shape == x.shape


def test_partition_command(capsys):
    assert main(["partition", "--model", "vgg16-cs1390", "--norm", "none", "--workers", "6",
                 "--partition", "1,1,2,2,2,5", "--batch-size", "32", "--repeats", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranges"] == [[0, 1], [1, 2], [2, 4], [4, 6], [6, 8], [8, 13]]
    assert [tuple(b["activation_shape"]) for b in data["boundaries"]] == EXPECTED[6]
    assert [tuple(b["gradient_shape"]) for b in data["boundaries"]] == EXPECTED[6]


def torchvision_vgg16(model: nn.Sequential, pool: bool) -> nn.Module:
    """torchvision's VGG-16 (features, avgpool, classifier; dropout 0.5) with ``model``'s weights."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]

    class VGG(nn.Module):
        def __init__(self):
            super().__init__()
            layers, c = [], 3
            for v in cfg:
                if v == "M":
                    layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                else:
                    layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                    c = v
            self.features = nn.Sequential(*layers)
            self.avgpool = nn.AdaptiveAvgPool2d((7, 7)) if pool else nn.Identity()
            self.classifier = nn.Sequential(
                nn.Linear(512 * (49 if pool else 1), 4096), nn.ReLU(True), nn.Dropout(0.5),
                nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(4096, 10))

        def forward(self, x):
            return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

    ref = VGG()
    ours, theirs = list(model.parameters()), list(ref.parameters())
    assert [p.shape for p in ours] == [p.shape for p in theirs]
    with torch.no_grad():
        for p, q in zip(theirs, ours):
            p.copy_(q)
    return ref.eval()  # CS1390 runs its model in evaluation mode


@pytest.mark.parametrize("pool", [False, True])
def test_forward_equals_torchvision_vgg16(cs1390, cs1390_pool, pool):
    model = cs1390_pool if pool else cs1390
    ref = torchvision_vgg16(model, pool)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model.train()  # training mode too: the dropout is inactive
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        h = x
        for unit in model:
            h = unit(h)
        assert torch.equal(h, ref(x))


def test_width_and_norm():
    small = build_model("vgg16-cs1390", width=0.125, norm="none")
    assert small[0][0].out_channels == 8 and small[6].in_features == 64 and small[6].out_features == 512
    assert boundary_shapes(small)[5] == (64, 1, 1)
    bn = build_model("vgg16-cs1390", norm="batch")  # a BatchNorm after every convolution, as vgg16_bn
    assert sum(isinstance(m, nn.BatchNorm2d) for m in bn.modules()) == 13
    assert count_parameters(bn) == 33_638_218 + 2 * (2 * 64 + 2 * 128 + 3 * 256 + 6 * 512)
    with pytest.raises(UsageError, match="--norm must be none"):
        build_model("vgg16-cs1390", norm="group")


# the handout's runs, small width: model (2,3,6 stages' partitions), pipeline with a stage beginning at a
# ReLU (2,2,3,6), and the pooled variant under ddp and fsdp
RUNS = [
    ("model", "vgg16-cs1390", 2, ["--partition", "5,8", "--lr", "1e-3"]),
    ("pipeline", "vgg16-cs1390", 4, ["--partition", "2,2,3,6", "--microbatches", "4", "--lr", "1e-2"]),
    ("ddp", "vgg16-cs1390-pool", 2, ["--lr", "1e-3"]),
    ("fsdp", "vgg16-cs1390-pool", 2, ["--lr", "1e-2"]),
]


@pytest.mark.parametrize("strategy,model,workers,extra", RUNS, ids=[f"{s}-w{w}" for s, _, w, _ in RUNS])
def test_handout_runs_pass_check(paralab, strategy, model, workers, extra):
    r = paralab("train", strategy, "--model", model, "--norm", "none", "--workers", str(workers),
                "--num-batches", "2", "--batch-size", "32", "--check", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout
    assert r.summary["check"]["result"] == "PASS"
