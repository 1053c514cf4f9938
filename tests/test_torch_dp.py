"""`torch-dp` (torch.nn.DataParallel): its refusal without a GPU, its rules, and its step's logic on CPU.

The real DataParallel needs CUDA (tests/test_cuda.py runs it there); here the four phases it runs are
replaced by CPU stand-ins that do what they do (chunk, share the parameters, apply, concatenate), so the
step's arithmetic and its spans are checked against one process training the whole batch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paralab.cli import main
from paralab.comm import Comm
from paralab.run.config import RunConfig
from paralab.models import build_model
from paralab.recorder import Recorder
from paralab.strategies.base import Context
from paralab.strategies.torch_dp import TorchDP, refusal


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_before_start_without_cuda(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "torch-dp", "--num-batches", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "torch.nn.DataParallel" in err and "has none" in err and "ddp" in err
    assert not out.exists()  # nothing started, nothing written


def test_rules():
    cfg = RunConfig(strategy="torch-dp", norm="batch", check=False)
    assert "has none" in refusal(cfg, 1, 0)
    assert "drop --device cpu" in refusal(dataclasses.replace(cfg, device="cpu"), 1, 4)
    assert "--workers 1" in refusal(cfg, 2, 4)  # one process, never several
    assert "only 2 GPU(s)" in refusal(dataclasses.replace(cfg, gpus=4), 1, 2)
    assert refusal(cfg, 1, 1) is None and refusal(dataclasses.replace(cfg, gpus=2), 1, 4) is None
    checked = dataclasses.replace(cfg, check=True)
    assert refusal(checked, 1, 1) is None  # one GPU: the reference's arithmetic
    assert "--norm none" in refusal(dataclasses.replace(checked, gpus=2), 1, 4)  # per-GPU BatchNorm
    assert "--norm none" in refusal(checked, 1, 2)  # --gpus 0 = every visible one
    assert refusal(dataclasses.replace(checked, gpus=2, norm="none"), 1, 4) is None


def test_worker_counts_become_gpus():
    cfg = RunConfig(strategy="torch-dp", batch_size=64)
    strong = TorchDP.for_devices(cfg, 4)
    assert (strong.workers, strong.gpus, strong.batch_size) == (1, 4, 64)
    weak = TorchDP.for_devices(dataclasses.replace(cfg, per_worker_batch=32), 4, per_device_batch=32)
    assert (weak.workers, weak.gpus, weak.batch_size, weak.per_worker_batch) == (1, 4, 128, None)


class CPUPhases:
    """What DataParallel's scatter / replicate / parallel_apply / gather do, on CPU: the replicas share
    the module's parameters, so backward sums every chunk's gradient into them (DataParallel's reduce-add)."""

    def __init__(self, n):
        self.devices = [torch.device("cpu")] * n
        self.calls = []

    def scatter(self, x):
        self.calls.append("scatter")
        return list(torch.chunk(x, len(self.devices)))

    def replicate(self, module, n):
        self.calls.append("replicate")
        return [module] * n

    def parallel_apply(self, replicas, chunks):
        self.calls.append("parallel_apply")
        return [m(c) for m, c in zip(replicas, chunks)]

    def gather(self, outputs):
        self.calls.append("gather")
        return torch.cat(outputs)


def _model():
    torch.manual_seed(0)
    return build_model("vgg11", width=0.125, norm="none")


@pytest.mark.parametrize("gpus", [1, 3])
def test_step_equals_one_process_on_the_whole_batch(gpus):
    rec = Recorder(0)
    cfg = RunConfig(strategy="torch-dp", gpus=gpus, norm="none")
    ctx = Context(0, 1, torch.device("cpu"), Comm(rec, 0, 1), rec, "fp32", cfg.strategy_options())
    optim = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    phases = CPUPhases(gpus)
    s = TorchDP(ctx, _model, optim, phases=phases)
    ref = _model()
    ref_opt = optim(list(ref.parameters()))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)
        rec.step = step
        loss = s.train_step(x, y).loss
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    for k, v in ref.state_dict().items():
        assert torch.allclose(s.full_state_dict()[k], v, atol=1e-5), k
    expected = ["scatter"] + (["replicate", "parallel_apply", "gather"] if gpus > 1 else [])
    assert phases.calls == expected * 3
    spans = rec.step_spans(2)
    names = [(sp.category, sp.name) for sp in spans]
    comm = [("comm", n) for n in ("scatter", "replicate", "gather")] if gpus > 1 else [("comm", "scatter")]
    for want in comm + [("compute", "forward"), ("compute", "backward"), ("optimizer", "step")]:
        assert want in names, want
    by_name = {sp.name: sp for sp in spans if sp.category == "comm"}
    assert by_name["scatter"].bytes == 12 * 3 * 32 * 32 * 4
    if gpus > 1:  # the model's state copied to each other GPU
        state = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
        assert by_name["replicate"].bytes == state * (gpus - 1)
        assert by_name["gather"].bytes == 8 * 10 * 4  # the outputs of GPUs 1.. (4 samples each, 10 classes)
    assert s.extra_summary()["data_parallel"]["gpus"] == gpus
