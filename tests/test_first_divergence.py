"""The first divergence (check/diverge.py): a failed --check replays the run and names the first step, rank,
module and direction that differ from the reference. Seeded bugs are named where they act in
tests/test_mutants.py (FIRST) and tests/test_own_strategy.py; here: the slice a rank holds is found, a correct
layout replayed shows no divergence (--replay replays a passing run), and the option turns it off."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import precision_args, run_paralab, selected, two_at_a_time
from paralab.check.diverge import DIRECTIONS, Finding, deviation, plain_name
from paralab.strategies.context.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
GPT = ["--model", "gpt", "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "4",
       "--context", "16", "--batch-size", "8", "--num-batches", "2", "--eval-batches", "1", "--check"]
CNN = ["--workers", "2", "--dataset", "synthetic", "--width", "0.125", "--num-batches", "3", "--batch-size", "32",
       "--eval-batches", "1", "--check"]


def test_a_rank_output_is_compared_with_the_slice_at_its_own_coordinate():
    whole = torch.arange(2 * 8 * 6, dtype=torch.float64).reshape(2, 8, 6)
    sizes = {"tp": 2, "cp": 1}
    # tensor parallelism: the features' second half on tp rank 1; its first half there is a difference
    assert deviation(whole[..., 3:], whole, {"tp": 1, "cp": 0}, sizes) == 0.0
    assert deviation(whole[..., :3], whole, {"tp": 1, "cp": 0}, sizes) == 3.0
    # a balanced context split: cp rank 0 of 2 holds the sequence's quarters 0 and 3
    held = torch.cat([whole[:, 0:2], whole[:, 6:8]], 1)
    assert deviation(held, whole, {"tp": 0, "cp": 0}, {"tp": 1, "cp": 2}) == 0.0
    # chunks dealt for packed documents (quarters 0 and 2 on cp rank 0): the rank's layout of the step maps them
    dealt = Layout(8, 2, assignment=((0, 2), (1, 3)))
    held = torch.cat([whole[:, 0:2], whole[:, 4:6]], 1)
    assert deviation(held, whole, {"cp": 0}, {"cp": 2}, dealt) == 0.0 and deviation(held, whole, {"cp": 0}, {"cp": 2}) > 0
    # what maps to no slice is not compared (an expert's routed tokens)
    assert deviation(torch.zeros(5, 6), whole, {"tp": 0}, sizes) is None


def test_findings_sort_by_when_they_happen_and_wrappers_are_unnamed():
    later = Finding(1, 1, 0, 0, "3.out", "Linear", "weight gradient", 1.0)
    earlier = Finding(1, 0, 7, 1, "1.attn.proj", "Linear", "output", 1e-3)
    assert min(later, earlier) is earlier and DIRECTIONS[earlier.direction] == "forward"
    assert earlier.line() == "first divergence: step 1, rank 1, forward of 1.attn.proj (Linear) output, max |d| 0.001"
    assert plain_name("module.blocks.0._checkpoint_wrapped_module.attn") == "blocks.0.attn"


LAYOUTS = {
    "tp+sp": ("tp", "--workers", "2", "--sequence-parallel"),
    "pp 1f1b": ("ddp", "--workers", "2", "--pp", "2", "--microbatches", "2"),
    "cp ring": ("ddp", "--workers", "2", "--cp", "2"),
    # 512 tokens a step: in fp16 rounding crosses a router's near-tie within 8 steps, which the references take as
    # the run chose it (a replay once named step 8's MoE output, 15.8 times its band, at this layout)
    "ep": ("ddp", "--workers", "2", "--experts", "4", "--ep", "2", "--top-k", "2", "--context", "32",
           "--batch-size", "16"),
    "torch-tp+sp": ("torch-tp", "--workers", "2", "--sequence-parallel"),
    "zero-3": ("fsdp", "--workers", "2", "--zero-stage", "3"),
    "recompute": ("ddp", "--workers", "2", "--recompute", "full", "--dropout", "0.1"),
    # ZeRO-1 steps a shard and gathers the others' into a flat buffer the models do not hold: the probe's
    # step must be undone there too (it once was not, and the replay named the loss of a correct run)
    "zero-1": ("fsdp", "--workers", "2", "--zero-stage", "1"),
    "hsdp": ("fsdp", "--workers", "4", "--zero-stage", "2", "--replicate", "2"),
    "accumulate": ("ddp", "--workers", "2", "--accumulate", "2"),
    "interleaved": ("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "interleaved-1f1b",
                    "--virtual-stages", "2", "--layers", "4"),
    "zb-h1": ("pipeline", "--workers", "2", "--microbatches", "4", "--schedule", "zb-h1"),
    "ulysses": ("cp", "--workers", "2", "--cp-method", "all-to-all"),
    # packed documents: step 2's chunks are dealt otherwise than the head + tail pairing (the replay once
    # compared them with the pairing's and named a divergence of correct code)
    "cp dealt": ("cp", "--workers", "2", "--dataset", "synthetic-docs", "--packing", "--context", "64",
                 "--doc-length", "5"),
    "torch-fsdp x tp": ("torch-fsdp", "--workers", "4", "--tp", "2"),
    "dp x tp x pp": ("ddp", "--workers", "4", "--tp", "2", "--pp", "2", "--microbatches", "2"),
    "recipe": ("ddp", "--workers", "2", "--clip-grad", "0.05", "--optimizer", "adamw", "--lr", "0.01"),
    # PowerSGD from the first step: the probed step's Q, error feedback and count are put back (the replay once
    # skipped --compress, since a probed step advanced them twice)
    "powersgd": ("ddp", "--workers", "2", "--compress", "powersgd", "--powersgd-start-iter", "0"),
    # ... and each of a rank's stages' compressors (a pipeline's data-parallel flavours, one per virtual stage)
    "powersgd x interleaved": ("ddp", "--workers", "4", "--pp", "2", "--schedule", "interleaved-1f1b",
                               "--virtual-stages", "2", "--microbatches", "4", "--layers", "4", "--compress",
                               "powersgd", "--powersgd-start-iter", "0"),
}
FAST = ("tp+sp", "pp 1f1b", "zero-1")


#: below fp64 each replayed quantity is judged by its own noise band: correct layouts, 8 steps, stay inside
#: (fp16: a pipeline's microbatches, whose float16 weight gradients sum over fewer rows than one process's
#: whole batch, once made the reference overflow where the run did not and the check say bug at step 8); experts
#: at top-2, whose near-ties the references take as the run chose them (check/routing.py; a tie chosen otherwise
#: by rounding was once named at the MoE's output)
BELOW_FP64 = [("tp+sp", "bf16"), ("pp 1f1b", "fp16"), ("cp ring", "fp32"), ("hsdp", "fp32"), ("accumulate", "fp16"),
              ("ep", "fp16")]


def replay_command(name: str, precision: str) -> tuple:
    layout = LAYOUTS[name]
    below = (*precision_args(precision), "--num-batches", "8") if precision != "fp64" else ()
    return ("train", layout[0], *GPT, *layout[1:], "--replay", *below)


@pytest.fixture(scope="module")
def replayed(request, tmp_path_factory):
    """The selected replays, two at a time: (layout, precision) -> its run."""
    jobs = [(p["name"], "fp64") for p in selected(request, "test_a_correct_layout_replayed_shows_no_divergence")]
    jobs += [(p["name"], p["precision"])
             for p in selected(request, "test_a_correct_layout_replayed_below_fp64_stays_inside_its_bands")]
    root = tmp_path_factory.mktemp("replayed")
    runs = two_at_a_time(lambda i, job: run_paralab(*replay_command(*job), out=root / f"run{i}"), jobs)
    return dict(zip(jobs, runs))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_a_correct_layout_replayed_shows_no_divergence(replayed, name):
    r = replayed[(name, "fp64")]
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check: first divergence: none in 2 replayed steps" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("name,precision", [pytest.param(*c, marks=() if c == BELOW_FP64[0] else pytest.mark.slow)
                                            for c in BELOW_FP64], ids=lambda v: v)
def test_a_correct_layout_replayed_below_fp64_stays_inside_its_bands(replayed, name, precision):
    r = replayed[(name, precision)]
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    line = r.summary["check"]["first_divergence"]
    assert line.startswith("first divergence: none in 8 replayed steps"), line
    worst = line.split("the worst at ")[1].split(" of it")[0] if "the worst at" in line else "0"
    assert 0 <= float(worst) < 1, line


def test_no_first_divergence_leaves_the_replay_out(tmp_path):
    r = run_paralab("train", str(ROOT / "examples" / "strategies" / "forgot_to_average.py"), *CNN,
                    "--no-first-divergence", out=tmp_path / "run")
    assert r.returncode == 1 and "check: FAIL" in r.stdout
    assert "first divergence" not in r.stdout and "first_divergence" not in r.summary["check"]


def test_the_replay_puts_back_the_gradients_a_step_starts_with():
    """The replay takes each step twice (probed, then for real) and puts back every tensor the probe wrote, the
    gradients a parameter holds when the step starts too: a strategy that wrongly keeps a gradient from one step
    to the next (it never clears ``.grad``) then steps for real on what it would have held, so the replay sees
    it where the run first differs (the next step's gradients), not in this step's update doubled (issue 47)."""
    from types import SimpleNamespace
    from paralab.check.diverge import step_twice
    from paralab.training import step as steps

    class KeepsGradients:
        def __init__(self):
            torch.manual_seed(0)
            self.model = torch.nn.Linear(3, 2).double()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def full_state_dict(self):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

        def run_step(self, x, y):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()  # accumulates into .grad, which the bug never clears
            self.optimizer.step()
            return SimpleNamespace(loss=loss.item())

    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    replayed, plain = KeepsGradients(), KeepsGradients()
    for _ in range(2):
        _, _, _, after = step_twice(steps.Step(x=x, y=y), replayed, [replayed.model], [replayed.optimizer])
        plain.run_step(x, y)
        assert all(torch.equal(after[k], v) for k, v in plain.full_state_dict().items())
        assert torch.equal(replayed.model.weight.grad, plain.model.weight.grad)


def test_the_probe_reads_a_gradient_exactly_beside_a_large_weight():
    """The replay reads a rank's whole gradient from ``full_state_dict`` after a step whose optimizers are
    replaced by ``w = -g``: exact in float32 where ``w - g`` would round a small gradient to a large weight's
    precision (and a tensor no optimizer stepped reads no gradient)."""
    from types import SimpleNamespace
    from paralab.check.diverge import step_twice
    from paralab.training import step as steps

    class Plain:
        def __init__(self):
            torch.manual_seed(0)
            self.model = torch.nn.Linear(3, 2)
            with torch.no_grad():
                self.model.weight.mul_(1e4)
            self.optimizer = torch.optim.SGD([self.model.weight], lr=0.1)  # the bias is never stepped

        def full_state_dict(self):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

        def run_step(self, x, y):
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y) * 1e-6
            loss.backward()
            self.optimizer.step()
            return SimpleNamespace(loss=loss.item())

    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    run = Plain()
    expected = Plain()
    torch.nn.functional.cross_entropy(expected.model(x), y).mul(1e-6).backward()
    _, gradients, _, _ = step_twice(steps.Step(x=x, y=y), run, [run.model], [run.optimizer])
    assert torch.equal(gradients["weight"], expected.model.weight.grad)
    w, g = expected.model.weight.detach(), expected.model.weight.grad
    assert not torch.equal(w - (w - g), g)  # what ``w -= g`` would have read
    assert torch.equal(gradients["bias"], torch.zeros(2))


def test_a_replay_that_cannot_fit_beside_the_run_is_not_looked_for():
    """Every local rank trains a reference of its own in the replay (below fp64 four: the band's too) beside the
    run's state: where that is more than the memory free, the replay is declined, saying what to change."""
    from types import SimpleNamespace
    from paralab.run.config import replay_too_large
    cfg = SimpleNamespace(precision="fp32", optimizer="sgd", momentum=0.9, device="cpu", backend="gloo", workers=2,
                          world_size=None)
    gib = 2 ** 30
    # CS1390's VGG-16 (134M parameters) in fp32 over 2 local ranks: a rank's reference and band hold weights,
    # gradients and momentum in float32 three times and in float64 once, beside the whole model built again
    why = replay_too_large(cfg, 134_000_000, available=8 * gib)
    assert why is not None and "each of the 2 local rank(s)" in why and "--replay" in why
    said = float(why.split(" beside the run, ")[1].split(" GiB")[0])
    assert said == pytest.approx(2 * 134e6 * (3 * (4 + 4 + 4 + 8) + 4) / gib, abs=0.05)
    assert replay_too_large(cfg, 134_000_000, available=64 * gib) is None
    # in fp64 one reference a rank, in float64: 2 x 134M x (3 x 8 + 8) bytes, 8.0 GiB
    fp64 = SimpleNamespace(**{**vars(cfg), "precision": "fp64"})
    assert replay_too_large(fp64, 134_000_000, available=7 * gib) is not None
    assert replay_too_large(fp64, 134_000_000, available=9 * gib) is None
