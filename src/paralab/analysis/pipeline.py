"""A pipeline run's ideal timeline: its schedule replayed on its own measured stage times.

The bubble formulas (``cost.schedule_bubble``) assume every stage takes the
same time. A real cut is never exactly even, so a rank can idle more than
the formula says without any fault in the schedule or the executor: it
waits for a slower neighbour. Replaying the run's schedule in the simulator
(``strategies/pipeline/simulate.simulate``, no communication time) with
each stage's measured mean forward and backward (input and weight parts
where the backward is split) separates the two: the simulated bubble is
what this cut must cost on an ideal machine; what the measured bubble adds
on top of it is communication, scheduling overhead and noise.

A stage's times are the means over the measured steps of the ranks holding
it (``args.stage`` tells a rank's interleaved stages apart). A schedule the
simulator does not know (a stage that runs each batch whole) is replayed as
GPipe over its microbatches, which is what it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kinds import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD

#: the compute spans of a stage, by the schedule's action kinds
STAGE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


@dataclass
class Ideal:
    schedule: str                        # as recorded (a schedule the simulator does not know: replayed as GPipe)
    stages: int                          # pipeline ranks
    virtual: int                         # stages per rank
    microbatches: int
    known: bool                          # the simulator knows this schedule (else: GPipe over the microbatches)
    stage_ms: dict[str, list[float]]     # kind -> mean milliseconds per stage (0: a kind the stage does not run)
    timed: list                          # per rank, the simulated actions (simulate.Timed), in milliseconds

    @property
    def bubble(self) -> list[float]:
        """Per pipeline rank: 1 - compute / step of the replayed step."""
        from ..strategies.pipeline.simulate import simulated_bubble
        return simulated_bubble(self.timed)


def ideal_timeline(run) -> tuple[Ideal | None, str | None]:
    """The run's schedule replayed on its measured stage times: (Ideal, None), or (None, why not)."""
    pipe = run.pipeline
    if pipe is None:
        return None, "no pipeline stages recorded"
    from ..strategies.pipeline.schedules import SCHEDULES, build_schedule, is_own
    from ..strategies.pipeline.simulate import simulate
    m, schedule = pipe["microbatches"], pipe["schedule"]
    known = schedule in SCHEDULES or is_own(schedule)  # a user's schedule: built again from its file
    if not known and m > 1:
        return None, f"no simulator for schedule {schedule} (PyTorch's own)"
    stage_of = run.stages
    ranks_of_pp = sorted(set(stage_of.values()))
    details = run.rank_details(next(iter(stage_of)))
    v = int(details.get("virtual_stages") or 1) if known else 1
    measured = set(run.measured_steps())
    times: dict[str, list[float | None]] = {k: [] for k in STAGE_KINDS}
    for stage in range(len(ranks_of_pp) * v):
        ranks = {r for r, s in stage_of.items() if s == stage % len(ranks_of_pp)}
        mine = [s for s in run.spans if s["rank"] in ranks and s["step"] in measured and s["category"] == COMPUTE
                and s.get("args", {}).get("stage", stage_of[s["rank"]]) == stage]
        for name, out in times.items():
            d = [s["t1"] - s["t0"] for s in mine if s["name"] == name]
            out.append(1000 * sum(d) / len(d) if d else None)
        split = times["backward_input"][-1] is not None
        if times["forward"][-1] is None or (times["backward"][-1] is None and not split):
            return None, f"stage {stage} recorded no forward/backward spans"
    ms = {k: [x if x is not None else 0.0 for x in xs] for k, xs in times.items()}  # kinds a stage does not run
    try:
        timed = simulate(build_schedule(schedule if known else SCHEDULES[0], len(ranks_of_pp), m, v),
                         ms["forward"], ms["backward"], 0.0, input_time=ms["backward_input"],
                         weight_time=ms["backward_weight"])
    except Exception as exc:  # noqa: BLE001 - the caller shows the run without it, and says why
        return None, f"schedule simulation failed: {exc}"
    return Ideal(schedule, len(ranks_of_pp), v, m, known, ms, timed), None
