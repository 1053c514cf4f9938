"""Command line: parses, lets RunConfig validate, calls the library. Nothing else lives here."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .commands import COMMANDS
from .config import RunConfig
from .errors import UsageError
from .options import add_flags
from .strategies.options import OPTION_CLASSES


class Parser(argparse.ArgumentParser):
    """argparse that exits with code 2 and a one-line hint (its default behaviour, kept explicit)."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_train_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, help="vgg11 | vgg13 | vgg16 | vgg19 | resnet18 | vgg16-cs1390 | vgg16-cs1390-pool | gpt "
                   "(default %(default)s; gpt's shape: --layers --heads --embed --context)")
    g.add_argument("--width", type=float, default=d.width, help="channel multiplier, e.g. 0.25 for fast runs")
    g.add_argument("--norm", default=d.norm,
                   help="batch | none (BatchNorm-free model); default: the model's own (batch; none for "
                        "the CS1390 VGG-16s, as CS1390 trains them)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset,
                   help="auto | cifar10 | fashion-mnist | synthetic (image models); jargon | synthetic-text "
                        "(--model gpt: byte tokens). auto: the first present for the model, else synthetic; "
                        "`paralab data info` lists them")
    g.add_argument("--data-dir", help="folder with the dataset files")
    g.add_argument("--synthetic-size", type=int, default=d.synthetic_size,
                   help="synthetic training samples (synthetic-text: training windows)")
    g.add_argument("--no-augment", dest="augment", action="store_false", help="no random crop / flip")
    g.add_argument("--drop-last", action="store_true",
                   help="epochs of n // B full global batches: the n mod B samples left over (other ones each "
                        "epoch) are skipped instead of padding the last batch with repeated samples; "
                        "then every replica count, single included, trains the same batches")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (default %(default)s)")
    g.add_argument("--per-worker-batch", type=int, help="per-worker batch instead (weak scaling)")
    g.add_argument("--epochs", type=int, default=d.epochs, help="epochs (default %(default)s)")
    g.add_argument("--num-batches", type=int, help="train exactly this many steps instead of --epochs")
    g.add_argument("--optimizer", default=d.optimizer, help="sgd | adam")
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate (default %(default)s)")
    g.add_argument("--momentum", type=float, default=d.momentum)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--precision", default=d.precision,
                   help="fp32 | bf16 (autocast) | fp64 (model, collectives, optimizer state and --check "
                        "reference in float64: exact checks at real hyper-parameters)")
    g.add_argument("--lr-scaling", default=d.lr_scaling, help="none | linear: lr x global batch / 256")
    g.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, help="linear lr warm-up (epochs)")
    g.add_argument("--allow-slow-bf16", action="store_true",
                   help="run --precision bf16 even on a CPU without bf16 instructions (refused otherwise: "
                        "about 19x slower than fp32 there)")
    g = p.add_argument_group("records")
    g.add_argument("--out", help="run directory (default runs/<strategy>-w<N>-<time>)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="print the loss every N steps")
    g.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of timing averages")
    g.add_argument("--eval-batches", type=int, help="bound the test evaluation to N batches")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="save resumable state every N steps (always at the end)")
    g.add_argument("--resume", help="run directory whose checkpoint to continue from")
    g.add_argument("--save-init", action="store_true",
                   help="also save the starting weights (checkpoint/init/; `paralab export RUN --init`)")
    g.add_argument("--check", action="store_true",
                   help="compare with the single-process reference; exit 1 on FAIL")
    g.add_argument("--check-every", type=int, default=d.check_every, metavar="N",
                   help="with --check: also record the deviation from the reference every N steps "
                        "(summary.json check.history; `paralab plot deviation`)")
    g = p.add_argument_group("launch")
    g.add_argument("--workers", type=int, default=d.workers, help="local worker processes")
    g.add_argument("--cores-per-worker", type=int, help="pin rank r to cores [rC, rC+C)")
    g.add_argument("--world-size", type=int, help="multi-node by hand: total ranks")
    g.add_argument("--rank", type=int, help="multi-node by hand: this process's rank")
    g.add_argument("--master-addr", default=d.master_addr, help="rank 0's address (default %(default)s)")
    g.add_argument("--master-port", type=int, help="rank 0's port (local default: a free port)")
    g.add_argument("--backend", default=d.backend, help="auto | gloo | nccl")
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda")
    g.add_argument("--timeout", type=float, default=d.timeout, help="seconds before a stuck collective fails")
    g.add_argument("--network", metavar="RATE[,LATENCY]",
                   help="emulate a cluster network: each local worker in its own network namespace on a "
                        "full-duplex link of RATE (e.g. 100mbit, 1gbit, 10gbit) to one switch, shaped by tc; "
                        "needs iproute2 and root or unprivileged user namespaces. LATENCY (e.g. ,200us) only "
                        "where the kernel has netem")
    # the strategies' options: one group per declaring class, flags generated from the declarations
    for cls in OPTION_CLASSES:
        add_flags(p.add_argument_group(cls.__doc__.strip()), cls)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    names = set(RunConfig.__dataclass_fields__)
    return RunConfig(**{k: v for k, v in vars(args).items() if k in names})


def cmd_train(args) -> int:
    from .launch import launch, under_torchrun
    cfg = config_from_args(args)
    if under_torchrun():
        cfg.launched_by = "torchrun"
    cfg.validate()
    run_dir = Path(cfg.out or cfg.default_out())
    if (run_dir / "summary.json").exists() and not (cfg.resume and Path(cfg.resume) == run_dir):
        raise UsageError(f"{run_dir} already holds a run; pass another --out")
    return launch(cfg, str(run_dir))


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
    p.add_argument("strategy", help="one of: " + ", ".join(strategy_names()))
    add_train_options(p)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"paralab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paralab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
