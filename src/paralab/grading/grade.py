"""Grade one submission: its runs in the sandbox, then each test read from the runs' records.

For each worker count of the assignment, the submission trains with ``--check`` in a sandbox
(``sandbox.py``) into ``OUT/<id>/w<N>``. The tests read what the runs left:

- ``loads``: the file passed paralab's start-up checks (a refusal, exit 2, is the feedback);
- ``check``: at each worker count, ``check: PASS`` against the single-process reference (its share of the
  points per count), borne out by the run's final weights read outside the sandbox against paralab's own
  run (``weights.py``: the verdict is written by processes the student's code shares); the feedback is the
  check's lines and the first divergence, or how the run ended;
- ``collectives``: every ``self.comm`` operation of the training steps (``spans.jsonl``, by name and count)
  among those the assignment allows, and no call to ``torch.distributed`` itself;
- ``bytes``: each rank's bytes on the wire per step over the gradient's bytes, against the assignment's
  formula: a ring all-reduce puts ``2(N-1)/N`` of its tensor on the wire, an all-gather, a reduce-scatter
  and an all-to-all ``(N-1)/N`` of the whole, a broadcast's or a scatter's root ``N-1`` copies, a gather's
  every other rank one, a send its tensor (:func:`wire_bytes`);
- ``speed``: the median step time at the largest worker count against the assignment's reference
  strategy's, run beside it (full points within twice its time).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import sandbox, weights
from .assignment import Assignment

SPEED_FACTOR = 2.0  # the speed test passes within this multiple of the reference's step time
EXPORTED = "model.pt"  # a strategy-form run's model, as `paralab export` wrote it in the sandbox
ELEMENT_BYTES = {"fp64": 8, "fp32": 4, "bf16": 4, "fp16": 4}  # a gradient's element (autocast keeps fp32 gradients)


@dataclass
class Test:
    name: str
    score: float
    max_score: float
    output: str

    def as_gradescope(self) -> dict:
        return {"name": self.name, "score": round(self.score, 4), "max_score": self.max_score, "output": self.output}


@dataclass
class Graded:
    submission: str
    tests: list[Test] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def results(self) -> dict:
        """Gradescope's ``results.json``."""
        return {"score": round(self.score, 4), "tests": [t.as_gradescope() for t in self.tests]}


def train_argv(a: Assignment, file: Path, workers: int, out: Path) -> list[str]:
    form = ["pipeline", "--schedule", str(file)] if a.form == "schedule" else [str(file)]
    return [sys.executable, "-m", "paralab", "train", *form, "--workers", str(workers), *a.train, "--check",
            "--no-progress", "--timeout", str(int(max(10, a.time_limit_s / 2))), "--out", str(out)]


def reference_name(a: Assignment) -> str:
    """What the grader runs itself: the assignment's ``reference``, else one process (``single``)."""
    return a.reference or "single"


def reference_argv(a: Assignment, workers: int, out: Path) -> list[str]:
    """paralab's own run of the assignment (:func:`reference_name`; ``single`` on one worker)."""
    form = (["pipeline", "--schedule", a.reference] if a.form == "schedule" and a.reference else
            [reference_name(a)])
    return [sys.executable, "-m", "paralab", "train", *form, "--workers", str(workers), *a.train,
            "--no-progress", "--out", str(out)]


def sandbox_env() -> dict:
    """What a submission's run sees of the environment: nothing of the grader's but a path and a locale."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
            "PARALAB_SERVE": "off", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class Run:
    workers: int
    outcome: sandbox.Outcome
    folder: Path

    @property
    def summary(self) -> dict | None:
        try:
            return json.loads((self.folder / "summary.json").read_text())
        except (OSError, ValueError):
            return None

    def spans(self) -> list[dict]:
        try:
            lines = (self.folder / "spans.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def how_it_ended(self, limits: "sandbox.Limits") -> str:
        """What a student can act on: paralab's own lines about the failure (the rank, the student's line,
        where the ranks disagree), else the exception the run ended with; never paralab's traceback."""
        o = self.outcome
        if o.timed_out:
            return f"stopped at the time limit ({o.seconds:.0f} s)"
        lines = [line for line in o.stderr.splitlines() if line.startswith("paralab:")]
        if lines:
            return f"exit code {o.returncode}:\n" + "\n".join(lines[:12])
        errors = [line for line in o.stderr.splitlines() if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
        said = errors[-1] if errors else f"no error message (exit code {o.returncode})"
        if re.search(r"Resource temporarily unavailable|Cannot allocate memory|MemoryError|Errno 11|Errno 12", said):
            said += (f" (the sandbox allows {limits.processes} processes and threads at once and "
                     f"{limits.memory_bytes / 2 ** 30:g} GB of address space a process)")
        return f"exit code {o.returncode}: {said}"


def grade(file: Path, sid: str, a: Assignment, folder: Path, *, sandboxed: bool, hidden: list[Path],
          reference_seconds: dict[int, float], truth: weights.Truth | None = None) -> Graded:
    """Every test of ``a`` for the submission ``file`` (the student ``sid``), its runs in ``folder``;
    ``truth``: the final weights of paralab's own run, each check's answer (given whenever checks score)."""
    folder.mkdir(parents=True)
    limits = sandbox.Limits(wall_s=a.time_limit_s, memory_bytes=int(a.memory_gb * 2 ** 30),
                            processes=a.processes, cpu_s=int(a.time_limit_s * 2))
    runs = []
    for workers in a.workers:
        out = folder / f"w{workers}"
        outcome = sandbox.run(train_argv(a, file, workers, out), limits, sandboxed=sandboxed, env=sandbox_env(),
                              workdir=folder, writable=folder, readable=[file], hidden=hidden)
        (folder / f"w{workers}.log").write_text(outcome.stdout + outcome.stderr)
        runs.append(Run(workers, outcome, out))
        if a.form == "strategy" and a.points.get("check") and outcome.returncode == 0:
            # the student's layout, put together by the student's consolidate(): in the sandbox too
            done = sandbox.run([sys.executable, "-m", "paralab", "export", str(out), "-o", str(out / EXPORTED)],
                               limits, sandboxed=sandboxed, env=sandbox_env(), workdir=folder, writable=folder,
                               readable=[file], hidden=hidden)
            (folder / f"w{workers}-export.log").write_text(done.stdout + done.stderr)
        if outcome.returncode == 2:  # refused at start: the same file is refused at every count
            break
    graded = Graded(sid)
    p = a.points
    loaded = runs[0].outcome.returncode != 2
    if p.get("loads"):
        graded.tests.append(Test("loads", p["loads"] if loaded else 0.0, p["loads"],
                                 "paralab accepted the file" if loaded else runs[0].how_it_ended(limits)))
    for run in runs if loaded else []:
        if p.get("check"):
            graded.tests.append(check_test(run, p["check"] / len(a.workers), limits, a.form, truth))
    if not loaded and p.get("check"):
        graded.tests.append(Test("check", 0.0, p["check"], "not run: the file did not load"))
    if p.get("collectives"):
        graded.tests.append(collectives_test(runs, a, p["collectives"]) if loaded else
                            Test("collectives", 0.0, p["collectives"], "not run: the file did not load"))
    if p.get("bytes"):
        graded.tests.append(bytes_test(runs, a, p["bytes"]) if loaded else
                            Test("bytes", 0.0, p["bytes"], "not run: the file did not load"))
    if p.get("speed"):
        graded.tests.append(speed_test(runs, p["speed"], reference_seconds, a.reference))
    (folder / "results.json").write_text(json.dumps(graded.results(), indent=1))
    return graded


def check_test(run: Run, points: float, limits: sandbox.Limits, form: str, truth: weights.Truth) -> Test:
    """The run's own verdict (its lines, the first divergence) and, held outside the sandbox, its final
    weights against ``truth``: a PASS the weights do not bear out scores nothing."""
    name = f"check at {run.workers} workers"
    s = run.summary
    check = (s or {}).get("check") or {}
    lines = [line for line in run.outcome.stdout.splitlines() if line.startswith("check")]
    if check.get("result") == "PASS" and run.outcome.returncode == 0:
        said = "\n".join(lines[-3:])
        models, why = weights.final_weights(run.folder, form, truth.tensors, truth.step, run.folder / EXPORTED)
        if not models:
            return Test(name, 0.0, points, f"{said}\nbut the grader cannot read its final weights: {why}")
        worst, where = weights.deviation(models, truth.tensors)
        if worst <= truth.tolerance:
            return Test(name, points, points, said + "\n" + weights.describe(worst, where, truth.tolerance))
        return Test(name, 0.0, points, f"{said}\nthe run reported PASS, but its "
                                       f"{weights.describe(worst, where, truth.tolerance)}: the verdict was not paralab's")
    if check.get("result") == "FAIL":
        return Test(name, 0.0, points, "\n".join(lines))
    return Test(name, 0.0, points, "the run did not finish: " + run.how_it_ended(limits))


def step_spans(runs: list[Run]) -> list[tuple[Run, dict]]:
    """Each operation of the training steps, once: an asynchronous one's launch span (its ``wait:`` span is
    the time the rank then blocked, not another operation)."""
    return [(run, s) for run in runs for s in run.spans()
            if s.get("category") == "comm" and s.get("step", -1) >= 0 and s.get("args", {}).get("op")
            and not s.get("name", "").startswith("wait:")]


def collectives_test(runs: list[Run], a: Assignment, points: float) -> Test:
    counts: dict[str, int] = {}
    for _, s in step_spans(runs):
        counts[s["args"]["op"]] = counts.get(s["args"]["op"], 0) + 1
    direct = {}
    for run in runs:
        for op, n in (((run.summary or {}).get("strategy_details") or {}).get("untimed_collectives") or {}).items():
            direct[op] = direct.get(op, 0) + n
    if not counts and not direct:
        return Test("collectives", 0.0, points, "no training step finished, so no collective was seen")
    called = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none through self.comm"
    wrong = sorted(set(counts) - set(a.collectives)) if a.collectives else []
    text = f"called (every rank, every step, every worker count): {called}"
    if direct:
        text += ("; and torch.distributed directly: " + ", ".join(f"{op} x{n}" for op, n in sorted(direct.items()))
                 + " (use self.comm, which paralab counts and times)")
    if wrong:
        text += f"; not allowed here: {', '.join(wrong)} (allowed: {', '.join(a.collectives)})"
    ok = not wrong and not direct
    return Test("collectives", points if ok else 0.0, points, text)


def wire_bytes(op: str, nbytes: int, rank: int, root: int | None, world: int) -> float:
    """Bytes this rank puts on the wire for one operation of ``nbytes`` (the span's), by the algorithm the
    module names (a ring for the all-to-all kinds, the root sending each copy for the rooted ones)."""
    n = world
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    if op in ("broadcast", "scatter"):
        return (n - 1) * nbytes if rank == (root or 0) else 0.0
    if op == "gather":
        return 0.0 if rank == (root or 0) else float(nbytes)
    if op == "send":
        return float(nbytes)
    return 0.0


def bytes_test(runs: list[Run], a: Assignment, points: float) -> Test:
    found, bad = [], []
    for run in runs:
        s = run.summary
        if not s or not s.get("parameters"):
            bad.append(f"{run.workers} workers: the run did not finish")
            continue
        gradient = s["parameters"] * ELEMENT_BYTES.get(s.get("precision", "fp32"), 4)
        sent: dict[tuple[int, int], float] = {}
        for r, sp in step_spans([run]):
            key = (sp["rank"], sp["step"])
            sent[key] = sent.get(key, 0.0) + wire_bytes(sp["args"]["op"], sp.get("bytes", 0), sp["rank"],
                                                        sp["args"].get("root"), run.workers)
        for rank in range(run.workers):
            per_step = [v for (r, _), v in sent.items() if r == rank]
            ratio = statistics.fmean(per_step) / gradient if per_step else 0.0
            want = a.expected_bytes(rank, run.workers)
            line = f"{run.workers} workers, rank {rank}: {ratio:.3f} x the gradient per step (expected {want:.3f})"
            found.append(line)
            if want is not None and abs(ratio - want) > a.bytes_tolerance * max(want, 1e-9):
                bad.append(line)
    ok = not bad and bool(found)
    text = "\n".join(found) + ("" if ok else "\noff by more than " f"{a.bytes_tolerance:.0%}: " + "; ".join(bad))
    return Test("bytes", points if ok else 0.0, points, text)


def speed_test(runs: list[Run], points: float, reference_seconds: dict[int, float], reference: str | None) -> Test:
    run = max(runs, key=lambda r: r.workers)
    mine = (run.summary or {}).get("seconds_per_iter_median")
    theirs = reference_seconds.get(run.workers)
    if not mine or not theirs:
        return Test("speed", 0.0, points, "not measured: " + ("the run did not finish" if not mine else
                                                              "the reference run did not finish"))
    ratio = mine / theirs
    ok = ratio <= SPEED_FACTOR
    return Test("speed", points if ok else 0.0, points,
                f"{mine * 1e3:.1f} ms a step at {run.workers} workers, {ratio:.2f} x {reference}'s "
                f"{theirs * 1e3:.1f} ms (full points within {SPEED_FACTOR:g} x)")
