"""A router's near-ties below fp64 (check/routing.py): the reference takes the run's choice of experts where the
run's own scores explain it, and says where it did not. In one process; the runs that met such ties are in
tests/test_fp16.py and tests/test_first_divergence.py."""
import copy
from types import SimpleNamespace

import torch
import torch.nn as nn

from paralab.check.routing import Following, Recording, Routes, followed_line, not_followed_line
from paralab.models.moe import MoE, route
from paralab.training import step as steps


def test_a_choice_given_to_route_is_gated_by_its_own_scores():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    r = route(probs, 2, None, torch.float64, choose=lambda p, expert: expert.flip(1))
    assert r.expert.tolist() == [[1, 0], [2, 1]]
    assert r.gate.tolist() == [[0.3, 0.5], [0.3, 0.6]]
    assert r.stats["min_margin"] == 0.3 - 0.2  # the forward's own scores' margin, whoever chose


def _following():
    return Following(Routes(), nn.Sequential())


def test_a_near_tie_is_followed_and_a_choice_the_run_s_scores_do_not_explain_is_not():
    ref = torch.tensor([[0.4, 0.3, 0.2999999, 0.0000001],   # experts 1 and 2 within 1e-7
                        [0.7, 0.2, 0.05, 0.05],
                        [0.5, 0.25, 0.249, 0.001]], dtype=torch.float64)
    run = ref + torch.tensor([[0, -5e-7, 5e-7, 0], [0, 0, 0, 0], [1e-6, 0, 0, -1e-6]], dtype=torch.float64)
    chose = run.topk(2).indices.clone()
    assert chose[0].tolist() == [0, 2]  # the run's scores crossed the tie
    chose[2] = torch.tensor([0, 2])     # and a choice no score of its explains (other tokens'): 2 below 1 by 1e-3
    following = _following()
    layer = SimpleNamespace(layer=1, training=True)
    following.routes.add([{(3, 1, 8): (run, chose)}])
    with steps.entered(steps.Step(index=3, first=8)):
        used = following(layer, ref, ref.topk(2).indices)
    assert used.tolist() == [[0, 2], [0, 1], [0, 1]]  # the tie the run's, the rest the reference's own
    assert [f[:3] for f in following.followed] == [(4, 1, 1)]
    assert [f[:3] for f in following.not_followed] == [(4, 1, 1)]
    gap, twice = following.not_followed[0][3:]
    assert abs(gap - 1e-3) < 1e-12 and abs(twice - 2e-6) < 1e-12
    assert "step 4 block 1: 1" in followed_line(following.followed)
    # a step's block said once over its forwards (two shards here), its tokens added
    assert "at 3 token(s) " in followed_line(following.followed * 3) and "step 4 block 1: 3)" in \
        followed_line(following.followed * 3)
    assert "step 4, block 1" in not_followed_line(following.not_followed)
    # a copy of the reference's model (the replay's module outputs) follows alike and counts nothing
    twin = copy.deepcopy(following)
    with steps.entered(steps.Step(index=3, first=8)):
        assert twin(layer, ref, ref.topk(2).indices).tolist() == used.tolist()
    assert twin.routes is following.routes and not twin.followed and len(following.followed) == 1
    following.routes.forget_before(4)
    assert following.routes.forwards == {}
    # another forward (step, block or rows) or an evaluation's: its own choice
    with steps.entered(steps.Step(index=3, first=0)):
        assert following(layer, ref, ref.topk(2).indices).tolist() == [[0, 1], [0, 1], [0, 1]]
    with steps.entered(steps.Step(index=3, first=8)):
        assert following(SimpleNamespace(layer=1, training=False), ref, ref.topk(2).indices)[0].tolist() == [0, 1]


def test_a_reference_layer_follows_a_run_layer_whose_input_moved_by_rounding():
    torch.manual_seed(0)
    ref = MoE(8, 4, 2, 16, None, aux_loss_coef=0.01)
    run = copy.deepcopy(ref)
    recording = Recording([run])
    # every token on the plane where experts 1 and 2 score alike: a tie the run's moved input decides
    apart = (ref.router.weight[2] - ref.router.weight[1]).detach()
    x = torch.randn(2, 16, 8)
    x = x - (x @ apart)[..., None] * apart / (apart @ apart)
    with steps.entered(steps.Step(index=0)):
        run(x + 1e-3 * torch.randn_like(x))  # the run's input, a rounding away
        taken = recording.take()
        assert len(taken) == 1 and recording.take() == {}
        own = ref(x)
        following = Following(Routes(), ref)
        following.routes.add([taken])
        followed = ref(x)
    (_, run_choice), = taken.values()
    logits = x.reshape(-1, 8).double() @ ref.router.weight.double().t()
    own_choice = logits.softmax(-1).topk(2).indices
    flipped = int((own_choice != run_choice).any(1).sum())
    assert flipped > 0 and sum(f[2] for f in following.followed) == flipped and not following.not_followed
    # the layer's output under the run's choice: each token's experts the run's, gated by the reference's scores
    ref.aux_loss = None
    forced = copy.deepcopy(ref)
    forced.choose = lambda module, probs, expert: run_choice
    with steps.entered(steps.Step(index=0)):
        assert torch.equal(followed, forced(x)) and not torch.equal(followed, own)
