"""A new strategy is one new file plus one registry line, and every tool takes it (issue 10).

The promise of ``paralab.strategies`` ("adding a strategy is one file and one
line") is proved here literally, without touching the checkout: the package
``src/paralab`` is copied to a temporary plug-in location, a toy strategy is
written there as one new file (``paralab/strategies/toy.py``) and one line is
added to the copy's ``REGISTRY``; the test then asserts that the copy differs
from the package by exactly that file and that line, nothing else. With the
copy first on ``PYTHONPATH`` (so its ``paralab`` is the one imported, by the
CLI and by every process it starts), the toy goes through:

1. ``paralab train toy-flat --workers 2 --check``: exit 0, ``check: PASS``,
   and the records show the toy's own collective (one flat all-reduce of every
   gradient per rank per step);
2. ``paralab compare --strategies toy-flat``: the toy's row in results.json,
   report.md and report.html, its check PASS;
3. ``paralab plot`` throughput, split-time, timeline and memory of its run;
4. the HTML report of step 2 names it and shows its command.

The toy is a real algorithm written from primitives (a ``Replicas`` flavour
under ``DataParallel``): concatenate every gradient, all-reduce the one flat
buffer, divide by the world size, copy back. A negative control, registered
the same way in its own copy, forgets the division: ``train --check`` must
exit 1 with ``check: FAIL``, so the pass above is not vacuous.
"""
from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import paralab

SRC = Path(paralab.__file__).parent  # src/paralab (the editable install)
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")

FAST = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.125", "--batch-size", "32",
        "--no-progress", "--eval-batches", "1", "--eval-batch-size", "64", "--timeout", "30"]
STEPS = ["--num-batches", "2", "--lr", "1e-3"]

TOY_SOURCE = '''"""``{name}``: data parallelism with ONE all-reduce of every gradient, concatenated.

After backward each rank flattens all its gradients into one buffer, sums the
buffer over the replicas with a single all-reduce, {divide_doc}, and copies the
pieces back into ``.grad``: one message per step instead of one per tensor.
"""
from __future__ import annotations

import torch

from .data_parallel import DataParallel
from .replicas import Replicas


class {cls}Replicas(Replicas):
    flavour = "{name}"

    @torch.no_grad()
    def finish(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, name="toy_flat_all_reduce")
        {divide_code}
        for p, part in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad = part.view_as(p).clone()


class {cls}(DataParallel):
    name = "{name}"
    replicas_cls = {cls}Replicas
'''


def toy_source(name: str, cls: str, divide: bool) -> str:
    return TOY_SOURCE.format(
        name=name, cls=cls,
        divide_doc="divides by the number of replicas" if divide else "and (the bug) never divides",
        divide_code="flat.div_(self.comm.world)" if divide else "pass  # forgot: flat.div_(self.comm.world)")


# ======================================================================== the plug-in tree
def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The package as it stands, copied once (the other copies are made from this snapshot, so an
    edit to src/ during the test cannot make them differ from it)."""
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(SRC, root / "paralab", ignore=IGNORE)
    assert (root / "paralab" / "strategies" / "__init__.py").is_file()
    return root


def plug_in(pristine: Path, dest: Path, name: str, module: str, cls: str, source: str) -> Path:
    """Copy the package to ``dest``, add ``strategies/<module>.py`` and one REGISTRY line; return
    the PYTHONPATH root holding the copy's ``paralab``."""
    shutil.copytree(pristine / "paralab", dest / "paralab", ignore=IGNORE)
    (dest / "paralab" / "strategies" / f"{module}.py").write_text(source)
    registry = dest / "paralab" / "strategies" / "__init__.py"
    text = registry.read_text()
    opening = "REGISTRY = {\n"
    assert text.count(opening) == 1, "the registry's opening line moved; update this test"
    registry.write_text(text.replace(opening, f'{opening}    "{name}": "paralab.strategies.{module}:{cls}",\n'))
    return dest


def assert_one_file_and_one_line(pristine: Path, copy: Path, module: str, name: str) -> None:
    old, new = tree_files(pristine / "paralab"), tree_files(copy / "paralab")
    added = set(new) - set(old)
    assert added == {f"strategies/{module}.py"}, added
    assert set(old) - set(new) == set()
    changed = sorted(k for k in old if old[k] != new[k])
    assert changed == ["strategies/__init__.py"], changed
    a = old[changed[0]].decode().splitlines(keepends=True)
    b = new[changed[0]].decode().splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    assert len(ops) == 1 and ops[0][0] == "insert" and ops[0][4] - ops[0][3] == 1, ops
    assert f'"{name}"' in b[ops[0][3]]


def run_cli(root: Path, cwd: Path, *args: str, timeout: float = 240,
            python: tuple[str, ...] = ("-m", "paralab")) -> subprocess.CompletedProcess:
    """``python -m paralab ARGS`` (or ``python PYTHON ARGS``) with the plug-in copy first on the path, from ``cwd``."""
    path = os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *python, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def output(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"


@pytest.fixture(scope="module")
def toy(pristine, tmp_path_factory) -> dict:
    """The plug-in copy with ``toy-flat``, and its ``train --check`` run."""
    root = plug_in(pristine, tmp_path_factory.mktemp("plugin"), "toy-flat", "toy", "ToyFlat",
                   toy_source("toy-flat", "ToyFlat", divide=True))
    cwd = tmp_path_factory.mktemp("cwd")
    run_dir = cwd / "toy-run"
    p = run_cli(root, cwd, "train", "toy-flat", "--workers", "2", "--check", *FAST, *STEPS, "--out", str(run_dir))
    return {"root": root, "cwd": cwd, "run": run_dir, "train": p}


@pytest.fixture(scope="module")
def toy_compare(toy) -> tuple[Path, subprocess.CompletedProcess]:
    out = toy["cwd"] / "compare"
    p = run_cli(toy["root"], toy["cwd"], "compare", "--out", str(out), "--strategies", "toy-flat",
                "--workers", "2", "--num-batches", "3", "--batch-size", "32", "--width", "0.125",
                "--dataset", "synthetic", "--eval-batches", "1", "--lr", "1e-3",
                "--train-args=--synthetic-size 512 --eval-batch-size 64 --timeout 30")
    return out, p


# ======================================================================== the tests
def test_the_plug_in_is_one_new_file_and_one_registry_line(pristine, toy):
    assert_one_file_and_one_line(pristine, toy["root"], "toy", "toy-flat")
    # and the copy, not the checkout, is what the subprocesses import; the CLI lists the toy
    p = subprocess.run([sys.executable, "-c", "import paralab, paralab.strategies as s; "
                        "print(paralab.__file__); print(','.join(s.strategy_names()))"],
                       cwd=toy["cwd"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(toy["root"])})
    assert p.returncode == 0, p.stderr
    file, names = p.stdout.splitlines()
    assert Path(file).resolve() == (toy["root"] / "paralab" / "__init__.py").resolve()
    assert "toy-flat" in names.split(",")
    from paralab.strategies import strategy_names
    assert "toy-flat" not in strategy_names()  # the checkout itself is untouched


def test_train_check_passes_and_records_the_toys_collective(toy):
    p = toy["train"]
    assert p.returncode == 0, output(p)
    assert "check: PASS" in p.stdout + p.stderr, output(p)
    s = json.loads((toy["run"] / "summary.json").read_text())
    assert s["strategy"] == "toy-flat" and s["workers"] == 2 and s["steps"] == 2
    assert s["check"]["result"] == "PASS", s["check"]
    assert s["check"]["precision"] == "fp64"  # a check's own precision when none is given
    assert s["check"]["max_weight_dev"] <= 1e-9 and s["check"]["max_output_dev"] <= 1e-8
    # one flat all-reduce of every gradient per rank per measured step: all the parameters' bytes at once
    reduce = s["comm_ops"]["all_reduce"]
    assert reduce["calls"] == 2 * s["measured_steps"] and s["measured_steps"] >= 1
    assert reduce["bytes_per_step"] == {"fp32": 4, "fp64": 8}[s["precision"]] * s["parameters"]
    spans = [json.loads(line) for line in (toy["run"] / "spans.jsonl").read_text().splitlines()]
    flat = [x for x in spans if x["category"] == "comm" and x["name"] == "toy_flat_all_reduce"]
    assert sorted({x["rank"] for x in flat}) == [0, 1]
    assert {x["step"] for x in flat} == {x["step"] for x in spans if x["category"] == "compute"}
    assert all(x["bytes"] == reduce["bytes_per_step"] for x in flat)
    assert not [x for x in spans if x["category"] == "comm" and x["name"] == "all_reduce"]  # not allreduce's
    config = json.loads((toy["run"] / "config.json").read_text())
    assert json.dumps(config).count("toy-flat") >= 1


def test_compare_report_holds_the_toys_row(toy_compare):
    out, p = toy_compare
    assert p.returncode == 0, output(p)
    data = json.loads((out / "results.json").read_text())
    rows = [dict(zip(data["headers"], r)) for r in data["rows"]]
    assert [(r[data["headers"][0]], r[data["headers"][1]]) for r in rows] == [("toy-flat", 2)], rows
    row = rows[0]
    assert row["check"].startswith("PASS"), row
    assert float(row["s/iter"]) > 0 and float(row["samples/s"]) > 0
    assert (out / "runs" / "toy-flat-w2" / "summary.json").is_file()
    md = (out / "report.md").read_text()
    assert "| toy-flat |" in md.split("## Throughput")[0]
    assert "paralab train toy-flat --workers 2" in md
    assert "Figures not drawn" not in md  # every figure and table of the report took the new strategy
    comm = md.split("## Communication")[1].split("##")[0]
    assert "| toy-flat w2 | all_reduce | 1 |" in comm  # its one flat all-reduce per step and rank
    # the figures drawn from its records (no timeline: the report draws those only for runs whose
    # communication overlaps computation or whose ranks are pipeline stages, and this toy has neither)
    for name in ("throughput.png", "split_time.png", "scaling.png", "memory.png"):
        assert (out / "plots" / name).stat().st_size > 0, name


def test_html_report_names_the_toy(toy_compare):
    out, p = toy_compare
    assert p.returncode == 0, output(p)
    html = (out / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") or "<html" in html[:500].lower()
    assert "toy-flat" in html and "paralab train toy-flat --workers 2" in html
    assert "PASS" in html and "Figures not drawn" not in html


PLOTS = ("throughput", "split-time", "timeline", "memory")


@pytest.fixture(scope="module")
def toy_plots(toy) -> subprocess.CompletedProcess:
    """``paralab plot KIND RUN -o plot-KIND.png`` for every kind, in one interpreter of the plug-in copy."""
    draw = ("import sys\nfrom paralab.cli import main\n"
            f"for kind in {PLOTS!r}:\n"
            "    code = main(['plot', kind, sys.argv[1], '-o', f'plot-{kind}.png'])\n"
            "    if code:\n        sys.exit(code)\n")
    return run_cli(toy["root"], toy["cwd"], str(toy["run"]), timeout=120, python=("-c", draw))


@pytest.mark.parametrize("kind", PLOTS)
def test_plot_draws_the_toys_run(toy, toy_plots, kind):
    assert toy["train"].returncode == 0, output(toy["train"])
    assert toy_plots.returncode == 0, output(toy_plots)
    png = toy["cwd"] / f"plot-{kind}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_negative_control_a_toy_that_forgets_to_divide_fails_the_check(pristine, tmp_path_factory):
    """Same plug-in route, a flavour that sums the gradients and never divides: --check must say FAIL."""
    root = plug_in(pristine, tmp_path_factory.mktemp("plugin-bad"), "toy-sum", "toy_sum", "ToySum",
                   toy_source("toy-sum", "ToySum", divide=False))
    assert_one_file_and_one_line(pristine, root, "toy_sum", "toy-sum")
    cwd = tmp_path_factory.mktemp("cwd-bad")
    p = run_cli(root, cwd, "train", "toy-sum", "--workers", "2", "--check", *FAST, *STEPS, "--out", str(cwd / "run"))
    assert p.returncode == 1, output(p)
    assert "check: FAIL" in p.stdout + p.stderr, output(p)
    s = json.loads((cwd / "run" / "summary.json").read_text())
    assert s["check"]["result"] == "FAIL" and s["check"]["max_weight_dev"] > 1e-5, s["check"]
