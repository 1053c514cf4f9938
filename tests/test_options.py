"""Options are declared once, in the strategy or dimension file that reads them; flags, checks,
the checkpoint identity and what strategies receive all come from those declarations."""
from __future__ import annotations

import dataclasses

import pytest

from paralab import options
from paralab.run.checkpoint import IDENTITY_KEYS
from paralab.cli import build_parser, config_from_args
from paralab.run.config import RunConfig
from paralab.errors import UsageError
from paralab.strategies import get_strategy, strategy_names
from paralab.strategies.all_options import OPTION_CLASSES, StrategyOptions


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_declared_option_is_a_flag_with_its_declared_default():
    cfg = parse("ddp")
    for cls in OPTION_CLASSES:
        for f in options.option_fields(cls):
            assert getattr(cfg, f.name) == f.default, f.name
    assert parse("ddp", "--bucket-mb", "0.5", "--pp", "2").strategy_options().bucket_mb == 0.5
    assert parse("fsdp", "--no-step-in-backward").step_in_backward is False


def test_each_option_is_declared_once():
    names = [f.name for cls in OPTION_CLASSES for f in options.option_fields(cls)]
    assert len(names) == len(set(names))
    run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {f.name for f in dataclasses.fields(StrategyOptions)}
    assert not run_fields & set(names)  # RunConfig does not restate a strategy option


def test_strategies_declare_only_known_option_classes():
    known = {f.name for f in dataclasses.fields(StrategyOptions)}
    for name in strategy_names():
        for cls in get_strategy(name).options:
            assert {f.name for f in dataclasses.fields(cls)} <= known, (name, cls)


@pytest.mark.parametrize("kw,message", [
    (dict(bucket_mb=0.0), "--bucket-mb must be above 0"),
    (dict(accumulate=0), "--accumulate must be at least 1"),
    (dict(microbatches=0), "--microbatches must be at least 1"),
    (dict(pp=0), "--pp must be at least 1"),
    (dict(zero_stage=4, strategy="fsdp"), "--zero-stage must be one of 1, 2, 3"),
    (dict(schedule="zigzag", strategy="pipeline"), "--schedule must be one of gpipe, 1f1b"),
])
def test_declared_checks_refuse_bad_values(kw, message):
    cfg = RunConfig(**({"strategy": "ddp", "dataset": "synthetic"} | kw))
    with pytest.raises(UsageError, match=message):
        cfg.validate()


def test_identity_comes_from_the_declarations():
    for name in ("pp", "microbatches", "partition", "zero_stage", "accumulate"):
        assert name in IDENTITY_KEYS
    for name in ("bucket_mb", "prefetch", "step_in_backward", "schedule"):  # same arithmetic either way
        assert name not in IDENTITY_KEYS


def test_strategies_receive_typed_options():
    opts = RunConfig(microbatches=4, zero_stage=1).strategy_options()
    assert isinstance(opts, StrategyOptions) and opts.microbatches == 4 and opts.zero_stage == 1
    assert not hasattr(opts, "lr")  # only the strategies' options, not the whole run


def test_norm_defaults_to_the_models_own():
    assert RunConfig(dataset="synthetic").validate().norm == "batch"
    assert RunConfig(model="vgg16-cs1390", dataset="synthetic", batch_size=32).validate().norm == "none"
    assert RunConfig(model="vgg16-cs1390", dataset="synthetic", norm="batch").validate().norm == "batch"


def test_to_argv_and_from_argv_give_the_same_config_back():
    cfg = RunConfig(strategy="ddp", model="resnet18", width=0.375, norm="none", dataset="synthetic",
                    data_dir="/tmp/some data", synthetic_size=1234, augment=False, drop_last=True,
                    per_worker_batch=16, num_batches=7, optimizer="adam", lr=0.0123456789, momentum=0.0,
                    weight_decay=0.0, seed=3, precision="fp64", lr_scaling="linear", warmup_epochs=0.5,
                    allow_slow_bf16=True, log_every=5, warmup=0, eval_batches=2, out="runs/a b", progress=False,
                    checkpoint_every=3, resume="runs/old run", check=True, save_init=True, check_every=2,
                    workers=2, cores_per_worker=1, master_addr="10.0.0.1", master_port=29999, timeout=12.5,
                    network="1gbit,200us", bucket_mb=0.5, accumulate=2, compress="powersgd", powersgd_rank=2)
    argv = cfg.to_argv()
    assert argv[0] == "ddp" and "--no-augment" in argv and "--drop-last" in argv and "--model" in argv
    assert "--epochs" not in argv  # options at their default are left out
    assert RunConfig.from_argv(argv) == cfg
    assert RunConfig.from_argv(RunConfig().to_argv()) == RunConfig()
    assert RunConfig.from_argv(cfg.to_argv(first=("epochs",), out=None)) == dataclasses.replace(cfg, out=None)


def test_every_old_flag_spelling_still_parses():
    cfg = parse("single", "--no-augment", "--no-progress", "--drop-last", "--check", "--save-init",
                "--allow-slow-bf16", "--check-every", "2", "--network", "1gbit")
    assert (cfg.augment, cfg.progress, cfg.drop_last, cfg.check, cfg.save_init, cfg.allow_slow_bf16) == \
        (False, False, True, True, True, True)
    assert parse("single") == RunConfig()


def test_given_reports_only_what_the_flags_set():
    assert RunConfig.given(["--lr", "0.5", "--no-progress"], "--x") == {"lr": 0.5, "progress": False}
    with pytest.raises(UsageError, match="--x: unrecognized arguments: --bogus"):
        RunConfig.given(["--bogus"], "--x")
