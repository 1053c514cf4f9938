"""Subcommands beyond ``train`` and ``data``: one module each.

A command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (raise UsageError for bad input). The CLI registers every
module listed in ``COMMANDS`` that exists.
"""
COMMANDS = ("compare", "plot", "calc", "plan", "measured", "partition", "sweep", "export", "serve", "grade")
#: commands that run many runs from one warm forkserver (run/warm.py), started before they import torch
RUNS_MANY = ("compare", "sweep")
