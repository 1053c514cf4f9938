"""A strategy from the user's own file (issue 37): examples/strategies/ written as a student would, each run as
paralab runs its own (``--check``, records, composition), the buggy one FAILing; files that break the
contract refused before any rank starts, naming the line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_paralab
from paralab.cli import main
from paralab.models import build_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "strategies"
CNN = ["--workers", "2", "--dataset", "synthetic", "--width", "0.125", "--num-batches", "3", "--batch-size", "32",
       "--eval-batches", "1", "--check"]


@pytest.mark.parametrize("name", ["gather_scatter", "allreduce", "bucketed_ddp"])
def test_each_example_passes_the_check(tmp_path, name):
    r = run_paralab("train", str(EXAMPLES / f"{name}.py"), *CNN, out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.summary["check"]["max_weight_dev"] == 0.0  # the same arithmetic as the reference's mean
    assert r.summary["strategy"] == str(EXAMPLES / f"{name}.py")


def test_the_example_that_forgets_to_average_fails(tmp_path):
    r = run_paralab("train", str(EXAMPLES / "forgot_to_average.py"), *CNN, out=tmp_path / "run")
    assert r.returncode == 1 and "check: FAIL" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert {"weights", "loss"} <= set(r.summary["check"]["failed"])
    # replayed: the first gradient backward meets (the classifier's) is twice the reference's, at the first step
    line = r.summary["check"]["first_divergence"]
    assert line.startswith("first divergence: step 1, rank 0, backward of 13.1 (Linear) weight gradient"), line
    assert f"check: {line}" in r.stdout


def test_the_bucketed_example_overlaps_its_all_reduces_with_backward(tmp_path, capsys):
    r = run_paralab("train", str(EXAMPLES / "bucketed_ddp.py"), *CNN, out=tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    spans = r.rows("spans.jsonl")
    assert any(s["category"] == "comm" and s["args"].get("async") for s in spans)  # timed by paralab's comm
    # plotted as paralab's own runs are: its async all-reduces in the timeline, its comm in the split
    for kind, want in (("timeline", "async"), ("split-time", "bucketed_ddp.py w2")):
        assert main(["plot", kind, str(tmp_path / "run")]) == 0
        assert want in capsys.readouterr().out


def test_every_example_is_short_and_defines_its_strategy_first():
    import ast
    for path in EXAMPLES.glob("*.py"):
        tree = ast.parse(path.read_text())
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        assert classes and classes[0].bases[0].id in ("Replicas", "Strategy"), path
        # a flavour in under 60 lines; a whole step (the parameter server) in under 90
        assert len(path.read_text().splitlines()) <= (60 if classes[0].bases[0].id == "Replicas" else 90), path


@pytest.mark.slow
def test_an_own_strategy_composes_with_tensor_parallelism(tmp_path):
    r = run_paralab("train", str(EXAMPLES / "bucketed_ddp.py"), "--workers", "4", "--tp", "2", "--model", "gpt",
                    "--dataset", "synthetic-text", "--layers", "2", "--embed", "32", "--heads", "4", "--context", "16",
                    "--batch-size", "16", "--num-batches", "3", "--eval-batches", "1", "--check", out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


BAD = {
    "syntax.py": ("class A(Replicas)\n    pass\n", "syntax.py:1: the file does not parse"),
    "raises.py": ("import torch\n\nx = 1\nraise RuntimeError('boom')\n", "raises.py:4: importing the file failed: "
                                                                        "RuntimeError: boom"),
    "empty.py": ("X = 1\n", "empty.py defines no class"),
    "plain.py": ("class Mine:\n    pass\n", "plain.py:1: Mine is not a paralab strategy"),
    "nofinish.py": ("from paralab.strategies.replicas import Replicas\n\n\nclass Lazy(Replicas):\n    pass\n",
                    "nofinish.py:4: Lazy does not define finish()"),
    # a whole Strategy (a parameter server, say) with a train step alone: refused before start, every missing
    # method named, where it used to train and then die in the checkpoint with a bare NotImplementedError
    "server.py": ("from paralab.strategies.base import Strategy\n\n\nclass Server(Strategy):\n"
                  "    def train_step(self, x, y):\n        raise AssertionError('never reached')\n\n"
                  "    def predict(self, x):\n        return None\n",
                  "server.py:4: Server subclasses Strategy but does not define full_state_dict(), state_dict(), "
                  "load_state_dict(), portable(): a run is checked and exported with full_state_dict(), checkpoints "
                  "with state_dict(), resumes with load_state_dict(), checks its optimizer state (every rank's state "
                  "put together) with portable()"),
}


def test_a_parameter_server_written_as_a_whole_strategy_passes_in_fp64_and_resumes_into_ddp(tmp_path):
    """examples/strategies/parameter_server.py: the server steps alone and sends the weights back; at 3 workers
    (33 samples: shards of 11) its check passes, and its checkpoint resumes under ddp, checked again."""
    common = ["--workers", "3", "--dataset", "synthetic", "--width", "0.125", "--batch-size", "33",
              "--eval-batches", "1", "--check", "--precision", "fp64", "--lr", "0.1", "--momentum", "0.9"]
    first = run_paralab("train", str(EXAMPLES / "parameter_server.py"), *common, "--num-batches", "2",
                        out=tmp_path / "ps")
    assert first.returncode == 0 and "check: PASS" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    then = run_paralab("train", "ddp", *common, "--num-batches", "3", "--resume", str(tmp_path / "ps"),
                       out=tmp_path / "ddp")
    assert then.returncode == 0 and "check: PASS" in then.stdout, then.stdout[-3000:] + then.stderr[-3000:]
    assert "resumed from" in then.stdout + then.stderr


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_file_that_breaks_the_contract_is_refused_naming_the_line(tmp_path, capsys, name):
    text, message = BAD[name]
    (tmp_path / name).write_text(text)
    out = tmp_path / "never"
    assert main(["train", str(tmp_path / name), "--workers", "2", "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_file_or_class_is_refused(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nowhere.py"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", f"{EXAMPLES / 'allreduce.py'}:Nope", "--out", str(tmp_path / "x")]) == 2
    assert "has no class Nope; it defines: AllReduce" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_measures_an_own_strategy_beside_paralabs(tmp_path):
    (tmp_path / "direct.py").write_text(DIRECT)
    r = run_paralab("compare", "--strategies", "allreduce", "--strategy-file", str(EXAMPLES / "bucketed_ddp.py"),
                    "--strategy-file", str(EXAMPLES / "forgot_to_average.py"),
                    "--strategy-file", str(tmp_path / "direct.py"), "--workers", "2",
                    "--num-batches", "3", "--width", "0.125", "--dataset", "synthetic", "--out", str(tmp_path / "cmp"))
    assert r.returncode == 1, r.stderr[-3000:]  # a check FAILed (the report is written all the same)
    assert sorted(p.name for p in (tmp_path / "cmp" / "runs").iterdir()) == \
        ["allreduce-w2", "bucketed_ddp-w2", "direct-w2", "forgot_to_average-w2"]
    row = next(line for line in r.stdout.splitlines() if "bucketed_ddp.py" in line)
    assert "PASS" in row
    row = next(line for line in r.stdout.splitlines() if "forgot_to_average.py" in line)
    assert "FAIL" in row
    # the report says where the failing one first went wrong, and which collectives one could not time
    report = (tmp_path / "cmp" / "report.html").read_text()
    assert "forgot_to_average.py w2: first divergence: step 1, rank 0, backward of 13.1 (Linear) weight gradient" \
        in report
    assert "direct.py w2: its file calls torch.distributed itself (all_reduce x" in report
    # the settings name the files once, among the strategies (not an empty strategy_file beside them)
    settings = (tmp_path / "cmp" / "report.md").read_text()
    assert "strategy_file" not in settings, settings
    row = next(line for line in settings.splitlines() if line.startswith("| strategies |"))
    assert "allreduce," in row and "bucketed_ddp.py" in row and "direct.py" in row, row


RAISES = '''import torch
from paralab.strategies.replicas import Replicas


class Typo(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            self.comm.all_reduce(p.grad)
            p.grad /= self.comm.wrold
'''

HANGS = '''import torch
from paralab.strategies.replicas import Replicas


class OnlyRankZero(Replicas):
    @torch.no_grad()
    def finish(self):
        if self.comm.rank == 0:
            for p in self.params:
                self.comm.all_reduce(p.grad)
'''

SMALL = ["--workers", "2", "--dataset", "synthetic", "--width", "0.125", "--num-batches", "2", "--batch-size", "32"]


def test_an_error_in_the_users_file_is_named_before_the_traceback(tmp_path):
    (tmp_path / "typo.py").write_text(RAISES)
    r = run_paralab("train", str(tmp_path / "typo.py"), *SMALL, out=tmp_path / "run")
    assert r.returncode != 0
    assert f"paralab: the error is in your code: {tmp_path / 'typo.py'}:10, in finish" in r.stderr, r.stderr[-3000:]


DIRECT = '''import torch
import torch.distributed as dist
from paralab.strategies.replicas import Replicas


class Direct(Replicas):
    @torch.no_grad()
    def finish(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.comm.world
'''


def test_collectives_called_from_torch_distributed_directly_work_and_are_counted_as_untimed(tmp_path):
    (tmp_path / "direct.py").write_text(DIRECT)
    r = run_paralab("train", str(tmp_path / "direct.py"), *CNN, out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    norm = json.loads((tmp_path / "run" / "config.json").read_text())["norm"]
    tensors = len(list(build_model("vgg11", width=0.125, norm=norm, num_classes=10).parameters()))
    for rank in ("0", "1"):  # one all-reduce per gradient per step, on each rank; none of paralab's own counted
        assert r.summary["strategy_details"][rank]["untimed_collectives"] == {"all_reduce": 3 * tensors}
    assert f"called torch.distributed itself (all_reduce x{3 * tensors} on rank 0)" in r.stdout
    assert "so the time split counts these as other" in r.stdout
    # paralab's timed collectives are not counted: the example through self.comm has none
    r = run_paralab("train", str(EXAMPLES / "allreduce.py"), *CNN, out=tmp_path / "timed")
    assert all("untimed_collectives" not in d for d in r.summary["strategy_details"].values())

    def split(run: str, key: str) -> float:  # the median over every (step, rank) of one part of the time split
        rows = [json.loads(line)["split"][key] for line in (tmp_path / run / "steps.jsonl").read_text().splitlines()]
        return sorted(rows)[len(rows) // 2]
    # as the line says: the untimed all-reduces are the step's "other", the timed ones its "comm"
    assert split("run", "other") > split("timed", "other") and split("timed", "comm") > split("run", "comm")


COUNTS = '''import torch
from paralab.strategies.replicas import Replicas


class ForgetsFromTheSecondStep(Replicas):
    """Averages at its first step; from its second on it forgets to divide (it counts its own steps)."""
    steps = 0

    @torch.no_grad()
    def finish(self):
        self.steps += 1
        for p in self.params:
            self.comm.all_reduce(p.grad)
            if self.steps < 2:
                p.grad /= self.comm.world
'''


def test_a_users_strategy_that_counts_its_own_steps_is_named_at_the_step_it_goes_wrong(tmp_path):
    """The replay takes each step twice (probed, then for real) and puts back what the user's object held between
    (its step count here): the bug is named at step 2, where the run goes wrong, not at step 1."""
    (tmp_path / "counts.py").write_text(COUNTS)
    r = run_paralab("train", str(tmp_path / "counts.py"), *CNN, out=tmp_path / "run")
    assert r.returncode == 1 and "check: FAIL" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check: first divergence: step 2, rank 0, backward of" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_a_users_strategy_that_hangs_is_diagnosed_naming_the_rank_and_the_operation(tmp_path):
    (tmp_path / "hangs.py").write_text(HANGS)
    r = run_paralab("train", str(tmp_path / "hangs.py"), *SMALL, "--timeout", "5", out=tmp_path / "run")
    assert r.returncode != 0
    err = r.stderr
    assert "they disagree: rank 0 called all_reduce" in err, err[-3000:]
    # the disagreement leads, with the step it happened in, and nothing blames the network
    assert "where the ranks disagree (rank 0 in step 1; rank 1 in step 1; their op logs" in err, err[-3000:]
    assert err.index("where the ranks disagree") < err.index("failed first"), err[-3000:]
    assert "outside the ranks' Python code" not in err, err[-3000:]


def test_train_takes_the_file_as_strategy_file_too(tmp_path, capsys):
    r = run_paralab("train", f"--strategy-file={EXAMPLES / 'allreduce.py'}", *CNN, out=tmp_path / "run")
    assert r.returncode == 0 and "check: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.summary["strategy"] == str(EXAMPLES / "allreduce.py")
    # named twice, not a file, or not at all: refused, saying what to change, nothing written
    for argv, said in ((["ddp", "--strategy-file", str(EXAMPLES / "allreduce.py")], "name the strategy once"),
                       (["--strategy-file", "ddp"], "--strategy-file takes a Python file"),
                       ([], "name a strategy")):
        assert main(["train", *argv, "--out", str(tmp_path / "refused")]) == 2
        assert said in capsys.readouterr().err
        assert not (tmp_path / "refused").exists()


SCHEDULE = ["--workers", "2", "--microbatches", "4", "--dataset", "synthetic", "--width", "0.125", "--num-batches", "3",
            "--batch-size", "32", "--eval-batches", "1", "--norm", "none"]


def test_a_pipeline_schedule_of_ones_own_is_checked_and_runs_as_the_builtin_one(tmp_path):
    own = run_paralab("train", "pipeline", "--schedule", str(ROOT / "examples" / "schedules" / "one_f_one_b.py"),
                      *SCHEDULE, "--check", out=tmp_path / "own")
    assert own.returncode == 0 and "check: PASS" in own.stdout, own.stdout[-3000:] + own.stderr[-3000:]
    builtin = run_paralab("train", "pipeline", "--schedule", "1f1b", *SCHEDULE, out=tmp_path / "builtin")
    assert builtin.returncode == 0, builtin.stderr[-3000:]
    # the same order of the same work: the same losses, bit for bit, and the same compute spans per rank
    assert [r["loss"] for r in own.rows("steps.jsonl")] == [r["loss"] for r in builtin.rows("steps.jsonl")]
    order = lambda r: sorted([(s["rank"], s["name"], s["args"].get("mb")) for s in r.rows("spans.jsonl")  # noqa
                              if s["step"] == 2 and s["category"] == "compute"], key=lambda t: t[0])  # each rank's
    assert order(own) == order(builtin)
    # its ideal timeline is simulated from the file, as a built-in schedule's is
    from paralab.analysis.pipeline import ideal_timeline
    from paralab.analysis.runs import load_run
    ideal, why = ideal_timeline(load_run(tmp_path / "own"))
    assert ideal is not None and ideal.known, why


DEADLOCK = '''from paralab.strategies.pipeline.actions import Action


def backwards_first(p, m):
    return [[Action("backward", mb, stage=r) for mb in range(m)] + [Action("forward", mb, stage=r) for mb in range(m)]
            for r in range(p)]
'''
MISSING = '''from paralab.strategies.pipeline.actions import Action


def forwards_only(p, m):
    return [[Action("forward", mb, stage=r) for mb in range(m)] for r in range(p)]
'''


@pytest.mark.parametrize("text,said", [(DEADLOCK, ":4: the schedule backwards_first(2, 4) cannot run: rank 0: B0s0 "
                                                  "comes before F of microbatch 0 on stage 0"),
                                       (MISSING, ":4: the schedule forwards_only(2, 4) cannot run: rank 0: missing"),
                                       ("x = 1\n", "defines no function")])
def test_a_schedule_that_cannot_run_is_refused_before_any_rank_starts(tmp_path, capsys, text, said):
    (tmp_path / "mine.py").write_text(text)
    assert main(["train", "pipeline", "--schedule", str(tmp_path / "mine.py"), *SCHEDULE,
                 "--out", str(tmp_path / "run")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sweep_scales_an_own_strategy(tmp_path):
    r = run_paralab("sweep", "scaling", "--strategy", str(EXAMPLES / "allreduce.py"), "--workers", "1,2",
                    "--batch-sizes", "32", "--epoch-samples", "128", "--width", "0.125", "--dataset", "synthetic",
                    "--out", str(tmp_path / "sweep"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert sweep["strategy"] == str(EXAMPLES / "allreduce.py") and len(sweep["entries"]) == 4
    for run in (tmp_path / "sweep" / "runs").glob("*-w2"):  # at 1 worker the sweep's baseline, single, runs
        assert json.loads((run / "summary.json").read_text())["strategy"] == str(EXAMPLES / "allreduce.py")
