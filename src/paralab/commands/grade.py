"""Grade a course's submissions: each student's strategy checked in a sandbox, scored, and reported.

SUBMISSIONS is a folder of students' .py files, or of folders each holding one (the entry's name is the
student's id). Each is trained at the assignment's worker counts with --check, inside a bubblewrap sandbox
(no network, no other file to read, its own processes, time and memory limits), and scored by the
assignment's tests (docs/grading.md):

  paralab grade --list
  paralab grade submissions/ --assignment cs744-allreduce --out grades/
  paralab grade submissions/ --assignment my-assignment.toml --out grades/

Writes OUT/gradebook.csv (a row per submission: score, max_score, a column per test), OUT/report.html, and
for Gradescope OUT/<id>/results.json (a course's run_autograder can grade one submission this way). Exit 0
when every submission was graded (whatever its score), 2 for bad input. Without bubblewrap the grader
refuses to run a submission unless --no-sandbox (for files you trust: your own reference solutions).
"""
from __future__ import annotations

import csv
import html
import json
import shutil
import sys
import time
from pathlib import Path

from ..errors import UsageError

HELP = "grade students' strategy files: each checked in a sandbox, a gradebook and Gradescope results"


def add_arguments(p) -> None:
    p.add_argument("submissions", nargs="?", help="a folder of .py files, or of folders holding one each")
    p.add_argument("--assignment", help="a built-in assignment (--list) or an assignment .toml file")
    p.add_argument("--out", help="folder for the gradebook, the report and each submission's runs (new)")
    p.add_argument("--list", action="store_true", help="list the built-in assignments and exit")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run submissions with your own rights (only for files you trust)")
    p.add_argument("--jobs", type=int, default=1,
                   help="submissions graded at once (default 1; each run's ranks share the cores with the others')")


def entries(folder: Path) -> list[tuple[str, Path]]:
    """(student id, file) per entry: a .py file, or a folder with exactly one .py file."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():  # it could name another student's file, which the sandbox would then show it
            found.append((entry.stem if entry.suffix == ".py" else entry.name, entry))
        elif entry.is_file() and entry.suffix == ".py":
            found.append((entry.stem, entry))
        elif entry.is_dir():
            files = sorted(entry.glob("*.py"))
            found.append((entry.name, files[0] if len(files) == 1 and not files[0].is_symlink() else entry))
    return found


def run(args) -> int:
    from ..grading import assignment as assignments
    if args.list:
        for name, path in assignments.built_in().items():
            a = assignments.load(str(path))
            print(f"{name:22s} {a.form:9s} workers {','.join(map(str, a.workers)):6s} {a.title}")
        return 0
    if not args.submissions or not args.assignment or not args.out:
        raise UsageError("give SUBMISSIONS, --assignment and --out (or --list)")
    a = assignments.load(args.assignment)
    subs = Path(args.submissions).absolute()
    if not subs.is_dir():
        raise UsageError(f"{subs} is not a folder of submissions")
    found = entries(subs)
    if not found:
        raise UsageError(f"{subs} holds no .py file and no folder: nothing to grade")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1 (got {args.jobs})")
    out = Path(args.out).absolute()
    from ..run import folder
    folder.refuse_taken(out)
    from ..grading import sandbox
    if not args.no_sandbox:
        why = sandbox.available()
        if why:
            raise UsageError(f"cannot start a sandbox: {why}. Students' files are not run without one; pass "
                             "--no-sandbox only for files you trust")
    try:
        out.mkdir(parents=True)
    except OSError as exc:
        from ..errors import write_refused
        raise write_refused(f"--out {out}", exc) from None
    return grade_all(a, found, subs, out, sandboxed=not args.no_sandbox, jobs=args.jobs)


def grade_all(a, found: list[tuple[str, Path]], subs: Path, out: Path, *, sandboxed: bool, jobs: int = 1) -> int:
    from ..grading import sandbox, weights
    from ..grading.grade import Graded, Test, grade, reference_argv, reference_name
    reference_seconds, truth = {}, None
    if a.points.get("speed") or a.points.get("check"):
        # paralab's own run, outside the sandbox: the time the speed test compares with, and the final weights
        # every check compares with (a run's own verdict is written by processes the student's code shares)
        workers = max(a.workers) if a.reference else 1
        ref = out / ".reference"
        ref.mkdir()
        print(f"grade: the reference ({reference_name(a)}) at {workers} worker(s)", file=sys.stderr, flush=True)
        outcome = sandbox.run(reference_argv(a, workers, ref / f"w{workers}"),
                              sandbox.Limits(a.time_limit_s * 2, 2 ** 40, 4096, int(a.time_limit_s * 4)),
                              sandboxed=False, env=None, workdir=ref)
        try:
            reference_seconds[workers] = json.loads((ref / f"w{workers}" / "summary.json").read_text())[
                "seconds_per_iter_median"]
            truth, why = weights.read_truth(ref / f"w{workers}", a.train)
        except (OSError, ValueError, KeyError):
            why = f"exit code {outcome.returncode}: {outcome.stderr.strip()[-400:]}"
        if truth is None:  # the assignment's own settings do not train: nothing can be graded against them
            shutil.rmtree(out, ignore_errors=True)
            raise UsageError(f"the assignment's own reference ({reference_name(a)}) does not run with its "
                             f"train options, so nothing was graded ({why}); fix the assignment file")
        shutil.rmtree(ref, ignore_errors=True)
    t0 = time.monotonic()

    def one(entry) -> Graded:
        sid, file = entry
        if not file.is_dir() and not file.is_symlink():
            return grade(file.resolve(), sid, a, out / sid, sandboxed=sandboxed,
                         hidden=[subs.resolve(), out.resolve()], reference_seconds=reference_seconds, truth=truth)
        why = (f"{file.name} is a symbolic link: submit the file itself" if file.is_symlink() else
               f"{file.name}/ must hold exactly one .py file (and not a link)")
        g = Graded(sid, [Test("loads", 0.0, a.max_score, why)])
        (out / sid).mkdir()
        (out / sid / "results.json").write_text(json.dumps(g.results(), indent=1))
        return g

    from concurrent.futures import ThreadPoolExecutor, as_completed
    by_id: dict[str, Graded] = {}
    with ThreadPoolExecutor(jobs) as pool:  # each job waits on its sandboxed process
        futures = {pool.submit(one, entry): entry[0] for entry in found}
        for i, done in enumerate(as_completed(futures), 1):
            g = by_id[futures[done]] = done.result()
            failed = [t.name for t in g.tests if t.score < t.max_score]
            print(f"grade: [{i}/{len(found)}] {g.submission}: {g.score:g}/{g.max_score:g}"
                  + (f" (lost: {', '.join(failed)})" if failed else "") + f"  {time.monotonic() - t0:.0f} s",
                  flush=True)
    graded = [by_id[sid] for sid, _ in found]
    write_gradebook(out / "gradebook.csv", graded)
    write_report(out / "report.html", a, graded)
    print(f"grade: {len(graded)} submission(s) -> {out / 'gradebook.csv'}, {out / 'report.html'}")
    return 0


def write_gradebook(path: Path, graded) -> None:
    names = list(dict.fromkeys(t.name for g in graded for t in g.tests))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "score", "max_score", *names])
        for g in graded:
            by = {t.name: t.score for t in g.tests}
            w.writerow([g.submission, f"{g.score:g}", f"{g.max_score:g}", *(f"{by[n]:g}" if n in by else ""
                                                                                for n in names)])


def write_report(path: Path, a, graded) -> None:
    """One page: the scores, then per student every test's score and feedback (all escaped: it quotes the
    students' own output)."""
    e = html.escape
    rows = "".join(f"<tr><td><a href='#{e(g.submission)}'>{e(g.submission)}</a></td><td>{g.score:g}</td>"
                   f"<td>{g.max_score:g}</td></tr>" for g in graded)
    parts = [f"<!doctype html><meta charset='utf-8'><title>{e(a.name)}</title>",
             f"<h1>{e(a.name)}: {e(a.title)}</h1>", "<table border=1><tr><th>submission</th><th>score</th>"
             f"<th>max</th></tr>{rows}</table>"]
    for g in graded:
        parts.append(f"<h2 id='{e(g.submission)}'>{e(g.submission)}: {g.score:g} / {g.max_score:g}</h2><table "
                     "border=1><tr><th>test</th><th>score</th><th>feedback</th></tr>")
        parts += [f"<tr><td>{e(t.name)}</td><td>{t.score:g} / {t.max_score:g}</td><td><pre>{e(t.output)}</pre>"
                  "</td></tr>" for t in g.tests]
        parts.append("</table>")
    path.write_text("\n".join(parts))
