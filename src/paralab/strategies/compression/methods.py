"""What compression exists, how it is spelled, and who may use it (``--compress``).

The methods and their wire types, the option class a strategy declares to take
``--compress`` (today ddp and torch-ddp), the refusals before start (who accepts it,
what cannot resume, what ``--check`` cannot vouch for), a run's label for records and
reports, and the variants ``paralab compare --compress LIST`` spells.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UsageError
from ...options import option

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIN_COMPRESSION_RATE = 2  # PowerSGD: compress a tensor only where it sends at most half its numbers
Q_SEED = 0                # PowerSGD: the initial Q's seed (with the tensor's shape)


@dataclass
class CompressOptions:
    """ddp and torch-ddp: gradient compression"""
    compress: str = option("none", "ddp and torch-ddp: compress what each gradient bucket sends",
                           choices=COMPRESSIONS, identity=True)
    powersgd_rank: int = option(1, "--compress powersgd: rank r of the low-rank approximation", minimum=1,
                                identity=True)
    powersgd_start_iter: int = option(10, "--compress powersgd: steps all-reduced uncompressed before PowerSGD "
                                      "starts (PyTorch's start_powerSGD_iter)", minimum=0, identity=True)


def accepts(strategy_cls) -> bool:
    """Whether a strategy compresses its gradients: it declares :class:`CompressOptions`."""
    return CompressOptions in getattr(strategy_cls, "options", ())


def validate(cfg, strategy_cls) -> None:
    """``RunConfig.validate``'s part: ``--compress`` only where ``strategy_cls`` takes it. (A resume carries
    PowerSGD's state in each rank's checkpoint into the same layout: ``PowerSGD.state_dict``.)"""
    if cfg.compress == "none":
        return
    if not accepts(strategy_cls):
        raise UsageError(f"--compress {cfg.compress}: only {_accepting_names()} compress their gradient "
                         f"buckets; {cfg.strategy} sends them uncompressed: drop --compress")


def _accepting_names() -> str:
    from .. import get_strategy, strategy_names
    names = [n for n in strategy_names() if accepts(get_strategy(n))]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def validate_buckets(cfg, dp_replicas) -> None:
    """``ddp``'s part (``dp_replicas()``: its data-parallel replicas): ``--check`` of an fp16/bf16
    sum only where the reference replays its order."""
    if cfg.check and cfg.compress in WIRE_DTYPES and dp_replicas() > 2:
        raise UsageError(f"--compress {cfg.compress} --check: the all-reduce sums {cfg.compress} numbers in "
                         f"{cfg.compress}, in gloo's ring order, which the reference does not replay beyond 2 "
                         "replicas (a sum of two is the same in any order); check with 2 data-parallel "
                         "workers, or drop --check")


def validate_pytorch_hooks(cfg) -> None:
    """``torch-ddp``'s part: what PyTorch's hooks need, and no ``--check`` (not replayed)."""
    if cfg.compress == "powersgd" and cfg.powersgd_start_iter < 2:
        raise UsageError("torch-ddp --compress powersgd: PyTorch's PowerSGD hook needs "
                         "--powersgd-start-iter of at least 2 (DDP rebuilds its buckets after the first step)")
    if cfg.compress != "none" and cfg.check:
        raise UsageError(f"torch-ddp --compress {cfg.compress} --check: compression changes the arithmetic and "
                         "the reference replays only our ddp's (PyTorch's hooks divide after casting, and its "
                         "PowerSGD differs in detail): check `paralab train ddp --compress "
                         f"{cfg.compress} --check`, or drop --check")


# ---------------------------------------------------------------------------- records and compare
def run_label(config: dict) -> str | None:
    """A run's gradient compression from its config (``compress``, ``powersgd_rank``) for labels:
    ``fp16``, ``bf16``, ``powersgd r2``; None where the gradients are sent as they are."""
    method = config.get("compress") if isinstance(config, dict) else None
    if method in (None, "none"):
        return None
    return f"{method} r{config.get('powersgd_rank') or 1}" if method == "powersgd" else method


#: train options a compare variant sets per run (--train-args may not)
VARIANT_FIELDS = ("compress", "powersgd_rank")
VARIANT_SPELLINGS = "none, fp16, bf16, powersgd (rank 1), powersgd-rN (rank N, e.g. powersgd-r4)"
#: compare --compress powersgd: steps all-reduced uncompressed first (the fewest PyTorch's own PowerSGD
#: hook accepts), counted as warm-up so a run's s/iter and bytes are PowerSGD's steps only
POWERSGD_START = 2


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``--compress LIST`` -> [(variant, the RunConfig fields it sets)] in the given order, each variant
    once: ``none`` -> {}, ``fp16`` -> {compress: fp16}, ``powersgd`` and ``powersgd-r1`` -> powersgd-r1
    with {compress: powersgd, powersgd_rank: 1}."""
    out: dict[str, dict] = {}
    for word in (w.strip().lower() for w in str(text).split(",")):
        if not word:
            continue
        method, dash_r, rank = word.partition("-r")
        if method == "powersgd" and (not dash_r or rank.isdigit() and int(rank) >= 1):
            r = int(rank) if dash_r else 1
            out.setdefault(f"powersgd-r{r}", {"compress": "powersgd", "powersgd_rank": r})
        elif word in COMPRESSIONS:
            out.setdefault(word, {"compress": word} if word != "none" else {})
        else:
            raise UsageError(f"--compress: {word!r} is not a compression; use a comma-separated list of "
                             f"{VARIANT_SPELLINGS}")
    if not out:
        raise UsageError(f"--compress needs at least one of {VARIANT_SPELLINGS}")
    return list(out.items())
