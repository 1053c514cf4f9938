"""A report's figures, drawn after its text is laid out, one process per core where that is cheap.

Matplotlib draws on one core, and a comparison's ten figures took longer than
any of its runs. A report asks for each figure by name (:class:`Figures`
``.add``) while it writes its sections, then :meth:`Figures.draw` draws them
all: in this process, or with ``processes > 1`` in children of the caller's
preloaded forkserver (``run/warm.py``; ``paralab compare`` has one running
since its start, so a child begins without importing torch again). A figure
that fails is named with its error, and the report leaves it out; the others
are unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def _draw(fn, path: Path, args: tuple, kw: dict) -> str | None:
    try:
        fn(*args, path, **kw)
    except Exception as exc:  # noqa: BLE001 - one figure failing must not lose the report
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class Figures:
    folder: Path
    jobs: list = field(default_factory=list)     # (name, plotting function, args, keyword args)

    def add(self, fn, name: str, *args, **kw) -> Path:
        """Ask for ``fn(*args, folder / name, **kw)``; the path it will have."""
        self.jobs.append((name, fn, args, kw))
        return self.folder / name

    def draw(self, processes: int = 1) -> dict[str, str]:
        """Draw every figure asked for; ``{name: why it was not drawn}`` for those that failed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if processes <= 1 or len(self.jobs) <= 1:
            results = [_draw(fn, self.folder / name, args, kw) for name, fn, args, kw in self.jobs]
        else:
            from concurrent.futures import ProcessPoolExecutor
            from ..run.warm import forkserver
            with ProcessPoolExecutor(min(processes, len(self.jobs)), mp_context=forkserver()) as pool:
                futures = [pool.submit(_draw, fn, self.folder / name, args, kw) for name, fn, args, kw in self.jobs]
                results = []
                for f in futures:
                    try:
                        results.append(f.result())
                    except Exception as exc:  # noqa: BLE001 - a child that died, an argument that would not pickle
                        results.append(f"{type(exc).__name__}: {exc}")
        return {name: why for (name, *_), why in zip(self.jobs, results) if why}
