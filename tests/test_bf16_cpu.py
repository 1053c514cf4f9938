"""--precision bf16 on a CPU: refused (exit 2) where the CPU has no bf16 instructions, unless forced.

The detection reads /proc/cpuinfo through ``paralab.run.config.CPUINFO``; the tests point it at
made-up files, so both paths are covered whatever CPU runs them.
"""
import pytest

from paralab.run.config import RunConfig, cpu_bf16_support
from paralab.errors import UsageError

EPYC_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
             "flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni\n\n"
             "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2\n")
XEON_SPR = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
XEON_SKX = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx2 avx512f avx512bw avx512vl avx512dq\n"
ZEN4 = "model name\t: AMD EPYC 9654\nflags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n"
ARM_BF16 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
            "atomics sve asimdfhm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\n")
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("text,expected", [
    (EPYC_AVX2, (False, "AMD EPYC")),
    (XEON_SKX, (False, "Intel(R) Xeon(R) Gold 6148")),  # AVX-512 without BF16: emulated, no faster than fp32
    (XEON_SPR, (True, "Intel(R) Xeon(R) Platinum 8480+")),
    (ZEN4, (True, "AMD EPYC 9654")),
    (ARM_BF16, (True, "this CPU")),
    (ARM_OLD, (False, "this CPU")),
    ("processor\t: 0\n", (None, "this CPU")),  # no feature line: not judged
])
def test_detection(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert cpu_bf16_support(path) == expected


def test_no_cpuinfo_is_not_judged(tmp_path):
    assert cpu_bf16_support(tmp_path / "absent") == (None, "this CPU")


def config(**overrides) -> RunConfig:
    base = dict(strategy="single", dataset="synthetic", width=0.125, num_batches=1, precision="bf16",
                device="cpu")
    return RunConfig(**{**base, **overrides})


def test_validation_refuses_only_bf16_on_a_cpu_without_it_unless_forced(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr("paralab.run.config.CPUINFO", path)
    path.write_text(EPYC_AVX2)
    with pytest.raises(UsageError, match=r"this CPU \(AMD EPYC\) has no bfloat16 instructions.*--allow-slow-bf16"):
        config().validate()
    config(allow_slow_bf16=True).validate()  # forced
    config(precision="fp32").validate()  # other precisions are never judged
    path.write_text(XEON_SPR)
    config().validate()  # native bf16: accepted
    path.unlink()
    config().validate()  # cannot tell (not Linux): accepted


def test_forced_bf16_runs_end_to_end(paralab):
    r = paralab("train", "single", "--num-batches", "1", "--precision", "bf16", "--allow-slow-bf16")
    assert r.returncode == 0, r.stderr
    assert r.summary["precision"] == "bf16"
