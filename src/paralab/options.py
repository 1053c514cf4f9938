"""Options: each strategy or parallelism dimension declares its own, typed, once.

A strategy file declares the options it reads as a dataclass whose fields
are made with :func:`option`::

    @dataclass
    class BucketOptions:
        bucket_mb: float = option(25.0, "gradient bucket size in MiB", minimum=0, above=True)

and lists the classes on the strategy (``options = (BucketOptions, ...)``).
From these declarations, and nothing else, come:

- the command-line flags (:func:`add_flags`: ``--bucket-mb``, with the help
  text, type and default; a bool gets ``--x / --no-x``);
- validation before any worker starts (:func:`check`: choices and bounds,
  exit 2 with the flag's name);
- the checkpoint identity (:func:`identity_fields`: options marked
  ``identity=True`` must match for ``--resume`` to continue the same
  arithmetic);
- what a strategy receives: ``ctx.options``, a typed object (no dict, no
  environment switches).

``paralab.strategies.options.StrategyOptions`` gathers every class into the
one namespace that ``RunConfig`` (and so the command line) exposes.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field

from .errors import UsageError


def option(default, help: str, *, choices=(), minimum=None, above: bool = False, identity: bool = False):
    """A dataclass field for an option: its default, help text, and the checks it gets.

    ``choices``: the allowed values; ``minimum``: the lower bound (``above``:
    strictly above it); ``identity``: a resumed run must use the same value.
    """
    return field(default=default, metadata={"help": help, "choices": tuple(choices), "minimum": minimum,
                                            "above": above, "identity": identity})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flags(group, cls) -> None:
    """One command-line flag per option of ``cls`` (defaults from the declaration)."""
    for f in option_fields(cls):
        meta = f.metadata
        text = meta["help"] + (f" ({' | '.join(map(str, meta['choices']))})" if meta["choices"] else "")
        if isinstance(f.default, bool):
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                               help=f"{text} (default {'on' if f.default else 'off'})")
        else:
            group.add_argument(flag(f.name), type=type(f.default), default=f.default,
                               help=f"{text} (default %(default)s)")


def check(obj, cls) -> None:
    """UsageError (exit 2) for a value of ``obj`` outside what ``cls`` declares."""
    for f in option_fields(cls):
        value, meta = getattr(obj, f.name), f.metadata
        if meta["choices"] and value not in meta["choices"]:
            raise UsageError(f"{flag(f.name)} must be one of {', '.join(map(str, meta['choices']))} "
                             f"(got {value!r})")
        low = meta["minimum"]
        if low is not None and (value < low or (meta["above"] and value == low)):
            raise UsageError(f"{flag(f.name)} must be {'above' if meta['above'] else 'at least'} {low} "
                             f"(got {value})")


def identity_fields(cls) -> list[str]:
    """The options a resumed run must share with its checkpoint."""
    return [f.name for f in option_fields(cls) if f.metadata["identity"]]


def project(obj, cls):
    """``cls`` built from the same-named attributes of ``obj`` (e.g. a RunConfig)."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})
