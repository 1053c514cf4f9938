"""Activation recomputation (training/recompute.py) on one process: gradients bit-identical to none,
BatchNorm statistics updated once, dropout masks drawn again identically, a zero-bubble stage's
input/weight split, backward FLOPs (FlopCounterMode) and saved bytes (saved_tensors_hooks) against
their formulas. Every strategy's ``--check`` with it: tests/test_recompute_runs.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from paralab.analysis.plan.workload import gpt_workload
from paralab.analysis.tensor import gpt_saved_bytes
from paralab.models import build_model
from paralab.training import recompute
from paralab.training.losses import cross_entropy

B, S, H, A, L = 4, 16, 32, 4, 2
SHAPE = dict(layers=L, embed=H, heads=A, context=S)


def batch(name: str, dtype=torch.float32, n: int = B, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return torch.randint(0, 256, (n, S), generator=g), torch.randint(0, 256, (n, S), generator=g)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (n,), generator=g)


def model(name: str, dtype=torch.float32, mode: str = "none") -> nn.Sequential:
    torch.manual_seed(0)
    m = build_model(name, **(SHAPE if name == "gpt" else dict(width=0.125))).to(dtype)
    return recompute.apply(m, mode)


def train(m: nn.Module, name: str, dtype, steps: int = 4) -> nn.Module:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(name, dtype, seed=step)
        opt.zero_grad()
        cross_entropy(m(x), y).backward()
        opt.step()
    return m


@pytest.mark.parametrize("name", ["gpt", "vgg11"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_weights_and_buffers_bit_identical_to_no_recompute(name, dtype, mode):
    """The same steps with and without recomputation: every parameter and every BatchNorm statistic
    (running mean, variance, batches tracked: not updated twice by the recompute) equal to the bit."""
    plain, again = train(model(name, dtype), name, dtype), train(model(name, dtype, mode), name, dtype)
    a, b = plain.state_dict(), again.state_dict()
    assert a.keys() == b.keys()  # the class swap keeps every name
    assert any("running_mean" in k for k in a) == (name == "vgg11")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_recompute_classes():
    full, sel = model("gpt", mode="full"), model("gpt", mode="selective")
    assert all(isinstance(u, recompute.RecomputedUnit) for u in full)
    assert not any(isinstance(u, recompute.RecomputedUnit) for u in sel)
    assert all(isinstance(u.attn, recompute.RecomputedCore) for u in list(sel)[1:-1])
    vgg = model("vgg11", mode="selective")  # the parameter-free units: the pools
    assert [isinstance(u, recompute.RecomputedUnit) for u in vgg] == [isinstance(u, nn.MaxPool2d) for u in vgg]
    assert recompute.apply(full, "full") is full and type(full[1]).__mro__.count(recompute.RecomputedUnit) == 1


class Noisy(nn.Module):
    """A unit with dropout inside: its recompute must draw the same mask."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x))) * 2


def test_dropout_mask_is_drawn_again_identically():
    def run(mode):
        torch.manual_seed(0)
        m = recompute.apply(nn.Sequential(Noisy(), Noisy(), nn.Linear(8, 2)), mode)
        x = torch.randn(16, 8)
        torch.manual_seed(1)
        m(x).square().sum().backward()
        after = torch.rand(3)  # the generator stands where it would without recomputation
        return [p.grad for p in m.parameters()], after
    (g0, r0), (g1, r1) = run("none"), run("full")
    assert all(torch.equal(a, b) for a, b in zip(g0, g1)) and torch.equal(r0, r1)
    assert g0[0].abs().sum() > 0


def test_without_the_rng_restore_the_masks_differ(monkeypatch):
    """The test above can fail: a recompute that draws fresh masks gives other gradients."""
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    torch.manual_seed(0)
    m = recompute.apply(nn.Sequential(Noisy(), nn.Linear(8, 2)), "full")
    plain = copy.deepcopy(m)
    for u in plain:
        u.__class__ = u.__class__.__mro__[2]  # the unit's own class again
    x = torch.randn(16, 8)
    for net in (plain, m):
        torch.manual_seed(1)
        net(x).square().sum().backward()
    assert not torch.equal(plain[0].fc.weight.grad, m[0].fc.weight.grad)


def test_zero_bubble_split_input_then_weight():
    """A zero-bubble stage asks for the input gradient first (graph kept), the weights' later: the
    recompute runs again for W, and both equal a whole backward without recomputation."""
    x, y = batch("gpt")
    grads = {}
    for mode in ("none", "full", "selective"):
        m = model("gpt", mode=mode)
        h = m[0](x).detach().requires_grad_()
        out = cross_entropy(m[3](m[2](m[1](h))), y)
        (gi,) = torch.autograd.grad(out, h, retain_graph=True)
        params = [p for u in list(m)[1:] for p in u.parameters()]
        torch.autograd.backward(out, inputs=params)
        grads[mode] = [gi] + [p.grad for p in params]
    for mode in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[mode])), mode


SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _sdpa_cpu(query, key, value, *args, out_shape=None, **kwargs) -> int:  # the fused CPU kernel, unknown
    return flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def flops(name: str, mode: str) -> tuple[int, int]:
    """(forward, backward) FLOPs of one step, the fused CPU attention counted as sdpa."""
    mapping = {SDPA_CPU: _sdpa_cpu, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
               _sdpa_cpu_backward}
    m, (x, y) = model(name, mode=mode), batch(name)
    with FlopCounterMode(display=False, custom_mapping=mapping) as f:
        loss = cross_entropy(m(x), y)
    forward = f.get_total_flops()
    with FlopCounterMode(display=False, custom_mapping=mapping) as f:
        loss.backward()
    return forward, f.get_total_flops()


@pytest.mark.parametrize("name", ["gpt", "vgg11"])
def test_backward_flops_full_is_backward_plus_one_forward(name):
    (f0, b0), (f1, b1) = flops(name, "none"), flops(name, "full")
    assert f0 == f1 and b1 == b0 + f0  # every unit's forward again, exactly once
    if name == "gpt":  # every matmul's backward is two of its size: 2x forward, 3x with the recompute
        mm = f0 - L * 4 * B * S * S * H  # the attention core's backward is not 2x its forward
        assert b0 - flops_sdpa_backward() == 2 * mm


def flops_sdpa_backward() -> int:
    shape = (B, A, S, H // A)
    return L * flop_counter.sdpa_backward_flop_count(shape, shape, shape, shape)


def test_backward_flops_selective_is_the_planners_attention_core():
    """Selective: backward + the attention cores' forward (4 b s^2 h per block), what the planner's
    ``recompute_flops`` predicts."""
    (f0, b0), (f1, b1) = flops("gpt", "none"), flops("gpt", "selective")
    w = gpt_workload(L, H, A, S, 256)
    predicted = w.recompute_flops(0, len(w.units), B, "selective")
    assert predicted == L * 4 * B * S * S * H and b1 - b0 == predicted and f1 == f0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", recompute.MODES)
def test_saved_bytes_match_the_formula(mode, dtype):
    """What autograd keeps (distinct storages, parameters left out) equals ``gpt_saved_bytes``,
    the formula ``calc tp`` prints, byte for byte."""
    m, (x, y) = model("gpt", dtype, mode), batch("gpt")
    with recompute.measure_saved(m) as meter:
        cross_entropy(m(x), y)
    assert meter.bytes == gpt_saved_bytes(B, S, H, A, L, mode, dtype.itemsize).value


def test_full_keeps_less_than_selective_less_than_none():
    kept = {}
    for mode in recompute.MODES:
        m, (x, y) = model("vgg11", mode=mode), batch("vgg11")
        with recompute.measure_saved(m) as meter:
            cross_entropy(m(x), y)
        kept[mode] = meter.bytes
    assert kept["full"] < kept["selective"] < kept["none"]


def test_no_grad_forward_is_plain():
    m, (x, _) = model("gpt", mode="full"), batch("gpt")
    with torch.no_grad():
        assert torch.equal(m(x), model("gpt")(x))


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        recompute.apply(model("gpt"), "some")


@pytest.mark.parametrize("args,message", [
    (["--recompute", "some"], "--recompute"),
    (["--recompute", "full", "--model", "gpt", "--experts", "2", "--dataset", "synthetic-text"], "--experts"),
])
def test_bad_recompute_exits_2(paralab, args, message):
    r = paralab("train", "ddp", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_plan_command_carries_recompute():
    from paralab.analysis.plan.layouts import Layout
    from paralab.run.config import RunConfig
    for rc in ("none", "selective", "full"):
        command = Layout(dp=2, tp=1, pp=1, microbatch=4, microbatches=1, recompute=rc).command(2)
        assert ("--recompute" in command) == (rc != "none")
        words = command.split()[2:]  # what `paralab train` reads back
        assert RunConfig.from_argv(words).recompute == rc


@pytest.mark.parametrize("name", ["gpt", "vgg11"])
def test_full_keeps_what_pytorchs_checkpoint_keeps(name):
    """PyTorch's built-in (``torch.utils.checkpoint``, non-reentrant, around each unit) beside ours: the same
    saved bytes and the same gradients."""
    from torch.utils.checkpoint import checkpoint
    x, y = batch(name)
    ours, theirs = model(name, mode="full"), model(name)
    with recompute.measure_saved(ours) as a:
        loss_a = cross_entropy(ours(x), y)
    with recompute.measure_saved(theirs) as b:
        h = x
        for unit in theirs:
            h = checkpoint(unit, h, use_reentrant=False)
        loss_b = cross_entropy(h, y)
    loss_a.backward()
    loss_b.backward()
    assert a.bytes == b.bytes
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_pipeline_forwards_whose_backward_comes_next_keep_everything():
    """The executor's ``backward_next``: 1F1B's and ZB-H1's last stage (each F then its B or I) skip the
    recompute; GPipe (backward in microbatch order: F3 is followed by B0) and a first stage never do."""
    from paralab.strategies.pipeline.executor import backward_next
    from paralab.strategies.pipeline.schedules import build_schedule

    def skipped(name, rank, p=2, m=4):
        acts = list(build_schedule(name, p, m)[rank])
        return sorted(acts[n].microbatch for n in backward_next(acts))
    assert skipped("1f1b", 1) == [0, 1, 2, 3] and skipped("1f1b", 0) == []
    assert skipped("gpipe", 1) == [] and skipped("gpipe", 0) == []
    assert skipped("zb-h1", 1) == [0, 1, 2, 3]
