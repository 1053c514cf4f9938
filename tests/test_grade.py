"""``paralab grade``: assignments, the sandbox, the tests' scores, the gradebook and Gradescope's results.

The seeded set (``tests/data/grading/submissions/`` and three of ``examples/strategies/``) is graded in one
run against ``allreduce-quick.toml``: correct files get full marks where the assignment allows what they
call, buggy ones lose the tests they should, hostile ones are contained (nothing read, written or reached
outside, nothing left running) and the other grades are untouched.
"""
from __future__ import annotations

import csv
import json
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import run_paralab

from paralab.cli import main
from paralab.errors import UsageError
from paralab.grading import assignment as A
from paralab.grading import sandbox
from paralab.grading.grade import wire_bytes

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "grading"
QUICK = DATA / "allreduce-quick.toml"
EXAMPLES = ROOT / "examples" / "strategies"
NO_SANDBOX = sandbox.available()


def test_every_built_in_assignment_loads_and_is_listed(capsys):
    names = set(A.built_in())
    assert {"cs744-gather-scatter", "cs744-allreduce", "cs744-ddp", "cs1390-pipeline", "parameter-server"} <= names
    for name in names:
        a = A.load(name)
        assert a.max_score > 0 and a.workers and a.form in A.FORMS
    assert main(["grade", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in names)


def test_the_formulas_are_arithmetic_in_n_and_nothing_else():
    assert A.formula_value("2 * (N - 1) / N", 4) == 1.5 and A.formula_value("N - 1", 3) == 2
    for bad in ("__import__('os')", "N ** 2", "open('x')", "2 *"):
        with pytest.raises(UsageError):
            A.formula_value(bad, 2)
    with pytest.raises(UsageError, match="divides by zero"):
        A.formula_value("1 / (N - 2)", 2)


@pytest.mark.parametrize("text,said", [
    ("form = 'replicas'\nworkers = [2]\n[points]\ncheck = 1\nextra = 2\n", "points must give tests among"),
    ("form = 'mine'\nworkers = [2]\n[points]\ncheck = 1\n", "form must be one of"),
    ("form = 'replicas'\nworkers = [0]\n[points]\ncheck = 1\n", "workers must list worker counts"),
    ("form = 'replicas'\nworkers = [2]\n[points]\ncheck = 0\n", "points are all zero"),
    ("form = 'replicas'\nworkers = [2]\nbytes = {root = 'N ** N'}\n[points]\ncheck = 1\n", "bytes.root"),
    ("form = 'replicas'\nworkers = [2]\nsecret = 1\n[points]\ncheck = 1\n", "unknown key(s) secret"),
    ("form = \n", "not TOML"),
    ("form = 'replicas'\nworkers = [2]\n[points]\nbytes = 1\n", "points.bytes needs [bytes] root"),
    ("form = 'replicas'\nworkers = [2]\n[points]\nspeed = 1\n", "points.speed needs reference"),
])
def test_a_bad_assignment_file_is_refused_naming_what_to_change(tmp_path, text, said):
    path = tmp_path / "a.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(said)):
        A.load(str(path))


def test_bytes_on_the_wire_follow_each_collectives_algorithm():
    assert wire_bytes("all_reduce", 100, 0, None, 4) == 150  # a ring: 2(N-1)/N
    assert wire_bytes("scatter", 100, 0, 0, 3) == 200 and wire_bytes("scatter", 100, 1, 0, 3) == 0
    assert wire_bytes("gather", 100, 2, 2, 3) == 0 and wire_bytes("gather", 100, 0, 2, 3) == 100
    assert wire_bytes("broadcast", 100, 1, 1, 4) == 300 and wire_bytes("recv", 100, 0, None, 2) == 0
    assert wire_bytes("send", 100, 0, None, 2) == 100 and wire_bytes("all_gather", 100, 0, None, 4) == 75


def test_the_sandbox_puts_back_the_interpreter_and_paralab_where_it_empties_a_folder(monkeypatch, tmp_path):
    """A clone in /tmp (as CI's may be) or a Python under the home: bound again over the emptied folder."""
    import sys
    monkeypatch.setattr(sys, "prefix", "/tmp/clone/.venv")
    argv = sandbox.command(["python"], workdir=tmp_path, writable=tmp_path, readable=[], hidden=[])
    binds = {argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
    assert "/tmp/clone/.venv" in binds and argv.index("--tmpfs") < argv.index("/tmp/clone/.venv")
    src = str(Path(sandbox.__file__).resolve().parents[2])
    assert (src in binds) == any(src.startswith(f) for f in ("/tmp", str(Path.home().resolve()), "/dev/shm"))


def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    subs = tmp_path / "subs"
    subs.mkdir()
    out = tmp_path / "out"
    assert main(["grade", str(subs), "--assignment", "cs744-allreduce", "--out", str(out)]) == 2
    assert "holds no .py file" in capsys.readouterr().err and not out.exists()
    (subs / "a.py").write_text("x = 1\n")
    for argv, said in (([str(subs), "--assignment", "nope", "--out", str(out)], "neither a built-in"),
                       ([str(subs), "--assignment", "cs744-allreduce"], "give SUBMISSIONS"),
                       ([str(tmp_path / "none"), "--assignment", "cs744-allreduce", "--out", str(out)],
                        "is not a folder"),
                       ([str(subs), "--assignment", "cs744-allreduce", "--out", str(out), "--jobs", "0"],
                        "--jobs must be at least 1"),
                       ([str(subs), "--assignment", "cs744-allreduce", "--out", str(subs)], "already exists")):
        assert main(["grade", *argv]) == 2, argv
        assert said in capsys.readouterr().err, argv
    assert not out.exists()


def test_an_assignment_whose_own_reference_cannot_train_grades_nothing(tmp_path, capsys):
    """The grader's own run is every check's answer: an assignment whose settings do not train is refused."""
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(EXAMPLES / "allreduce.py", subs / "alice.py")
    bad = tmp_path / "bad.toml"
    bad.write_text(QUICK.read_text().replace('"--batch-size", "24"', '"--batch-size", "0"'))
    out = tmp_path / "out"
    assert main(["grade", str(subs), "--assignment", str(bad), "--out", str(out), "--no-sandbox"]) == 2
    err = capsys.readouterr().err
    assert "own reference (single) does not run with its train options" in err and "batch" in err, err
    assert not out.exists()


def test_final_weights_are_read_by_the_grader_and_compared_with_its_own(tmp_path):
    """What a check's PASS must be borne out by: each rank's whole model, read with weights_only, bounded."""
    import argparse

    import torch
    from conftest import commit_generation

    from paralab.grading import weights as W
    truth = {"w": torch.ones(3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}

    def rank(w, b=torch.zeros(2, dtype=torch.float64), step=2):
        return {"state": {"model": {"w": w, "b": b}, "optimizer": {}}, "step": step}
    commit_generation(tmp_path / "run", 2, {}, {0: rank(truth["w"].clone()), 1: rank(truth["w"] * 2)}, 2)
    models, why = W.final_weights(tmp_path / "run", "replicas", truth, 2)
    assert why == "" and len(models) == 2
    assert W.deviation(models, truth) == (1.0, "w (rank 1)")
    assert W.deviation(models[:1], truth) == (0.0, "")
    assert W.deviation([{"w": truth["w"]}], truth) == (float("inf"), "b: missing or of another shape")
    assert W.deviation([{"w": truth["w"] * float("nan"), "b": truth["b"]}], truth)[0] == float("inf")
    assert W.final_weights(tmp_path / "run", "replicas", truth, 3)[1] == "its last checkpoint is at step 2, not 3"
    assert W.final_weights(tmp_path / "none", "replicas", truth, 2)[1] == "the run left no committed checkpoint"
    big = rank(torch.zeros(2_000_000))  # 8 MB: more than 16 x a 40-byte model + 1 MiB
    commit_generation(tmp_path / "big", 2, {}, {0: big, 1: big}, 2)
    assert "more than" in W.final_weights(tmp_path / "big", "replicas", truth, 2)[1]
    code = rank(argparse.Namespace(x=1))  # not a tensor: the weights-only unpickler refuses to build it
    commit_generation(tmp_path / "code", 2, {}, {0: code, 1: code}, 2)
    assert "cannot be read" in W.final_weights(tmp_path / "code", "replicas", truth, 2)[1]
    assert W.tolerance(["--precision", "fp64"]) == 2e-9 and W.tolerance(["--precision", "fp32"]) == 2e-5
    assert W.precision_of([]) == "fp64"


def test_without_a_sandbox_nothing_is_run_unless_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    (tmp_path / "subs").mkdir()
    (tmp_path / "subs" / "a.py").write_text("raise SystemExit('ran')\n")
    assert main(["grade", str(tmp_path / "subs"), "--assignment", "cs744-allreduce", "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "bubblewrap is not installed" in err and "--no-sandbox" in err and not (tmp_path / "out").exists()


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
def test_one_submission_gives_gradescopes_results_and_a_gradebook_row(tmp_path):
    subs = tmp_path / "subs"
    (subs / "alice").mkdir(parents=True)
    shutil.copy(EXAMPLES / "allreduce.py", subs / "alice" / "solution.py")
    (subs / "bob.py").symlink_to(subs / "alice" / "solution.py")
    (subs / "carol").mkdir()
    for name in ("a.py", "b.py"):
        shutil.copy(EXAMPLES / "allreduce.py", subs / "carol" / name)
    r = run_paralab("grade", str(subs), "--assignment", str(QUICK), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "alice" / "results.json").read_text())
    assert results["score"] == 10 and {t["name"] for t in results["tests"]} == {
        "loads", "check at 2 workers", "collectives", "bytes"}
    assert all({"name", "score", "max_score", "output"} <= set(t) for t in results["tests"])
    rows = list(csv.DictReader((tmp_path / "out" / "gradebook.csv").open()))
    assert rows[0] == {"submission": "alice", "score": "10", "max_score": "10", "loads": "1",
                       "check at 2 workers": "6", "collectives": "2", "bytes": "1"}
    # bob links to alice's file (the sandbox would show it him), carol's folder holds two: neither is run
    assert [(r["submission"], r["score"]) for r in rows[1:]] == [("bob", "0"), ("carol", "0")]
    bob = json.loads((tmp_path / "out" / "bob" / "results.json").read_text())["tests"][0]["output"]
    assert "is a symbolic link" in bob and not (tmp_path / "out" / "bob" / "w2").exists()
    assert "alice" in (tmp_path / "out" / "report.html").read_text()


#: what each seeded submission scores per test (loads, check, collectives, bytes)
EXPECTED = {
    "allreduce": (1, 6, 2, 1), "bucketed_ddp": (1, 6, 2, 1),
    "gather_scatter": (1, 6, 0, 1),  # right, but not with all_reduce (its bytes match at 2 workers: N - 1 = 1)
    "ring": (1, 6, 0, 1),            # right, its bytes a ring's, but send/recv are not all_reduce
    "no_average": (1, 0, 2, 1), "averaged_twice": (1, 0, 2, 1), "skips_biases": (1, 0, 2, 1),
    "skips_a_step": (1, 0, 0, 0),    # hangs: the run never finishes, so nothing of it can be counted
    "loops_forever": (1, 0, 0, 0),
    "fork_storm": (1, 0, 0, 0),      # capped: its ranks cannot start
    "reads_another": (1, 6, 2, 1), "writes_outside": (1, 6, 2, 1), "connects_out": (1, 6, 2, 1),
    "loosens_the_check": (1, 0, 2, 1),  # its run says PASS; its final weights, read by the grader, do not
}
PORT = 47181  # connects_out.py tries it


@pytest.mark.slow
@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
def test_the_seeded_submissions_are_graded_as_intended_and_the_hostile_ones_contained(tmp_path):
    subs = tmp_path / "submissions"
    subs.mkdir()
    for path in (DATA / "submissions").glob("*.py"):
        shutil.copy(path, subs / path.name)
    for name in ("allreduce", "gather_scatter", "bucketed_ddp"):
        shutil.copy(EXAMPLES / f"{name}.py", subs / f"{name}.py")
    connections = []
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen()
    listener.settimeout(0.5)
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept())
            except OSError:
                pass
    watcher = threading.Thread(target=accept, daemon=True)
    watcher.start()
    home_plant = Path.home().parent / "planted.txt"
    out = tmp_path / "grades"
    try:
        r = run_paralab("grade", str(subs), "--assignment", str(QUICK), "--out", str(out), "--jobs", "4",
                        timeout=900)
    finally:
        stop.set()
        watcher.join()
        listener.close()
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["submission"]: row for row in csv.DictReader((out / "gradebook.csv").open())}
    tests = ("loads", "check at 2 workers", "collectives", "bytes")
    got = {sid: tuple(int(float(row[t])) for t in tests) for sid, row in rows.items()}
    assert got == EXPECTED
    # the feedback a student acts on: the first divergence of a bug, the reason a run stopped, never a traceback
    feedback = {sid: {t["name"]: t["output"] for t in json.loads((out / sid / "results.json").read_text())["tests"]}
                for sid in rows}
    assert "first divergence: step 1, rank 0, backward of" in feedback["no_average"]["check at 2 workers"]
    assert "stopped at the time limit" in feedback["loops_forever"]["check at 2 workers"]
    forged = feedback["loosens_the_check"]["check at 2 workers"]
    assert "check: PASS" in forged and "the run reported PASS, but its final weights differ from the grader's own" \
        " reference" in forged, forged
    assert "final weights equal the grader's own reference" in feedback["allreduce"]["check at 2 workers"]
    hang = feedback["skips_a_step"]["check at 2 workers"]  # rank 1 skipped step 2's all-reduces, then finished
    assert "they disagree" in hang and "(rank 0 in step 2; rank 1 after its last step;" in hang, hang
    assert "not allowed here: recv, send" in feedback["ring"]["collectives"]
    assert "sandbox allows 200 processes" in feedback["fork_storm"]["check at 2 workers"]
    assert not any("Traceback" in text for f in feedback.values() for text in f.values())
    # contained: nothing read, written or reached outside; nothing left running
    assert (out / "reads_another" / "stolen.txt").read_text().startswith("nothing: ")
    assert not (subs / "planted.py").exists() and not (out / "planted.txt").exists()
    assert not home_plant.exists() and not Path("/tmp/planted-by-a-submission.txt").exists()
    assert connections == []
    left = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True).stdout.split()
    assert left == [], left


#: a solution of each built-in assignment, from the examples the docs walk through
SOLUTIONS = {"cs744-gather-scatter": EXAMPLES / "gather_scatter.py", "cs744-allreduce": EXAMPLES / "allreduce.py",
             "cs744-ddp": EXAMPLES / "bucketed_ddp.py", "parameter-server": EXAMPLES / "parameter_server.py",
             "cs1390-pipeline": ROOT / "examples" / "schedules" / "one_f_one_b.py"}


@pytest.mark.slow
@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
def test_each_built_in_assignment_gives_its_solution_full_marks(tmp_path):
    """Each assignment graded by its own `paralab grade`, two at a time (conftest.two_at_a_time)."""
    from conftest import two_at_a_time
    assert set(SOLUTIONS) == set(A.built_in())

    def grade(_, name):
        solution = SOLUTIONS[name]
        subs = tmp_path / name / "subs"
        subs.mkdir(parents=True)
        shutil.copy(solution, subs / solution.name)
        return run_paralab("grade", str(subs), "--assignment", name, "--out", str(tmp_path / name / "out"),
                           timeout=600)
    done = dict(zip(SOLUTIONS, two_at_a_time(grade, SOLUTIONS)))
    for name, solution in SOLUTIONS.items():
        r = done[name]
        assert r.returncode == 0, r.stderr[-3000:]
        tests = json.loads((tmp_path / name / "out" / solution.stem / "results.json").read_text())["tests"]
        # full marks; the speed test (a few steps on a shared machine: noisy) is measured against its reference
        assert all(t["score"] == t["max_score"] for t in tests if t["name"] != "speed"), (name, tests)
        for t in tests:
            if t["name"] == "speed":
                assert f"x {A.load(name).reference}'s" in t["output"], (name, t)
