"""How a run failed, said plainly: the rank that failed first and how, and the command that resumes.

The launcher records how every local rank ended (:class:`Ending`: its exit
code or signal, and what the rank reported before it ended) and
:func:`explain` names the *cause*: the earliest failure that is not a lost
connection to a peer (an exception with its traceback, a signal such as the
out-of-memory killer's SIGKILL, an exit code the rank did not explain), then
the ranks that failed as its consequence or were stopped. A rank's exception
is timed by the rank, a silent death by when the launcher saw it.
:func:`resume_hint` finds the newest complete checkpoint of the run and
spells the exact ``paralab train ... --resume`` command.
"""
from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path

from .config import RunConfig

# Errors a rank raises because *another* rank died: the launcher reports the
# rank whose error is not one of these (the cause), not the ones it brought down.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
             "timed out", "DistNetworkError", "DistBackendError", "Connection refused")


class GroupNotFormed(RuntimeError):
    """The ranks did not all join the process group within ``--timeout``: one never started, or cannot
    reach rank 0's rendezvous. Said in one line, with what to do; no traceback."""


def group_not_formed(rank: int, world: int, where: str, timeout: float, said: BaseException) -> GroupNotFormed:
    """The error a rank raises when its rendezvous at ``where`` (``host:port``) times out."""
    torch_said = (str(said).strip().splitlines() or [type(said).__name__])[0]
    if rank == 0:
        return GroupNotFormed(
            f"rank 0: the group of {world} did not form within --timeout {timeout:g} s ({torch_said}). Rank 0 "
            f"serves the rendezvous at {where}: start every other rank (--rank 1 to {world - 1}, with the same "
            "--world-size, --master-addr and --master-port), or raise --timeout if they start later")
    return GroupNotFormed(
        f"rank {rank}: could not join the group within --timeout {timeout:g} s: rank 0's rendezvous at "
        f"{where} did not answer ({torch_said}). Start rank 0 (it serves the rendezvous), check --master-addr "
        "and --master-port, and that this host can reach that address")


# ---------------------------------------------------------------------------- entry points
def describe(exc: BaseException) -> str:
    """``Type: message``, as the last line of a traceback says it (bounded)."""
    lines = str(exc).strip().splitlines()
    return (f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)[:300]


def is_peer_loss(text: str) -> bool:
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return any(marker in last for marker in PEER_LOSS)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# What a signal that ended a rank usually means (it leaves no traceback).
SIGNAL_HINTS = {
    "SIGKILL": "no traceback: killed from outside the process, by the kernel's out-of-memory killer "
               "(see `dmesg`) or a `kill -9`",
    "SIGSEGV": "a crash in native code (segmentation fault)",
    "SIGBUS": "a crash in native code (bus error; on Linux often a full /dev/shm)",
    "SIGABRT": "native code aborted (e.g. a C++ exception nobody caught)",
    "SIGFPE": "a crash in native code (arithmetic fault)",
    "SIGILL": "a crash in native code (an instruction this CPU lacks)",
    "SIGTERM": "terminated from outside the process",
    "SIGINT": "interrupted",
}


@dataclass
class Ending:
    """How one local rank ended, as the launcher saw it."""
    rank: int
    code: int | None             # exit code; negative: killed by that signal
    seen: float                  # wall clock: when the launcher saw it end
    report: dict | None = None   # what the rank said before it ended (an exception, or an orderly exit)
    stopped: bool = False        # still running after a failure: the launcher stopped it

    @property
    def kind(self) -> str:
        """exception | signal | exit (non-zero, unexplained) | orderly | ok | stopped"""
        if self.report is not None and self.report["kind"] == "exception":
            return "exception"  # (even if the launcher had to stop it after it reported)
        if self.stopped:
            return "stopped"
        if self.code == 0:
            return "ok"
        if self.report is not None:  # an orderly exit it announced (check FAIL, diverged loss)
            return "orderly"
        return "signal" if self.code is not None and self.code < 0 else "exit"

    @property
    def failed(self) -> bool:
        """Failed on its own account or because it lost a peer (not: stopped by the launcher)."""
        return self.kind in ("exception", "signal", "exit")

    @property
    def peer_loss(self) -> bool:
        """Its error is one a rank raises because another rank died."""
        return self.kind == "exception" and is_peer_loss(self.report["traceback"])

    @property
    def time(self) -> float:
        """When it failed: an exception by the rank's own clock (it reports before it exits), a
        silent death by when the launcher saw it."""
        return self.report["time"] if self.kind == "exception" else self.seen

    def what(self) -> str:
        """How it ended, in a few words (``killed by signal SIGKILL``, ``RuntimeError: ...``)."""
        kind = self.kind
        if kind == "exception":
            return self.report["summary"]
        if kind == "signal":
            return f"killed by signal {signal_name(-self.code)}"
        if kind == "exit":
            return f"exited with code {self.code} and no Python error"
        if kind == "orderly":
            return self.report["summary"]
        if kind == "stopped":
            return "still running: stopped by the launcher"
        return "finished (exit code 0)"

    def why(self) -> str:
        """What that usually means, where the ending says no more itself."""
        if self.kind == "signal":
            return SIGNAL_HINTS.get(signal_name(-self.code), "")
        if self.kind == "exit" and (self.code or 0) > 128:
            name = signal_name(self.code - 128)
            if name.startswith("SIG"):
                return (f"{self.code} = 128 + {self.code - 128}: how a shell or container runtime reports a process "
                        f"killed by {name}" + (", most often by the out-of-memory killer: see `dmesg`"
                                               if name == "SIGKILL" else ""))
        if self.kind == "exit":
            return "its own output above may say why"
        return ""


def user_frame(traceback_text: str) -> str | None:
    """The innermost frame of a traceback in a file that is neither paralab's nor Python's or an installed
    package's (a user's strategy file): ``PATH:LINE, in FUNCTION``; None if there is none."""
    import sys
    import sysconfig
    ours = str(Path(__file__).resolve().parent.parent)
    libraries = {ours, sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    for path, line, func in reversed(re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)):
        if path.startswith("<") or any(path.startswith(lib) for lib in libraries if lib):
            continue
        return f"{path}:{line}, in {func}"
    return None


def explain(endings: list[Ending], disagreement: bool = False) -> tuple[Ending, list[str]] | None:
    """The rank that failed first and the lines that say so, or None if no rank failed.

    The cause is the earliest failure that is not a lost peer (an exception,
    a signal, an unexplained exit code); lost peers and the ranks the
    launcher stopped are listed after it as its consequences. Only when
    every failure is a lost connection is the earliest of those named (the
    cause is then outside the ranks: the network, or a process killed
    elsewhere), unless ``disagreement``: the op logs show the ranks calling
    different operations at one place (``hangs.first_mismatch``), so the
    cause is the code that called them, and the caller prints that first.
    """
    failed = [e for e in endings if e.failed]
    if not failed:
        return None
    own = [e for e in failed if not e.peer_loss]
    cause = min(own or failed, key=lambda e: (e.time, e.rank))
    why = cause.why()
    lines = [f"paralab: rank {cause.rank} failed first: {cause.what()}{f' ({why})' if why else ''}; "
             "all ranks stopped."]
    if not own and not disagreement:
        lines.append("paralab: every rank's error is a lost connection; the first is shown. The cause is "
                     "outside the ranks' Python code (the network, or a process ended from elsewhere)")
    if cause.kind == "exception":
        yours = user_frame(cause.report["traceback"])
        if yours:  # a strategy from the user's own file (strategies/user.py): where in it, before the traceback
            lines.append(f"paralab: the error is in your code: {yours}")
        lines.append(cause.report["traceback"].rstrip())
    others = sorted((e for e in endings if e is not cause), key=lambda e: (e.time, e.rank))
    consequences = [e for e in others if e.peer_loss or e.kind == "stopped"]
    if consequences:
        lines.append("paralab: then, as a consequence:")
        for e in consequences:
            last = e.report["traceback"].strip().splitlines()[-1][:200].rstrip() if e.peer_loss else e.what()
            lines.append(f"paralab:   rank {e.rank}: {'lost its peer: ' if e.peer_loss else ''}{last}")
    for e in others:
        if e not in consequences:
            why = e.why()
            verb = "also failed" if e.failed else "had ended"
            lines.append(f"paralab: rank {e.rank} {verb}: {e.what()}{f' ({why})' if why else ''}")
    return cause, lines


def resume_hint(cfg: RunConfig, run_dir, ranks: list[int] | None = None) -> tuple[str, list[str]] | None:
    """After a failure: (the command that resumes the run, the lines that say so), or None when no
    complete checkpoint of this run exists (in the run directory, or the one it resumed from).

    ``ranks``: the ranks whose files must be here (default: all; a manual rank checks its own).
    """
    from .checkpoint import resumable_step
    run_dir = Path(run_dir)
    best = None
    for folder in [run_dir] + ([Path(cfg.resume)] if cfg.resume else []):
        step = resumable_step(folder, cfg, ranks)
        if step is not None and (best is None or step > best[1]):
            best = (folder, step)
    if best is None:
        return None
    folder, step = best
    if cfg.num_batches is not None and step >= cfg.num_batches:
        return None, [f"paralab: training had finished: {folder / 'checkpoint'} holds the last step, {step}; "
                      f"the failure came after it. Its weights: paralab export {shlex.quote(str(folder))}"]
    command = shlex.join(["paralab", "train", *cfg.to_argv(out=str(run_dir), resume=str(folder), save_init=False)])
    if cfg.launched_by in ("torchrun", "slurm"):
        tool = "srun" if cfg.launched_by == "slurm" else "torchrun"
        return command, [f"paralab: the checkpoint of step {step} is complete ({folder / 'checkpoint'}); to resume, "
                         f"give the same {tool} command these paralab arguments:",
                         "  " + command.removeprefix("paralab ")]
    lines = [f"paralab: the checkpoint of step {step} is complete ({folder / 'checkpoint'}); to resume:",
             f"  {command}"]
    if cfg.world_size is not None:
        lines.append("paralab: (this rank's command; every other rank likewise, with its own --rank and run directory)")
    return command, lines
