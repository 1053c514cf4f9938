"""What a rank measures it holds (run/held.py, training/saved.py): saved activations and model states."""
from __future__ import annotations

import torch
from torch import nn

from paralab.run import held
from paralab.training import saved


def net(d: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))


def test_saved_activations_are_counted_once_per_storage_until_backward_frees_them():
    model, x = net(), torch.randn(8, 16)
    probe = saved.SavedActivations(held.parameter_storages([model]))
    with probe.watch():
        loss = model(x).square().sum()
    # the first Linear keeps x, ReLU keeps its output, which the second Linear keeps too (one storage),
    # and square keeps its input: three [8, 16] fp32 tensors; the weights are not activations
    assert probe.peak == probe.live == 3 * 8 * 16 * 4
    assert probe.tensors == 4  # four saves, three allocations
    loss.backward()
    del loss
    assert probe.live == 0


def test_the_probe_changes_no_gradient_and_sees_through_an_inner_hook():
    model, x = net(), torch.randn(8, 16, dtype=torch.float64)
    model.double()
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    probe, inner = saved.SavedActivations(held.parameter_storages([model])), []
    with probe.watch():
        outer_pack, outer_unpack = saved.outer_hooks()

        def pack(t):  # a hook of one's own (as a pipeline stage has) passing each save on
            inner.append(t.shape)
            return outer_pack(t)
        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
            out = model(x).sum()
    out.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    # the inner hook saw every save; the probe left out the second Linear's weight (the first's is not
    # saved: its input needs no gradient)
    assert len(inner) == 4 and probe.tensors == 3


def test_model_states_count_what_the_strategy_reaches():
    class Holder:
        def __init__(self):
            self.model = net()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            self.bucket = torch.zeros(100)

    h, reference = Holder(), net()  # a model the holder does not reach is not counted
    grads = held.Gradients([h], [h.optimizer])
    h.model(torch.randn(4, 16)).sum().backward()
    h.optimizer.step()
    states = held.model_states([h], [h.optimizer]) | {"gradients": grads.close()}
    p = sum(q.numel() for q in h.model.parameters()) * 4
    assert states == {"parameters": p, "gradients": p, "optimizer": p, "other": 400}
    assert reference is not None
