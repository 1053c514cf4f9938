"""Every option of every command, given values no one should give: it exits with its code (2 for bad input, 4 for
a write the system refused; 0, 1 or 3 where the value is allowed and the run says so), one line, no traceback.

The options are read from the parser itself (every sub-command, every flag that takes a value), so a new option
is fuzzed without being listed here. Each command runs in this process; where a value passes every check, the
command's work (training, a layout search, a sweep's runs) is replaced by a stub that raises ``Accepted``: what
is tested is the refusal, which happens before any work starts. What the work itself does with an accepted
value is the subject of the commands' own tests.
"""
from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from paralab import cli

#: NaN, infinity, negative, zero, huge, an integer past 64 bits, empty, blank, not a number, paths that cannot be
VALUES = ["nan", "inf", "-inf", "-1", "0", "1e30", "99999999999999999999", "", " ", "x", "/proc/paralab-fuzz/x",
          "/sys/paralab-fuzz"]


class Accepted(Exception):
    """The command passed its checks and was about to work."""


def accept(*_args, **_kwargs):
    raise Accepted


def leaves(parser, path=()):
    """(the command's words, its flags that take a value, its positionals) for every runnable sub-command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        for name, child in subs[0].choices.items():
            yield from leaves(child, (*path, name))
        return
    flags = [a.option_strings[-1] for a in parser._actions if a.option_strings and a.nargs != 0
             and not isinstance(a, (argparse._HelpAction, argparse.BooleanOptionalAction))]
    yield path, flags


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A small finished run, for the commands that read one."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    code = cli.main(["train", "single", "--dataset", "synthetic", "--synthetic-size", "64", "--width", "0.1",
                     "--batch-size", "16", "--num-batches", "1", "--eval-batches", "1", "--no-progress",
                     "--out", str(out)])
    assert code == 0
    return out


def base(words: tuple, run: Path) -> list[str]:
    """Arguments that make the command valid, before the fuzzed option."""
    return {
        ("train",): ["train", "single", "--dataset", "synthetic", "--synthetic-size", "64", "--width", "0.1",
                     "--batch-size", "16", "--num-batches", "1"],
        ("data", "download"): ["data", "download", "fashion-mnist"],  # not downloadable: nothing is fetched
        ("compare",): ["compare", "--strategies", "single", "--dry-run"],
        ("plot",): ["plot", "timeline", str(run)],
        ("export",): ["export", str(run)],
        ("serve",): ["serve", "--status"],  # asks; never starts a server
        ("calc", "run"): ["calc", "run", str(run)],
    }.get(words, list(words))


COMMANDS = list(leaves(cli.build_parser()))


@pytest.mark.parametrize("words,flags", COMMANDS, ids=[" ".join(w) for w, _ in COMMANDS])
def test_every_option_refuses_what_it_cannot_take_without_a_traceback(words, flags, run_dir, tmp_path, monkeypatch):
    import paralab.analysis.plan as planner
    import paralab.commands.sweep as sweep
    import paralab.run.launch as launch
    monkeypatch.setattr(launch, "launch", accept)
    monkeypatch.setattr(planner, "make_plan", accept)
    monkeypatch.setattr(planner, "evaluate", accept)
    monkeypatch.setattr(sweep.Sweep, "start", accept)
    monkeypatch.setattr("paralab.commands.partition.measure_unit_times", accept)
    monkeypatch.chdir(tmp_path)  # whatever a value makes lands here
    assert flags or words in (("calc", "run"),), words
    tried = 0
    for flag in flags:
        for value in VALUES:
            if words == ("export",) and flag in ("-o", "--output") and value in ("0", "x", "-1", "nan"):
                value = f"{tmp_path}/{value}.pt"  # a plain name: written here, not into the run's folder
            argv = [*base(words, run_dir), f"{flag}={value}"]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    code = cli.main(argv)
            except Accepted:
                code = 0
            except SystemExit as exc:  # argparse's own refusal
                code = exc.code
            except Exception as exc:  # noqa: BLE001 - what this test is for
                raise AssertionError(f"paralab {' '.join(argv)!r} raised {type(exc).__name__}: {exc}") from exc
            assert code in (0, 1, 2, 3, 4), (argv, code, err.getvalue())
            assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
            if code == 2:
                assert err.getvalue().strip(), argv  # a refusal says what to change
            tried += 1
    assert tried == len(flags) * len(VALUES)
