"""A strategy from the user's own file: ``paralab train my_allreduce.py --workers 2 --check``.

Where a strategy name ends in ``.py`` (or ``.py:CLASS``), paralab imports that
file and runs its first class (or the one named) exactly as it runs its own:
``--check`` against one process, the records, the time split, timelines, the
report, and composed with ``--tp`` and ``--pp``. The contract is the one
paralab's own data-parallel strategies follow (``replicas.py``; the walk-through
is docs/own-strategy.md):

- subclass :class:`~paralab.strategies.replicas.Replicas` and define
  ``finish()``: after the step's last backward, make every ``p.grad`` of
  ``self.params`` the mean over the replicas, with the collectives of
  ``self.comm`` (paralab's, timed: ``all_reduce``, ``gather``, ``scatter``,
  ``broadcast``, ``all_gather_into``, ``reduce_scatter``; ``self.comm.rank``,
  ``self.comm.world``). ``last_backward()`` (a context around the step's last
  backward) is where gradient hooks may start the exchange early;
- or subclass :class:`~paralab.strategies.base.Strategy` and own the whole step.

Every rank imports the file itself (by its path: start ``paralab`` where the
path is right). A file may call ``torch.distributed`` itself: the run works,
but paralab cannot time those calls, so each rank counts them
(``untimed_collectives`` in summary.json's ``strategy_details``) and the run
and the report say so. A file that does not import, lacks the class or breaks the
contract is refused before any rank starts (exit 2), naming the line.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections import Counter
from pathlib import Path

from ..errors import UsageError

#: what a strategy name that is a file looks like: PATH.py or PATH.py:CLASS
FILE = re.compile(r"^(?P<path>.+\.py)(?::(?P<cls>[A-Za-z_]\w*))?$")

_loaded: dict[tuple, object] = {}  # (use, file, name, version) -> the class or function

#: the modules user files are imported as start so (``_import``)
PREFIX = "paralab_user_"
#: torch.distributed's operations a user's file may call itself, bypassing paralab's timed ``comm``
DIRECT = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "reduce_scatter_tensor", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "send", "recv",
          "isend", "irecv", "batch_isend_irecv", "barrier")
#: this process's calls of DIRECT made from a user's file: operation -> calls
untimed: Counter = Counter()


def _tallied(fn, op: str):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith(PREFIX):  # called from a user's file
            untimed[op] += 1
        return fn(*args, **kwargs)
    call.tallied = True
    return call


def watch_direct_calls() -> None:
    """Count the calls a user's file makes to torch.distributed itself (before it is imported, so a ``from
    torch.distributed import all_reduce`` takes the counting one too). paralab's own calls are not counted."""
    import torch.distributed as dist
    for op in DIRECT:
        fn = getattr(dist, op, None)
        if fn is not None and not getattr(fn, "tallied", False):
            setattr(dist, op, _tallied(fn, op))


def _untimed_summary(cls: type) -> type:
    """``cls`` whose summary also counts the collectives its file called itself (which paralab could not time)."""
    def extra_summary(self) -> dict:
        out = super(counted, self).extra_summary()
        return out | {"untimed_collectives": dict(sorted(untimed.items()))} if untimed else out
    counted = type(cls.__name__, (cls,), {"extra_summary": extra_summary, "__module__": cls.__module__,
                                          "__doc__": cls.__doc__})
    return counted


def is_file(name: str) -> bool:
    """Whether strategy ``name`` is a user's file (``PATH.py`` or ``PATH.py:CLASS``)."""
    return bool(FILE.match(name))


def label(name: str) -> str:
    """A short name for a file strategy (its file's stem, and the class if named): run folders, tables."""
    m = FILE.match(name)
    return Path(m["path"]).stem + (f"-{m['cls']}" if m["cls"] else "") if m else name


def load(name: str) -> type:
    """The strategy class that ``name`` (``PATH.py[:CLASS]``) stands for: the file's class run as it is (a
    Strategy) or wrapped in paralab's data parallelism (a Replicas flavour). Raises UsageError saying what
    to change."""
    return _cached(name, "strategy", lambda path, m: _wrap(name, _find(_import(path), path, m["cls"]), path))


def load_function(name: str, what: str):
    """The function ``name`` (``PATH.py[:FUNCTION]``) stands for: the one named, else the first the file
    defines; ``what`` says what it is for, in errors. Raises UsageError saying what to change."""
    return _cached(name, what, lambda path, m: _function(_import(path), path, m, what))


def _cached(name: str, what: str, make):
    """``make(path, match)`` for file name ``name``, once per file version and use (``what``)."""
    m = FILE.match(name)
    path = Path(m["path"])
    if not path.is_file():
        raise UsageError(f"{what} file {path} does not exist (paths are read from where paralab starts)")
    key = (what, str(path.resolve()), m["cls"], path.stat().st_mtime_ns)
    if key not in _loaded:
        _loaded[key] = make(path, m)
    return _loaded[key]


def _function(module, path: Path, m, what: str):
    functions = [f for f in vars(module).values() if inspect.isfunction(f) and f.__module__ == module.__name__]
    if m["cls"] is not None:
        found = [f for f in functions if f.__name__ == m["cls"]]
        if not found:
            raise UsageError(f"{path} has no function {m['cls']}; it defines: "
                             f"{', '.join(f.__name__ for f in functions) or 'no function'}")
        return found[0]
    if not functions:
        raise UsageError(f"{path} defines no function: define the {what} as the first function in the file")
    return functions[0]


def where(fn) -> str:
    """``PATH:LINE`` of a user's function."""
    return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"


def _import(path: Path):
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]  # the same name in every rank
    module_name = f"{PREFIX}{stem}_{digest}"
    watch_direct_calls()
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a class's module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise UsageError(f"{path}:{exc.lineno}: the file does not parse: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any error while the user's file runs is theirs to fix
        del sys.modules[module_name]
        here = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path.resolve()
                or Path(f.filename) == path]
        line = f":{here[-1].lineno}" if here else ""
        raise UsageError(f"{path}{line}: importing the file failed: {type(exc).__name__}: {exc}") from None
    return module


def _find(module, path: Path, wanted: str | None) -> type:
    classes = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    if wanted is not None:
        found = [c for c in classes if c.__name__ == wanted]
        if not found:
            raise UsageError(f"{path} has no class {wanted}; it defines: "
                             f"{', '.join(c.__name__ for c in classes) or 'no class'}")
        return found[0]
    if not classes:
        raise UsageError(f"{path} defines no class: define one that subclasses paralab.strategies.replicas."
                         "Replicas (a data-parallel strategy: docs/own-strategy.md) as the first class in the file")
    return classes[0]  # the first the file defines (a module's names keep their order)


def _wrap(name: str, cls: type, path: Path) -> type:
    from .base import Strategy
    from .data_parallel import DataParallel
    from .replicas import Replicas
    line = inspect.getsourcelines(cls)[1]
    if issubclass(cls, Strategy):
        needed = {"train_step": "trains a step", "predict": "evaluates", "full_state_dict": "is checked and exported",
                  "state_dict": "checkpoints", "load_state_dict": "resumes",
                  "portable": "checks its optimizer state (every rank's state put together)"}

        def own(method: str) -> bool:  # defined below Strategy (a classmethod is a new object at each lookup)
            return next(k for k in cls.__mro__ if method in vars(k)) is not Strategy
        missing = [m for m in needed if not own(m)]
        if missing:  # refused before start, not a NotImplementedError after training
            raise UsageError(f"{path}:{line}: {cls.__name__} subclasses Strategy but does not define "
                             f"{', '.join(m + '()' for m in missing)}: a run "
                             + ", ".join(f"{needed[m]} with {m}()" for m in missing)
                             + " (docs/own-strategy.md, \"A whole strategy\", says what each returns, and "
                             "examples/strategies/parameter_server.py defines them all; a data-parallel strategy "
                             "subclasses Replicas and defines finish() alone)")
        return _untimed_summary(cls)
    if not issubclass(cls, Replicas):
        raise UsageError(f"{path}:{line}: {cls.__name__} is not a paralab strategy: subclass paralab.strategies."
                         "replicas.Replicas and define finish() (docs/own-strategy.md)")
    if cls.finish is Replicas.finish:
        raise UsageError(f"{path}:{line}: {cls.__name__} does not define finish(), which after backward makes "
                         "every p.grad of self.params the mean over the replicas (docs/own-strategy.md)")
    return _untimed_summary(type(cls.__name__ + "Strategy", (DataParallel,),
                                 {"name": name, "replicas_cls": cls, "__module__": cls.__module__,
                                  "gradient_wire": cls.gradient_wire,
                                  "__doc__": f"{cls.__name__} from {path}, run by paralab's data parallelism"}))
