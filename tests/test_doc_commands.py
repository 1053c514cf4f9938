"""Every ``paralab train ... --check`` the README and docs/ print PASSes as printed.

The commands are read from the pages themselves (code blocks and inline code),
so a page that changes is tested as it now reads. Each runs in a folder of its
own (its ``--out runs/...`` lands there) and must exit 0 with ``check: PASS``.
A page may print a check that is meant to fail (fp32 at real settings, to show
why fp64 exists): the line says so with ``# FAILs`` and must then exit 1 with
``check: FAIL``. Commands this machine cannot run (a GPU, several hosts) are
left out here by the reason in :data:`ELSEWHERE`; `make gpu-check` runs the GPU
path where one is lent.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import run_paralab

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: what a command holds that this machine cannot give it, and why it is left out here
ELSEWHERE = {"--device cuda": "needs a CUDA GPU", "torch-dp": "needs CUDA GPUs", "--rank": "one rank of several hosts",
             "torch-cp": "needs CUDA"}
#: the first selected test sets up every command (:func:`printed`): about three minutes of the slow selection on the
#: 2-core VM, past the suite's default limit per test
pytestmark = pytest.mark.timeout(1200)
#: models no two of whose checks run at once (memory, below): CS1390's VGG-16 with its 7x7 pool (134M parameters);
#: without the pool it has 34M and runs beside another command
FULL_SIZE = ("vgg16-cs1390-pool",)
#: the default selection runs the README's (the tour); the pages' (half a minute to several minutes each in
#: fp64, a check's default) run in the slow selection
DEFAULT = ("README.md",)


def commands() -> list[tuple[str, str, bool]]:
    """(page:line, command, expected to fail) for every `paralab train ... --check` the pages print."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            while line.rstrip().endswith("\\") and n < len(lines):  # a command continued on the next line
                line = line.rstrip()[:-1] + " " + lines[n].strip()
                n += 1
            for text in re.findall(r"`(paralab train [^`]*)`", line) or [line.strip()]:
                if not text.startswith("paralab train ") or not re.search(r"--check(\s|$)", text):
                    continue
                command, _, comment = text.partition("#")
                if "..." in command or "STRATEGY" in command:  # a pattern, not a command
                    continue
                found.append((f"{page.relative_to(ROOT)}:{n}", " ".join(command.split()), "FAILs" in comment))
    return found


def distinct() -> list[tuple[str, str, bool]]:
    """Each command once (a page may print one another page prints too, word for word): its first place, and
    the others after it (``README.md:120 = docs/own-strategy.md:67``)."""
    places: dict[tuple[str, bool], list[str]] = {}
    for where, command, fails in commands():
        places.setdefault((command, fails), []).append(where)
    return [(" = ".join(wheres), command, fails) for (command, fails), wheres in places.items()]


CASES = [pytest.param(where, command, fails, id=where,
                      marks=[] if where.startswith(DEFAULT) and "--workers 8" not in command else [pytest.mark.slow])
         for where, command, fails in distinct()]


def test_the_pages_print_checks_and_each_is_run_once():
    found = commands()
    where = [w for w, _, _ in found]
    assert len(where) >= 25 and len(set(where)) == len(where)
    assert any(w.startswith("README.md") for w in where) and any(w.startswith("docs/correctness.md") for w in where)
    # every place is run, each command once
    assert sorted(w for c in CASES for w in c.values[0].split(" = ")) == sorted(where)
    assert len({(c.values[1], c.values[2]) for c in CASES}) == len(CASES) < len(found)


def scratch_root(tmp_path_factory) -> Path:
    """Where the commands' folders go: in memory (/dev/shm) where it has room, since a full-size model's
    checkpoints (two 1 GB files at 134M parameters) are written and fsynced, which is the disk's time, not the
    command's; else the session's temporary folder."""
    import os
    import shutil
    import tempfile
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 16 * 2 ** 30:
        return Path(tempfile.mkdtemp(prefix="paralab-doc-", dir=shm))
    return tmp_path_factory.mktemp("doc-commands")


def run_printed(command: str, folder: Path):
    """The command's result, run in ``folder``, which is removed after it: only the output is read, and a
    full-size model's checkpoints would otherwise fill /dev/shm while the other commands run."""
    import shutil
    folder.mkdir()
    (folder / "examples").symlink_to(ROOT / "examples")  # the pages' paths are the repository's (examples/...)
    try:
        # as printed: no --check-cache of the session's (no two commands share a reference, and below fp64 a
        # reference kept for later trains its noise band at every checked step, exact or not)
        return run_paralab(*shlex.split(command)[1:], fast=False, timeout=900, cwd=folder, share=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def printed(request, tmp_path_factory):
    """Every selected command's result, by its place: run two at a time, each in a folder of its own (a run's
    ranks often wait, for each other or for rank 0's check, and the other command's compute meanwhile: on the
    2-core VM the slow selection's commands took about a quarter less than one at a time)."""
    import shutil

    from conftest import selected, two_at_a_time_heavy_alone
    wanted = [(w["where"], w["command"]) for w in selected(request, "test_a_printed_check_passes_as_printed")
              if not elsewhere(w["command"])]
    # a full-size VGG-16 (134M parameters) in fp32: its ranks' models and its reference take about 9 GB, and
    # where a band is needed its three more references (one in float64) up to about 13 GB of the 24 GB VM, so
    # no two such commands run at once: they run one after another, beside the small ones
    root = scratch_root(tmp_path_factory)
    try:
        results = two_at_a_time_heavy_alone(lambda i, wc: run_printed(wc[1], root / f"run{i}"), wanted,
                                            lambda wc: any(model in wc[1] for model in FULL_SIZE))
        yield {where: r for (where, _), r in zip(wanted, results)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def elsewhere(command: str) -> str | None:
    return next((why for what, why in ELSEWHERE.items() if what in command), None)


@pytest.mark.parametrize("where,command,fails", CASES)
def test_a_printed_check_passes_as_printed(where, command, fails, printed):
    reason = elsewhere(command)
    if reason:
        pytest.skip(f"{where}: {reason}")
    r = printed[where]
    output = r.stdout[-3000:] + r.stderr[-3000:]
    if fails:
        assert r.returncode == 1 and "check: FAIL" in r.stdout, f"{where}: {command}\n{output}"
    else:
        assert r.returncode == 0 and "check: PASS" in r.stdout, f"{where}: {command}\n{output}"
