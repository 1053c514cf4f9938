"""Plots, report, analysis and commands never name a strategy: what they show follows from the records.

A strategy's name as a string literal in these files is how dispatch on names
creeps back ("if r.strategy == 'pipeline'"), and it breaks the promise that a
new strategy is one file and one registry line. The scan parses each file and
flags every string constant equal to a registered name, except where the
string cannot be a strategy:

- the key of a mapping lookup (``config.get("model")``, ``summary["model"]``):
  a record's field that happens to share a strategy's name;
- the name of a command-line subcommand (``sub.add_parser("allreduce")``:
  ``paralab calc allreduce``);
- the entries of ``ALLOWED`` below, each with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import paralab
from paralab.strategies import strategy_names

SRC = Path(paralab.__file__).parent
SCANNED = ["report/**/*.py", "analysis/**/*.py", "commands/**/*.py"]

#: (file relative to src/paralab, literal) -> why it is not a strategy's name
ALLOWED = {
    ("analysis/memory.py", "ddp"): "the cost model's label for ZeRO stage 0 (DDP's layout of model states)",
    ("commands/partition.py", "model"): "a key of the JSON `paralab partition --json` prints (the model's name)",
    ("commands/calc.py", "tp"): "`calc tp`'s own --tp option and the mesh dimension it reads, not the strategy",
    ("commands/calc.py", "cp"): "`calc cp`'s own --cp option and the mesh dimension it reads, not the strategy",
    ("commands/plan.py", "tp"): "a pin: `paralab plan --tp`, the mesh dimension, not the strategy",
    ("commands/plan.py", "model"): "a key of the JSON `paralab plan --json` prints (the model's description)",
    ("analysis/plan/layouts.py", "tp"): "the --tp pin's key, the mesh dimension, not the strategy",
    ("analysis/plan/layouts.py", "cp"): "the --cp pin's key and a layout's label: the mesh dimension",
    ("commands/plan.py", "cp"): "a pin: `paralab plan --cp`, the mesh dimension, not the strategy",
    ("analysis/plan/from_run.py", "cp"): "the run's --cp, the mesh dimension, not the strategy",
    ("analysis/plan/layouts.py", "ddp"): "the `paralab train` command plan prints for a layout without ZeRO",
    ("analysis/plan/layouts.py", "fsdp"): "the `paralab train` command plan prints for a ZeRO layout",
}


def scanned_files() -> list[Path]:
    files = sorted({p for pattern in SCANNED for p in SRC.glob(pattern)})
    assert files, f"nothing to scan under {SRC}"
    return files


def strategy_literals(source: str, names) -> list[tuple[int, str]]:
    """(line, literal) of every string constant in ``source`` equal to one of ``names``,
    mapping-key lookups and subcommand names left out."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
            continue
        up = parent.get(node)
        if isinstance(up, ast.Subscript) and up.slice is node:
            continue
        if (isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute) and up.args and up.args[0] is node
                and up.func.attr in ("get", "add_parser")):
            continue
        found.append((node.lineno, node.col_offset, node.value))
    return [(line, value) for line, _, value in sorted(found)]


def test_the_scan_finds_dispatch_on_names_and_lets_record_fields_pass():
    names = {"pipeline", "model", "allreduce"}
    flagged = strategy_literals('''
if run.strategy == "pipeline": pass
if run.strategy in ("model", "x"): pass
EXTRA = {"pipeline": 1}
label = "model" if a else "b"
''', names)
    assert [v for _, v in flagged] == ["pipeline", "model", "pipeline", "model"]
    assert strategy_literals('''
width = run.config.get("model")
m = summary["model"]
sub.add_parser("allreduce", help="x")
text = f"model {x} pipeline"
''', names) == []


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_strategy_name_as_a_literal(path):
    rel = str(path.relative_to(SRC))
    names = set(strategy_names())
    bad = [(line, v) for line, v in strategy_literals(path.read_text(), names) if (rel, v) not in ALLOWED]
    assert not bad, (f"{rel} names strategies as string literals: "
                     + ", ".join(f"line {line}: {v!r}" for line, v in bad)
                     + "; decide from the records (paralab.analysis.runs.Run: stages, pipeline, bubbles, "
                       "memory...) or from strategy class attributes, not from a name")
