"""paralab's modules import each other in layers, with no cycle.

Every module under src/paralab is parsed (``ast``, nothing is imported);
every import it makes counts, at the top or inside a function, except under
``if TYPE_CHECKING:`` (never run). A package's ``__init__`` importing its own
submodules is fine (that is how a package exposes them) and is left out of the
cycle search. The rules are the two tables below (who alone may import a module; the layers): a restructure that moves
files edits the tables, not the test. A name stands for the module and,
if it is a package, everything under it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

#: module -> the only modules (besides its own package's) that may import it
ONLY_IMPORTED_BY = {
    "paralab.cli": ("paralab.__main__", "paralab.front"),   # the command line is the top: nothing builds on it
    # subcommands are registered by the command line alone (front: which of them start a forkserver early)
    "paralab.commands": ("paralab.cli", "paralab.front"),
}
#: the layers, bottom first (docs/architecture.md draws them): a module imports only from its own layer
#: or the ones below it
LAYERS = [
    ("core", ("paralab", "paralab.errors", "paralab.options", "paralab.kinds", "paralab.progress",
              "paralab.recorder", "paralab.oplog", "paralab.wire", "paralab.comm", "paralab.mesh")),
    ("what is trained", ("paralab.models", "paralab.data", "paralab.training")),
    ("the algorithms", ("paralab.strategies",)),
    ("reading records, checking", ("paralab.analysis", "paralab.check")),
    ("one run", ("paralab.run",)),
    ("what people read", ("paralab.report",)),
    ("grading a course", ("paralab.grading",)),
    ("commands", ("paralab.commands",)),
    ("the command line", ("paralab.cli", "paralab.__main__", "paralab.front")),
]

SRC = Path(__file__).resolve().parent.parent / "src" / "paralab"


def modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} for every module under src/paralab."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except what sits under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports() -> dict[str, set[str]]:
    """{module: the paralab modules it imports}, relative imports resolved."""
    known = modules()
    graph = {}
    for name, (path, package) in known.items():
        here = name if package else name.rpartition(".")[0]
        found = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.add(target)
                found |= {f"{target}.{alias.name}" for alias in node.names}  # `from . import x`: module x
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def within(module: str, names) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_the_parser_sees_the_package():
    graph = imports()
    assert "paralab.run.config" in graph and "paralab.options" in graph["paralab.run.config"]
    assert "paralab.strategies.ddp" in graph and "paralab.commands.compare" in graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle():
    known = modules()
    graph = {m: {n for n in deps if not (known[m][1] and n.startswith(m + "."))}  # __init__ -> own submodules
             for m, deps in imports().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("target,allowed", sorted(ONLY_IMPORTED_BY.items()))
def test_only_its_callers_import(target, allowed):
    bad = sorted(m for m, deps in imports().items()
                 if any(within(d, [target]) for d in deps) and not within(m, [target, *allowed]))
    assert not bad, f"{target} may be imported by {', '.join(allowed)} only; also by {', '.join(bad)}"


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific name that holds ``module``."""
    best = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if within(module, [name]) and (best is None or len(name) > best[1]):
                best = (index, len(name))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_layers_never_import_upward():
    bad = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
                 for m, deps in imports().items() for d in deps if layer_of(d) > layer_of(m))
    assert not bad, "; ".join(bad)


def test_the_planner_stays_under_3000_lines():
    """The planner (``analysis/plan/``) does not grow with what holds it to the world (issue 49): the fit and
    the published runs read it from ``analysis/``, and fitted figures live in data files."""
    plan = Path(__file__).resolve().parent.parent / "src" / "paralab" / "analysis" / "plan"
    lines = sum(len(f.read_text().splitlines()) for f in plan.glob("*.py"))
    assert lines < 3000, f"analysis/plan/ is {lines} lines"
