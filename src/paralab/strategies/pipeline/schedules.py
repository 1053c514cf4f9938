"""The schedules by name: which rank holds which stage, what a layout allows, and the built lists.

:func:`build_schedule` turns a schedule's name (``--schedule``) and a layout
(``p`` ranks, ``m`` microbatches, ``v`` stages per rank) into a
:class:`~.actions.Schedule`: the compute order from its builder
(``builders.py``), the sends and receives from ``actions.with_transfers``.
"""
from __future__ import annotations

from .actions import Schedule, with_transfers
from .builders import gpipe, interleaved_1f1b, one_f_one_b, virtual_gpipe, zb_h1, zb_h2

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b")
#: schedules that hold several stages per rank (``--virtual-stages``)
VIRTUAL = ("interleaved-1f1b",)
#: PyTorch's V-shaped zero-bubble schedules, which only ``torch-pipeline`` runs (see its module)
TORCH_ONLY = ("zbv", "dualpipev")


# ---------------------------------------------------------------- building
def placement_for(name: str, workers: int, virtual: int = 1) -> tuple[int, ...]:
    """Which rank holds each stage: one stage per rank, or ``v`` interleaved (stage s on rank s mod p)."""
    stages = workers * (virtual if name in VIRTUAL else 1)
    return tuple(s % workers for s in range(stages))


def layout_problem(name: str, workers: int, microbatches: int, virtual: int = 1) -> str | None:
    """Why schedule ``name`` cannot run this layout (None if it can), in words for the user."""
    if name in TORCH_ONLY:
        return (f"{name} is run by torch-pipeline only (PyTorch's schedule); ours are {', '.join(SCHEDULES)}: "
                f"'paralab train torch-pipeline --schedule {name}'")
    if name not in SCHEDULES:
        return f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    if name in VIRTUAL:
        if virtual < 2:
            return f"{name} holds several stages per rank: give --virtual-stages 2 or more"
        if microbatches % workers:
            return (f"{name} feeds microbatches in groups of one per pipeline rank: --microbatches "
                    f"{microbatches} must be a multiple of the {workers} pipeline stages")
    elif virtual != 1:
        return f"--virtual-stages {virtual} applies to {', '.join(VIRTUAL)} only, not {name}"
    return None


def build_schedule(name: str, workers: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Every rank's ordered action list for schedule ``name``.

    ``interleaved-1f1b`` with ``m`` not a multiple of ``p`` (only an epoch's
    short last batch: the configured ``m`` is checked before start) runs
    GPipe's order over the same interleaved layout.
    """
    if workers < 1 or microbatches < 1:
        raise ValueError("workers and microbatches must be positive")
    problem = layout_problem(name, workers, microbatches, virtual)
    short_batch = name in VIRTUAL and virtual >= 2 and microbatches % workers
    if problem and not short_batch:
        raise ValueError(problem)
    placement = placement_for(name, workers, virtual)
    if name == "gpipe":
        compute = gpipe(workers, microbatches)
    elif name == "1f1b":
        compute = one_f_one_b(workers, microbatches)
    elif name == "zb-h1":
        compute = zb_h1(workers, microbatches)
    elif name == "zb-h2":
        compute = zb_h2(workers, microbatches)
    elif short_batch:
        compute = virtual_gpipe(workers, microbatches, virtual)
    else:
        compute = interleaved_1f1b(workers, microbatches, virtual)
    return Schedule(name, microbatches, placement, with_transfers(compute, placement))
