"""An assignment: what a submission must be, how it is run, and what each test is worth.

An assignment is a TOML file (the built-in ones sit beside this module, ``assignments/NAME.toml``;
``paralab grade --list`` shows them; docs/grading.md documents every key):

- ``form``: what a submission file holds: ``replicas`` (a ``Replicas`` with ``finish()``), ``strategy``
  (a whole ``Strategy``) or ``schedule`` (a pipeline schedule function, run by ``paralab train pipeline
  --schedule FILE``);
- ``workers``: the worker counts it is checked at; ``train``: the rest of its ``paralab train`` options;
- ``collectives``: the ``self.comm`` operations it may call (empty: any); a call to ``torch.distributed``
  itself always loses that test (paralab cannot count or time it);
- ``[bytes]``: what each rank should send per step, as a formula in ``N`` (the workers) times the gradient's
  bytes, for the root (rank 0) and the others, with a relative tolerance;
- ``reference``: a paralab strategy (a schedule, for ``schedule``) the grader runs itself, outside the
  sandbox: the final weights every check is compared with, and the time the speed test is measured
  against (without one, ``single`` on one worker gives the weights);
- ``time_limit_s``, ``memory_gb``, ``processes``: the sandbox's limits per run;
- ``[points]``: each test's points (``loads``, ``check``, ``collectives``, ``bytes``, ``speed``).
"""
from __future__ import annotations

import ast
import operator
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

BUILT_IN = Path(__file__).with_name("assignments")
FORMS = ("replicas", "strategy", "schedule")
TESTS = ("loads", "check", "collectives", "bytes", "speed")


@dataclass(frozen=True)
class Assignment:
    name: str
    title: str
    form: str
    workers: tuple[int, ...]
    train: tuple[str, ...]
    collectives: tuple[str, ...] = ()
    bytes_root: str | None = None
    bytes_other: str | None = None
    bytes_tolerance: float = 0.05
    reference: str | None = None
    time_limit_s: float = 120.0
    memory_gb: float = 4.0
    processes: int = 64
    points: dict = field(default_factory=dict)

    @property
    def max_score(self) -> float:
        return float(sum(self.points.values()))

    def expected_bytes(self, rank: int, world: int) -> float | None:
        """This rank's bytes per step over the gradient's bytes, by the assignment's formula (None: not graded)."""
        formula = self.bytes_root if rank == 0 else self.bytes_other
        return None if formula is None else formula_value(formula, world)


def built_in() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BUILT_IN.glob("*.toml"))}


def load(name: str) -> Assignment:
    """A built-in assignment by name, or a TOML file: checked whole, UsageError naming the key at fault."""
    path = built_in().get(name) or Path(name)
    if not path.is_file():
        raise UsageError(f"--assignment {name!r} is neither a built-in assignment ({', '.join(built_in())}) nor "
                         "a file")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not TOML: {exc}") from None

    def need(key, kind, default=None):
        value = doc.get(key, default)
        if value is None or not isinstance(value, kind):
            raise UsageError(f"{path}: {key!r} must be a {kind.__name__ if isinstance(kind, type) else 'value'}"
                             f"{'' if default is not None else ' (required)'}")
        return value

    unknown = set(doc) - {"name", "title", "form", "workers", "train", "collectives", "bytes", "reference",
                          "time_limit_s", "memory_gb", "processes", "points"}
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(sorted(unknown))} (docs/grading.md lists them)")
    form = need("form", str)
    if form not in FORMS:
        raise UsageError(f"{path}: form must be one of {', '.join(FORMS)} (got {form!r})")
    workers = need("workers", list)
    if not workers or not all(isinstance(w, int) and 1 <= w <= 8 for w in workers):
        raise UsageError(f"{path}: workers must list worker counts from 1 to 8 (got {workers!r})")
    points = need("points", dict)
    if set(points) - set(TESTS) or not all(isinstance(v, (int, float)) and v >= 0 for v in points.values()):
        raise UsageError(f"{path}: points must give tests among {', '.join(TESTS)} a number >= 0 each")
    if not any(points.values()):
        raise UsageError(f"{path}: points are all zero: nothing would be graded")
    sent = doc.get("bytes", {})
    for key in ("root", "other"):
        if key in sent:
            formula_value(str(sent[key]), 2, where=f"{path}: bytes.{key}")
        elif points.get("bytes"):
            raise UsageError(f"{path}: points.bytes needs [bytes] {key} = a formula in N")
    if form == "schedule" and (points.get("check") or points.get("speed")) and not doc.get("reference"):
        raise UsageError(f"{path}: form schedule needs reference = a schedule (the grader's own run, the answer "
                         "every check's final weights are compared with)")
    if points.get("speed") and not doc.get("reference"):
        raise UsageError(f"{path}: points.speed needs reference = a paralab strategy to time against")
    limits = {k: need(k, (int, float), d) for k, d in (("time_limit_s", 120.0), ("memory_gb", 4.0),
                                                      ("processes", 64))}
    if not all(v > 0 for v in limits.values()):
        raise UsageError(f"{path}: time_limit_s, memory_gb and processes must be positive")
    return Assignment(name=str(doc.get("name", path.stem)), title=need("title", str, ""), form=form,
                      workers=tuple(workers), train=tuple(str(a) for a in need("train", list, [])),
                      collectives=tuple(need("collectives", list, [])),
                      bytes_root=str(sent["root"]) if "root" in sent else None,
                      bytes_other=str(sent["other"]) if "other" in sent else None,
                      bytes_tolerance=float(sent.get("tolerance", 0.05)), reference=doc.get("reference"),
                      time_limit_s=float(limits["time_limit_s"]), memory_gb=float(limits["memory_gb"]),
                      processes=int(limits["processes"]), points={k: float(v) for k, v in points.items()})


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def formula_value(text: str, n: int, where: str = "formula") -> float:
    """The value of an arithmetic formula in ``N`` (numbers, N, + - * / and parentheses; nothing else is
    evaluated)."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id == "N":
            return float(n)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise UsageError(f"{where}: {text!r} may hold numbers, N, + - * / and parentheses only")
    try:
        return value(ast.parse(text, mode="eval"))
    except SyntaxError:
        raise UsageError(f"{where}: {text!r} is not a formula") from None
    except ZeroDivisionError:
        raise UsageError(f"{where}: {text!r} divides by zero at N = {n}") from None
