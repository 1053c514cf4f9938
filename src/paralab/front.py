"""The `paralab` command's entry: the warm server's when one runs (``run/serve.py``), else the command line's.

Nothing here imports torch: a command the server takes is forked from a process that already has.
``python -m paralab.front IDLE_SECONDS`` is the server itself (what `paralab serve` starts).
"""
from __future__ import annotations

import sys


def command_line() -> int:
    """The command line, imported now (in a server's child: from disk as it is then, never in the server)."""
    from .cli import main
    return main()


def main() -> int:
    from .errors import BROKEN_PIPE, exit_code
    from .run.serve import delegate
    if sys.argv[1:2] == ["serve"]:  # starting, asking or stopping the server: no torch in this process
        leave(serve_command(sys.argv[2:]))
    code = delegate(sys.argv[1:])
    if code is None:  # no server, or one that cannot run this command as a cold process would
        warm_early(sys.argv[1:])
        try:
            code = command_line()
        except SystemExit as exc:
            code = exit_code(exc)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BrokenPipeError:  # the reader stopped reading (`paralab plan ... | head`): nothing more to say
            code = BROKEN_PIPE
        leave(code)
    return code


def serve_command(argv: list[str]) -> int:
    """`paralab serve [--status | --stop | --idle MINUTES]`, parsed here from the command's own declaration
    (``commands/serve.py``: the same arguments, help and exit codes as through the command line, whose parser
    would import torch for the other commands): asking or stopping a server takes a fraction of a second."""
    import argparse
    from .commands import serve
    from .errors import CANNOT_WRITE, CannotWrite, UsageError
    parser = argparse.ArgumentParser(prog="paralab serve", description=serve.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(parser)
    try:
        return serve.run(parser.parse_args(argv))
    except SystemExit as exc:  # --help (0), a bad argument (2)
        return exc.code if isinstance(exc.code, int) else 2
    except UsageError as exc:
        print(f"paralab: error: {exc}", file=sys.stderr)
        return CANNOT_WRITE if isinstance(exc, CannotWrite) else 2
    except KeyboardInterrupt:
        print("paralab: interrupted", file=sys.stderr)
        return 130


def warm_early(argv: list[str]) -> None:
    """For a command that runs many runs from one warm forkserver (``commands.RUNS_MANY``), start it now,
    before this process imports torch: the two imports then run side by side. Not for help, a dry run,
    or runs asked to start as fresh interpreters (``--start spawn``), which use no forkserver."""
    from .commands import RUNS_MANY
    if not argv or argv[0] not in RUNS_MANY or any(a in ("-h", "--help", "--dry-run") for a in argv) \
            or any("start" in a and "spawn" in a for a in argv):
        return
    from .run.warm import start_early
    start_early()


def leave(code: int) -> None:
    """End the command without tearing the interpreter down.

    Freeing every module object at exit costs more than half a second with ``torch._dynamo`` loaded
    (docs/benchmarks.md), and the command's work is written by then. The exit handlers still run
    (logging, multiprocessing's children), then the buffered output is flushed, as a normal exit does.
    """
    import atexit
    import os
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    from .run.serve import serve
    status = 0
    try:
        serve(float(sys.argv[1]), command_line)
    except SystemExit as exc:  # SIGTERM
        status = exc.code if isinstance(exc.code, int) else 1
    leave(status)  # without the interpreter's teardown of torch (seconds): `--stop` waits for this process
