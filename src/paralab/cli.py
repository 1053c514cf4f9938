"""Command line: parses, lets RunConfig validate, calls the library. Nothing else lives here."""
from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path

from .commands import COMMANDS
from .run import folder
from .run.config import RunConfig
from .errors import CANNOT_WRITE, CannotWrite, UsageError


class Parser(argparse.ArgumentParser):
    """argparse that exits with code 2 and a one-line hint (its default behaviour, kept explicit)."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    names = set(RunConfig.__dataclass_fields__)
    return RunConfig(**{k: v for k, v in vars(args).items() if k in names})


def cmd_train(args) -> int:
    from .run.launch import launch
    from .run.rendezvous import under_slurm, under_torchrun
    if args.strategy_file is not None and not args.strategy_file.strip():
        raise UsageError("--strategy-file takes a Python file, PATH.py or PATH.py:CLASS (got an empty name)")
    if args.strategy and args.strategy_file:
        raise UsageError(f"name the strategy once: {args.strategy!r} or --strategy-file {args.strategy_file}")
    if args.strategy_file:
        from .strategies import user
        if not user.is_file(args.strategy_file):
            raise UsageError(f"--strategy-file takes a Python file, PATH.py or PATH.py:CLASS (got "
                             f"{args.strategy_file!r})")
        args.strategy = args.strategy_file
    if not args.strategy:
        raise UsageError("name a strategy (paralab train ddp ...) or give --strategy-file PATH.py[:CLASS]")
    cfg = config_from_args(args)
    if under_torchrun():
        cfg.launched_by = "torchrun"
    elif cfg.world_size is None and under_slurm():  # a task of `srun -n N`: one rank (--world-size/--rank win)
        cfg.launched_by = "slurm"
    cfg.validate()
    run_dir = Path(cfg.out or cfg.default_out())
    # one run per folder (run/folder.py): the launcher holds it, or, ranks started one per process, rank 0
    held = folder.claim(run_dir) if launches_rank0(cfg) else None
    try:
        if folder.holds_a_run(run_dir) and not (cfg.resume and Path(cfg.resume) == run_dir):
            if not cfg.overwrite:
                raise UsageError(f"{run_dir} already holds a run; pass another --out, --resume {run_dir} to "
                                 "continue it, or --overwrite to replace it")
            if held is not None:
                folder.clear(run_dir)
        return launch(cfg, str(run_dir), on_end=held.release if held is not None else None)
    except KeyboardInterrupt:  # Ctrl-C: what was committed, and the command that continues from it
        from .run.failures import resume_hint
        hint = resume_hint(cfg, run_dir)
        if hint:
            print("\n".join(hint[1]), file=sys.stderr, flush=True)
        raise
    finally:
        if held is not None:
            held.release()


def launches_rank0(cfg: RunConfig) -> bool:
    """Whether this process starts the run's rank 0: the launcher of local ranks, or the process that is rank 0
    (``--rank``, torchrun's RANK, Slurm's SLURM_PROCID)."""
    import os
    if cfg.launched_by == "torchrun":
        return os.environ.get("RANK", "0") == "0"
    if cfg.launched_by == "slurm":
        return os.environ.get("SLURM_PROCID", "0") == "0"
    return cfg.rank in (None, 0)


def cmd_data(args) -> int:
    from .data.download import DownloadError, download_cifar10, info, not_downloadable, require_dir
    data_dir = require_dir(args.data_dir)
    if args.action == "info":
        print(info(data_dir))
        return 0
    if args.name != "cifar10":
        raise UsageError(not_downloadable(args.name))
    try:
        download_cifar10(data_dir)
    except DownloadError as exc:
        print(f"paralab: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .strategies import strategy_names
    parser = Parser(prog="paralab", description="Parallel training lab on torch.distributed: "
                    "every classic strategy from primitives, checked and measured.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("train", help="train with one strategy",
                       description="Train with one strategy and write a run directory.")
    p.add_argument("strategy", nargs="?", help="one of: " + ", ".join(strategy_names()) + "; or a file of your own, "
                   "PATH.py[:CLASS] (docs/own-strategy.md)")
    p.add_argument("--strategy-file", metavar="PATH.py[:CLASS]",
                   help="a strategy from your own file, instead of the positional name (docs/own-strategy.md)")
    RunConfig.add_flags(p)  # every option's flag, from its declaration
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("data", help="download or inspect datasets")
    dsub = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    q = dsub.add_parser("download", help="download a dataset (cifar10)")
    q.add_argument("name", help="cifar10 (the others install by apt or are generated: see `paralab data info`)")
    q.add_argument("--data-dir", help="where to put it (default ~/.cache/paralab)")
    q.set_defaults(func=cmd_data)
    q = dsub.add_parser("info", help="which datasets are present, where, how big")
    q.add_argument("--data-dir")
    q.set_defaults(func=cmd_data)

    for name in COMMANDS:
        try:
            module = importlib.import_module(f"paralab.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"paralab.commands.{name}":
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


@functools.lru_cache(maxsize=2)
def _parser(strategies: tuple[str, ...]) -> argparse.ArgumentParser:
    """:func:`build_parser`'s parser, built once in a process (every command's options: about 10 ms) for the
    strategies it names; parsing leaves a parser as it was, so a process that runs many commands (the suite's
    own, in one process) builds it once. Each command's function is bound when it is built (``set_defaults``):
    replace a command's ``run`` before a process's first command, not after."""
    return build_parser()


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line's own process: nothing has run here yet (warm.py may fork from it)
        from .run.warm import mark_fresh
        mark_fresh()
    from .strategies import strategy_names
    args = _parser(tuple(strategy_names())).parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:  # bad input (2), or a write the system refused (CannotWrite: 4)
        print(f"paralab: error: {exc}", file=sys.stderr)
        return CANNOT_WRITE if isinstance(exc, CannotWrite) else 2
    except KeyboardInterrupt:
        print("paralab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
