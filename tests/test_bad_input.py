"""Bad input is refused before training: exit code 2, a message saying what to change, nothing written."""
import gzip
from pathlib import Path

import pytest

from paralab.cli import main
from paralab.data.datasets import FASHION_FILES

FAST = ["--dataset", "synthetic", "--width", "0.125", "--num-batches", "1"]


def refused(capsys, tmp_path, *argv):
    out = tmp_path / "never"
    code = main(["train", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists(), "a refused run must leave nothing behind"
    return err


@pytest.mark.parametrize("argv,message", [
    (["warp-drive"], "unknown strategy 'warp-drive'"),
    (["ddpp"], "unknown strategy 'ddpp' (did you mean 'ddp'?)"),
    (["single", "--model", "alexnet"], "unknown model 'alexnet'"),
    (["single", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["single", "--batch-size", "0"], "--batch-size must be positive"),
    (["single", "--num-batches", "-3"], "--num-batches must be positive"),
    (["single", "--width", "0"], "--width must be positive"),
    (["single", "--epochs", "0"], "--epochs must be positive"),
    (["single", "--lr", "-1"], "--lr must be positive"),
    (["single", "--optimizer", "lbfgs"], "--optimizer must be one of"),
    (["single", "--precision", "fp8"], "--precision must be one of"),
    (["single", "--norm", "group"], "--norm must be one of"),
    (["single", "--workers", "2"], "strategy 'single' runs one process"),
    (["single", "--rank", "0"], "needs both --world-size and --rank"),
    (["single", "--check-cache", "kept"], "--check-cache DIR keeps the reference that --check trains"),
    (["single", "--check", "--check-cache", __file__], "is a file: name a folder"),
    (["single", "--check", "--check-every", "0"], "--check-every must be positive"),
    (["single", "--check", "--check-every", "-2"], "--check-every must be positive"),
    (["single", "--check-every", "2"], "--check-every N compares with the reference every N steps: it needs --check"),
    (["single", "--replay"], "--replay replays the run beside the reference --check trains: add --check"),
    (["single", "--check", "--replay", "--no-first-divergence"], "which --no-first-divergence turns off"),
    (["single", "--check", "--num-batches", "0"], "--num-batches must be positive"),
    (["single", "--dropout", "0.1"], "--dropout drops the gpt's residual branches; --model vgg11 has none"),
    (["single", "--model", "gpt", "--dropout", "1"], "--dropout must be at most 0.99"),
    (["single", "--model", "gpt", "--dropout", "-0.1"], "--dropout must be at least 0"),
    # a cosine schedule with nothing left after its warm-up, a floor without a cosine or not below the rate
    (["single", "--lr-schedule", "cosine", "--warmup-epochs", "1"], "leaves none of the run's 1 steps to decay over"),
    (["single", "--min-lr", "0.01"], "--min-lr is the floor of --lr-schedule cosine"),
    (["single", "--lr-schedule", "cosine", "--min-lr", "0.1"], "--min-lr 0.1 is the floor the cosine decays to"),
    (["single", "--lr-schedule", "linear"], "--lr-schedule must be one of"),
    # a clipping norm that is no norm; a strategy that cannot compute the whole model's norm
    (["single", "--clip-grad", "0"], "--clip-grad must be positive"),
    (["single", "--clip-grad=-1"], "--clip-grad must be positive"),
    # the reference (the whole model, in one process, on rank 0) cannot fit beside the ranks' whole models:
    # refused before any rank starts (805M parameters: 6 GiB of fp64 weights fit; the reference's 18 GiB and the
    # two ranks' 12 GiB, not in this project's 24 GiB machines)
    (["ddp", "--workers", "2", "--model", "gpt", "--dataset", "synthetic-text", "--layers", "16", "--embed", "2048",
      "--heads", "16", "--check"], "the reference alone holds at least"),
    # below fp64 the check's noise band trains three more references (check/band.py): 403M parameters fit an fp64
    # check on one rank (13 GiB), not an fp32 one (26 GiB: the reference four times over, one of them in fp64)
    (["single", "--model", "gpt", "--dataset", "synthetic-text", "--layers", "8", "--embed", "2048", "--heads", "16",
      "--check", "--precision", "fp32"], "four times over: the reference and the three its noise band measures"),
    # and in fp64 for a strategy that declares a lossy gradient wire (its band is trained in fp64): 302M parameters
    # over 2 ranks fit a plain fp64 check (7 GiB of reference, 4.5 of the ranks' models), not four fp64 references
    ([str(Path(__file__).resolve().parent.parent / "examples" / "strategies" / "fp16_allreduce.py"), "--workers",
      "2", "--model", "gpt", "--dataset", "synthetic-text", "--layers", "6", "--embed", "2048", "--heads", "16",
      "--check", "--precision", "fp64"], "four times over: the reference and the three its noise band measures"),
    # a model whose weights alone cannot be held (each rank builds it whole), or cannot even be counted
    (["single", "--width", "1e9"], "has a layer too large for torch to count; lower --width"),
    (["single", "--width", "5000"], "GiB of weights in fp32: more than the memory this machine has available"),
    (["single", "--model", "gpt", "--embed", "100000000", "--heads", "1"], "lower --embed, --layers, --context"),
    # a seed past what the data's generators can add to; an empty --resume (it started from scratch)
    (["single", "--seed", "4294967296"], "--seed must be at most 4294967295"),
    (["single", "--seed", "-1"], "--seed must be at least 0"),
    (["single", "--resume", ""], "--resume takes a value, not an empty one"),
    (["--strategy-file", ""], "--strategy-file takes a Python file"),
    # a batch larger than the data: each step would use fewer samples than the records said
    (["single", "--synthetic-size", "100", "--batch-size", "128"], "the global batch of 128 is more than the 100"),
])
def test_refused(capsys, tmp_path, argv, message):
    defaults = [x for flag, value in zip(FAST[::2], FAST[1::2]) if flag not in argv for x in (flag, value)]
    err = refused(capsys, tmp_path, *argv, *defaults)
    assert message in err


def test_missing_data_dir(capsys, tmp_path):
    err = refused(capsys, tmp_path, "single", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "nope"))
    assert "does not exist" in err


def test_cifar_absent_says_how_to_get_it(capsys, tmp_path):
    err = refused(capsys, tmp_path, "single", "--dataset", "cifar10", "--data-dir", str(tmp_path))
    assert "paralab data download cifar10" in err and "synthetic" in err


def test_corrupt_cifar_file(capsys, tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(b"garbage")
    # presence passes validation; the size check refuses before any training step
    err = refused(capsys, tmp_path, "single", "--dataset", "cifar10", "--data-dir", str(tmp_path))
    assert "corrupt" in err


def test_corrupt_fashion_file(capsys, tmp_path):
    for name, _ in FASHION_FILES.values():
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(b"\x00\x00\x08\x01\x00\x00\x00\x02ab")
    err = refused(capsys, tmp_path, "single", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path))
    assert "MD5" in err


def test_resume_without_checkpoint(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = refused(capsys, tmp_path, "single", *FAST, "--resume", str(tmp_path / "empty"))
    assert "no complete checkpoint" in err


def test_resume_from_another_model(capsys, tmp_path):
    assert main(["train", "single", *FAST, "--no-progress", "--eval-batches", "1",
                 "--out", str(tmp_path / "vgg")]) == 0
    capsys.readouterr()
    err = refused(capsys, tmp_path, "single", *FAST, "--model", "resnet18", "--resume", str(tmp_path / "vgg"))
    assert "different run" in err and "resnet18" in err


def test_existing_run_directory_is_not_overwritten(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "single", *FAST, "--no-progress", "--eval-batches", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", "single", *FAST, "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "single", "--batch-size", "many"])
    assert exc.value.code == 2


def test_help_for_every_command(capsys):
    for argv in (["--help"], ["train", "--help"], ["data", "--help"], ["data", "info", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    assert "--batch-size" in capsys.readouterr().out


def test_resume_with_other_batches_or_no_more_steps(capsys, tmp_path):
    assert main(["train", "single", *FAST, "--no-progress", "--eval-batches", "1", "--batch-size", "32",
                 "--out", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    err = refused(capsys, tmp_path, "single", *FAST, "--batch-size", "64", "--resume", str(tmp_path / "base"))
    assert "batch_size" in err  # a different batch would read other samples at each step
    err = refused(capsys, tmp_path, "single", *FAST, "--batch-size", "32", "--resume", str(tmp_path / "base"))
    assert "already trained 1 steps" in err


class Payload:
    """Unpickling this creates ``marker`` (what a crafted dataset would do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_crafted_cifar_batch_is_refused_without_running_it(capsys, tmp_path):
    """Files with the official names and sizes, one of them a pickle with a payload: exit 2, nothing run."""
    import pickle

    import numpy as np

    from paralab.data.datasets import CIFAR_FILE_BYTES
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    good = pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]})
    bad = pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3],
                        b"batch_label": Payload(marker)})
    for name, size in CIFAR_FILE_BYTES.items():
        with open(folder / name, "wb") as f:
            f.write(bad if name == "test_batch" else good)  # the last file read
            f.truncate(size)  # the official size (zeros after the pickle's end; sparse on disk)
    err = refused(capsys, tmp_path, "single", "--dataset", "cifar10", "--data-dir", str(tmp_path), *FAST[2:])
    assert "test_batch is not a CIFAR-10 python batch" in err and "refused without loading or running it" in err
    assert not marker.exists()


def test_bf16_refused_on_a_cpu_without_bf16_instructions(capsys, tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n")
    monkeypatch.setattr("paralab.run.config.CPUINFO", cpuinfo)
    err = refused(capsys, tmp_path, "single", *FAST, "--precision", "bf16", "--device", "cpu")
    assert "this CPU (AMD EPYC) has no bfloat16 instructions" in err and "avx512_bf16" in err
    assert "--allow-slow-bf16" in err


def test_more_workers_than_gpus(capsys, tmp_path, monkeypatch):
    """On a machine with one GPU: `--device cuda --workers 2` is refused before start (rank 1 would find no
    device 1); `auto` trains 2 workers on the CPU and 1 on the GPU; a rank launched by torchrun keeps its GPU."""
    import torch

    from paralab.run.config import RunConfig
    from paralab.run.rendezvous import on_gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, tmp_path, "ddp", "--workers", "2", "--device", "cuda", *FAST)
    assert "--workers 2 on CUDA needs a GPU for each worker and 1 is visible: use --workers 1" in err
    assert not on_gpu(RunConfig(strategy="ddp", workers=2))
    assert on_gpu(RunConfig(strategy="ddp", workers=1))
    assert on_gpu(RunConfig(strategy="ddp", workers=1, world_size=4))  # one rank of four, its own GPU
    assert on_gpu(RunConfig(strategy="ddp", workers=1, launched_by="torchrun"))
    assert not on_gpu(RunConfig(strategy="ddp", workers=2, device="cpu"))


def test_resuming_a_checkpoint_of_another_precision_under_check_says_how(capsys, tmp_path):
    """A check runs in fp64 unless told; a checkpoint continues only in its own precision: the refusal says
    which --precision continues it."""
    assert main(["train", "single", *FAST, "--no-progress", "--eval-batches", "1", "--out", str(tmp_path / "fp32")]) == 0
    capsys.readouterr()
    err = refused(capsys, tmp_path, "single", *FAST[:-2], "--num-batches", "2", "--check", "--resume",
                  str(tmp_path / "fp32"))
    assert "precision: checkpoint has 'fp32', this run 'fp64'" in err and "give --precision fp32" in err


@pytest.mark.parametrize("argv,message", [
    (["train", "single", "--momentum", "nan"], "argument --momentum: 'nan' is not a finite number"),
    (["train", "single", "--weight-decay", "nan"], "argument --weight-decay: 'nan' is not a finite number"),
    (["train", "single", "--timeout", "inf"], "argument --timeout: 'inf' is not a finite number"),
    (["train", "single", "--lr=-inf"], "argument --lr: '-inf' is not a finite number"),
    (["train", "single", "--clip-grad", "nan"], "argument --clip-grad: 'nan' is not a finite number"),
    (["train", "single", "--model", "gpt", "--experts", "4", "--capacity-factor", "nan"],
     "argument --capacity-factor: 'nan' is not a finite number"),
    (["serve", "--idle", "nan"], "argument --idle: 'nan' is not a finite number"),
    (["compare", "--run-timeout", "inf"], "argument --run-timeout: 'inf' is not a finite number"),
    (["calc", "allreduce", "--parameters", "nan", "--workers", "2", "--bandwidth", "1"], "'nan' is not a finite"),
])
def test_a_float_that_is_not_finite_is_refused_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_config_made_in_a_program_refuses_a_non_finite_float():
    from paralab.errors import UsageError
    from paralab.run.config import RunConfig
    for name in ("momentum", "weight_decay", "lr", "timeout"):
        with pytest.raises(UsageError, match=f"--{name.replace('_', '-')} must be a finite number"):
            RunConfig(**{name: float("nan")}).validate()


@pytest.mark.parametrize("where,code", [("/proc/paralab-x", 2), ("/sys/paralab-x", 4)])
def test_an_out_that_cannot_be_made_is_refused_without_a_traceback(capsys, where, code):
    """A path that cannot be (under /proc: exit 2) or one the system does not permit (/sys: exit 4, as a write
    refused while running)."""
    assert main(["train", "single", *FAST, "--out", where]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"paralab: error: --out {where}: cannot write it") and "Traceback" not in err


def test_export_and_plot_refuse_what_they_cannot_write_or_read(capsys, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "single", *FAST, "--no-progress", "--eval-batches", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "-o", "/sys/paralab-model.pt"]) == 4
    assert "-o /sys/paralab-model.pt: cannot write it" in capsys.readouterr().err
    assert main(["export", str(run), "-o", "/proc/paralab-x/model.pt"]) == 2
    capsys.readouterr()
    with open(run / "steps.jsonl", "a") as f:
        f.write('{"rank": 0, "st\n')  # a record cut short
    assert main(["plot", "timeline", str(run)]) == 2
    assert f"{run / 'steps.jsonl'}, line 2: a damaged record" in capsys.readouterr().err


@pytest.mark.parametrize("strategies", ["", " , "])
def test_compare_with_no_strategy_named_is_refused(capsys, tmp_path, strategies):
    """An empty --strategies used to run the whole matrix."""
    assert main(["compare", "--strategies", strategies, "--out", str(tmp_path / "r")]) == 2
    assert "names no strategy" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_an_integer_past_64_bits_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "single", "--seed", "100000000000000000000000"])
    assert exit_.value.code == 2
    assert "is past the largest number an option takes (2^63 - 1)" in capsys.readouterr().err
