"""Options: every option of a run is declared once, typed, beside the code that reads it.

An option is a dataclass field made with :func:`option`, in a small class
that groups the options one part of paralab reads::

    @dataclass
    class BucketOptions:
        \"\"\"gradient buckets (ddp, torch-ddp)\"\"\"
        bucket_mb: float = option(25.0, "gradient bucket size in MiB", minimum=0, above=True)

The run's own options (``ModelOptions`` in models/, ``DataOptions`` in data/,
``OptimizerOptions``, ``RecordOptions`` and ``LaunchOptions`` in run/config.py)
and the strategies' (gathered in ``strategies.all_options.StrategyOptions``) are
all bases of ``RunConfig``, so a config's attributes stay flat (``cfg.lr``,
``cfg.bucket_mb``). From the declarations, and nothing else, come:

- command-line flags (:func:`add_flags`): ``--bucket-mb`` with the help text,
  type and default, one argument group per class; a bool gets ``--x / --no-x``.
  Any command can take some of them (``only=``) with its own defaults
  (``defaults=``): ``paralab compare`` runs width 0.25 by default;
- the checks of single values (:func:`check`, exit 2 naming the flag):
  ``choices``, ``minimum``/``maximum``/``above``, ``positive``, a float
  is finite (no option means NaN or infinity) and a text is not empty
  (none means "nothing": leave the option out); ``None`` always passes
  (an option whose default is None, e.g. ``--num-batches``, is optional);
- a command line that gives a config back (:func:`to_argv`: the options that
  differ from their default; ``RunConfig.from_argv`` reads it) and which
  options some flags set (:func:`given`: ``compare --train-args``);
- the checkpoint identity (:func:`identity_fields`: options marked
  ``identity=True`` must match for ``--resume`` to continue the same arithmetic);
- what a strategy receives: ``ctx.options``, a typed object (:func:`project`).

A new class joins ``OPTION_CLASSES`` (a strategy's) or ``RUN_OPTION_CLASSES``
(run/config.py); checks that relate two options stay in ``RunConfig.validate``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import field

from .errors import UsageError


def option(default, help: str, *, type=None, choices=(), noun: str | None = None, minimum=None, maximum=None,
           above: bool = False, positive: bool = False, identity: bool = False, metavar: str | None = None,
           also=None):
    """A dataclass field for an option: its default, help text, and the checks it gets.

    ``type``: what a flag's text becomes (default: the default's type; needed where the default is
    None); ``choices``: the allowed values (``noun``: refuse others as "unknown NOUN 'x'" instead of
    "--flag must be one of"); ``minimum``, ``maximum``: bounds (``above``: strictly above the minimum);
    ``positive``: above zero, said so; ``identity``: a resumed run must use the same value;
    ``metavar``: how the help shows the value; ``also``: a test a value outside ``choices`` may pass instead
    (a pipeline schedule from the user's file, ``PATH.py[:NAME]``).
    """
    if type is None and default is None:
        raise TypeError("an option whose default is None needs type=")
    return field(default=default, metadata={
        "help": help, "type": type or builtin_type(default), "choices": tuple(choices), "noun": noun,
        "minimum": minimum, "maximum": maximum, "above": above, "positive": positive, "identity": identity,
        "metavar": metavar, "also": also})


def builtin_type(value):
    return type(value)


def finite_float(text: str) -> float:
    """A number that is neither NaN nor infinite: what a float option or argument reads (argparse ``type=``).
    Python's ``float`` takes "nan" and "inf", which no option of paralab's means."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


#: the largest whole number an option takes: what fits in 64 bits (torch's sizes and seeds); past it a value would
#: fail deep inside torch with an overflow instead of being refused
INT_LIMIT = 2 ** 63 - 1


def integer(text: str) -> int:
    """A whole number within 64 bits: what an integer option or argument reads (argparse ``type=``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if abs(value) > INT_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is past the largest number an option takes (2^63 - 1)")
    return value


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def name_of(word: str) -> str:
    """The option a name or a flag names: ``--num-batches`` -> ``num_batches``."""
    return word.removeprefix("--").replace("-", "_")


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flags(parser, *classes, only=None, defaults=None, suppress: bool = False) -> None:
    """One command-line flag per option of ``classes`` on ``parser`` (or an argument group).

    ``only``: these options alone, in this order, by name or by flag (``"--model"``: a command that
    takes a few of a run's options);
    ``defaults``: {name: default} in place of the declared ones (a command with defaults of its own);
    ``suppress``: no defaults at all (to see which options were given).
    """
    defaults = defaults or {}
    fields = {f.name: f for cls in classes for f in option_fields(cls)}
    only = None if only is None else [name_of(word) for word in only]
    missing = [name for name in only or () if name not in fields]
    if missing:
        raise KeyError(f"no such option: {', '.join(missing)}")
    for name in fields if only is None else only:
        f = fields[name]
        meta = f.metadata
        default = defaults.get(name, f.default)
        text = meta["help"] + (f" ({' | '.join(map(str, meta['choices']))})" if meta["choices"] else "")
        kw = {"default": argparse.SUPPRESS if suppress else default, "dest": name}
        if meta["type"] is bool:
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction,
                                help=f"{text} (default {'on' if default else 'off'})", **kw)
        else:
            shown = "" if default is None else " (default %(default)s)"
            kind = {float: finite_float, int: integer}.get(meta["type"], meta["type"])
            parser.add_argument(flag(name), type=kind, metavar=meta["metavar"], help=text + shown, **kw)


def check(obj, cls) -> None:
    """UsageError (exit 2) for a value of ``obj`` outside what ``cls`` declares."""
    for f in option_fields(cls):  # an option ``obj`` does not carry (a command takes some of a class's) passes
        value, meta = getattr(obj, f.name, None), f.metadata
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(f.name)} must be a finite number (got {value})")
        if isinstance(value, str) and not value.strip():  # `--out ""` was the current folder, `--resume ""` none
            raise UsageError(f"{flag(f.name)} takes a value, not an empty one (leave the option out for its "
                             "default)")
        if meta["choices"] and value not in meta["choices"] and not (meta.get("also") and meta["also"](value)):
            allowed = ", ".join(map(str, meta["choices"]))
            if meta["noun"]:
                raise UsageError(f"unknown {meta['noun']} {value!r}; choose one of {allowed}")
            raise UsageError(f"{flag(f.name)} must be one of {allowed} (got {value!r})")
        if meta["positive"] and not value > 0:
            raise UsageError(f"{flag(f.name)} must be positive (got {value})")
        low = meta["minimum"]
        if low is not None and (value < low or (meta["above"] and value == low)):
            raise UsageError(f"{flag(f.name)} must be {'above' if meta['above'] else 'at least'} {low} "
                             f"(got {value})")
        if meta["maximum"] is not None and value > meta["maximum"]:
            raise UsageError(f"{flag(f.name)} must be at most {meta['maximum']} (got {value})")


def to_argv(values: dict, classes, *, first=()) -> list[str]:
    """The flags that give ``values`` ({option name: value}) back: every option of ``classes`` in
    ``values`` whose value differs from its declared default (and those named in ``first``, first,
    always); a value None has no spelling and is left out."""
    fields = {f.name: f for cls in classes for f in option_fields(cls)}
    words: list[str] = []
    for name in [*first, *(n for n in fields if n not in first and n in values)]:
        f, value = fields[name], values[name]
        if value is None or (value == f.default and name not in first):
            continue
        if f.metadata["type"] is bool:
            words.append(flag(name) if value else "--no-" + name.replace("_", "-"))
        else:
            words += [flag(name), str(value)]
    return words


class RaisingParser(argparse.ArgumentParser):
    """argparse that raises UsageError ("WHAT: message") instead of exiting: for option text that
    is part of another command's input (``--train-args``) or read back by a program."""

    def __init__(self, what: str, **kw):
        super().__init__(prog=what, add_help=False, **kw)
        self.what = what

    def error(self, message):
        raise UsageError(f"{self.what}: {message}")


def given(argv: list[str], classes, what: str) -> dict:
    """{option name: value} for the options ``argv`` sets, and only those (UsageError for others)."""
    parser = RaisingParser(what)
    add_flags(parser, *classes, suppress=True)
    return vars(parser.parse_args(argv))


def identity_fields(cls) -> list[str]:
    """The options a resumed run must share with its checkpoint."""
    return [f.name for f in option_fields(cls) if f.metadata["identity"]]


def project(obj, cls):
    """``cls`` built from the same-named attributes of ``obj`` (e.g. a RunConfig)."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})
