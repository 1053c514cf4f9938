"""GPU check: prove paralab's CUDA path on a GPU machine in minutes; results in bench/results/gpu-*.json.

    python3 bench/gpu_check.py          (or `make gpu-check`)

Needs only this repository and a Python whose torch sees a CUDA device: it
runs paralab from ``src`` (PYTHONPATH), installs nothing, and uses the first
of these interpreters whose torch sees a GPU: the one running it, the
repository's ``.venv``, ``python3``. Without one it says so and exits 2
having run nothing. Steps, each recorded even when it fails:

1. the CUDA-marked tests (``pytest -m cuda``; they skip without a GPU),
   where pytest is installed (else: said, and left out);
2. every registered strategy's ``--check`` on the GPU(s): at 1 worker where
   the strategy runs there (torch-dp: ``--gpus 1``), else at 2 workers where
   2 GPUs are visible, else left out with why; then the gpt's dimensions
   (experts, recomputation, the gpt under ddp/fsdp/tp/torch-tp/pipeline) at 1 worker; the recipe
   (AdamW, cosine schedule, --clip-grad firing every step) under eight layouts; six of them checked in bf16
   and in fp16 (its loss scale) under CUDA's autocast (the verdict and its worst ratio to the noise band); the
   example strategies
   from the user's own files (examples/strategies/); the non-finite guard (a NaN injected: stop, skip);
   ``--jobs N`` runs N of the checks at a time, each its own process on the same GPU(s);
3. the warm start: a ``--check`` forked from a ``paralab serve`` server (which
   must not have initialised CUDA), timed beside the same run started cold;
4. benchmarks at 1 GPU: samples/s of ``single``, ``ddp``, ``torch-ddp``,
   ``fsdp`` and ``torch-fsdp`` on VGG-11 (width 1, batch 256), and model FLOPs utilisation (MFU) for VGG-11
   and ``--model gpt``: FLOPs of one training step counted by
   ``torch.utils.flop_counter`` over the measured step time, against the
   device's dense peak (the table below; an unknown device gets no MFU);
5. the matmul ramp (``bench/matmul.py``): bf16 TFLOP/s of a gpt block's four
   GEMMs over the widths of published runs, and their fraction of the peak:
   what a shape-dependent matmul efficiency for the planner is calibrated
   from (docs/plan.md).

Writes ``bench/results/gpu-check.json`` (steps 1-3),
``bench/results/gpu-bench.json`` (step 4) and ``bench/results/gpu-matmul.json``
(step 5), naming the device; exits 1 if a test or a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name  # bench/common.py: the standard library only

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
RESULTS = HERE / "results"

#: dense peak FLOP/s by device name fragment and arithmetic (NVIDIA datasheets, SXM parts, no sparsity);
#: fp32 runs may use TF32 tensor cores only where torch allows it (off by default for matmuls)
PEAKS = {"H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12},
         "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12},
         "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}}

PROBE = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
         "'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0, "
         "'name': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")


# ---------------------------------------------------------------------------- the interpreter
def probe(python: str) -> dict | None:
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["no torch"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def choose_python() -> tuple[str | None, list[str]]:
    """The first interpreter whose torch sees a GPU, and what each candidate said."""
    import shutil
    seen, said = [], []
    for python in (sys.executable, str(ROOT / ".venv" / "bin" / "python"), shutil.which("python3") or "python3"):
        if python in seen or (os.sep in python and not Path(python).exists()):
            continue
        seen.append(python)
        info = probe(python)
        if info is None:
            said.append(f"{python}: could not run")
        elif "error" in info:
            said.append(f"{python}: {info['error']}")
        else:
            said.append(f"{python}: torch {info['torch']} (CUDA {info['cuda'] or 'none: a CPU build'}), "
                        f"{info['gpus']} GPU(s)")
            if info["gpus"] >= 1:
                return python, said
    return None, said


# ---------------------------------------------------------------------------- running paralab
def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def paralab(*args: str, timeout: float = 600, served: bool = False, extra_env: dict | None = None
            ) -> tuple[int, str, float]:
    """Run one paralab command; a running `paralab serve` server takes it only where ``served``."""
    t = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "paralab", *args], capture_output=True, text=True, timeout=timeout,
                           env={**env(), "PARALAB_SERVE": "on" if served else "off", **(extra_env or {})}, cwd=ROOT)
        return p.returncode, (p.stdout + p.stderr)[-4000:], time.monotonic() - t
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout}s: {(exc.stdout or '')[-2000:]}", time.monotonic() - t


def read_summary(out: Path) -> dict:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def cuda_tests() -> dict:
    import importlib.util
    if importlib.util.find_spec("pytest") is None:
        return {"status": "left out", "why": "pytest is not installed for this interpreter"}
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
                       capture_output=True, text=True, env=env(), cwd=ROOT, timeout=1800)
    tail = (p.stdout + p.stderr).strip().splitlines()
    return {"status": "passed" if p.returncode == 0 else "FAILED", "returncode": p.returncode,
            "summary": tail[-1] if tail else "", "output_tail": "\n".join(tail[-40:]),
            "seconds": round(time.monotonic() - t, 1)}


# fp64: the reference trains on the CPU, while cuDNN convolves in TF32 by default, so fp32 agreement
# at lr 0.1 over 4 steps would depend on the kernels, not on the strategy (docs/correctness.md)
CHECK_ARGS = ["--device", "cuda", "--precision", "fp64", "--dataset", "synthetic", "--synthetic-size", "512", "--width", "0.25",
              "--batch-size", "32", "--num-batches", "4", "--eval-batches", "1", "--eval-batch-size", "64",
              "--no-progress", "--check"]


def plan_checks(gpus: int) -> list[tuple[str, int, list[str], str | None]]:
    """(strategy, workers, extra args, why left out) for every registered strategy."""
    sys.path.insert(0, str(SRC))
    from paralab.run.config import RunConfig
    from paralab.errors import UsageError
    from paralab.strategies import strategy_names
    out = []
    for name in strategy_names():
        extra = ["--gpus", "1"] if name == "torch-dp" else []
        chosen, why = None, None
        for w in (1, 2):
            if w > gpus:
                why = f"needs {w} GPUs, {gpus} visible" + (f" (at {w - 1}: {why})" if why else "")
                break
            cfg = RunConfig(strategy=name, workers=w, device="cuda", dataset="synthetic", width=0.25,
                            batch_size=32, check=True, gpus=1 if name == "torch-dp" else 0)
            try:
                cfg.validate()
                chosen = w
                break
            except UsageError as exc:
                why = str(exc)
        out.append((name, chosen or 0, extra, None if chosen else why))
    return out


#: the gpt (fp64, 20 steps at lr 0.1 with momentum: exact, docs/correctness.md) and its dimensions at one GPU
GPT_CHECK = ["--device", "cuda", "--model", "gpt", "--layers", "2", "--embed", "32", "--heads", "2", "--context", "16",
             "--batch-size", "16", "--dataset", "synthetic-text", "--precision", "fp64", "--lr", "0.1", "--momentum", "0.9",
             "--num-batches", "20", "--eval-batches", "1", "--no-progress", "--check"]
DIMENSIONS = [("single", []), ("single", ["--experts", "4", "--top-k", "2"]), ("single", ["--recompute", "full"]),
              ("single", ["--recompute", "selective"]), ("ddp", []), ("fsdp", []), ("tp", ["--sequence-parallel"]),
              ("pipeline", ["--microbatches", "2"]), ("torch-tp", []), ("ddp", ["--experts", "4"])]
#: the recipe real runs use (docs/correctness.md): AdamW, a cosine schedule and a clip that fires every step
#: (the norms are about 1), checked against torch's clip_grad_norm_ and AdamW on the reference
RECIPE = ["--optimizer", "adamw", "--lr", "0.01", "--lr-schedule", "cosine", "--min-lr", "0.001", "--clip-grad", "0.05"]
RECIPE_LAYOUTS = [("single", []), ("ddp", []), ("fsdp", []), ("tp", ["--sequence-parallel"]),
                  ("pipeline", ["--microbatches", "2"]), ("torch-tp", []), ("torch-fsdp", []),
                  ("ddp", ["--experts", "4", "--top-k", "2"])]
#: --check in bf16 and in fp16 (with its loss scale) under CUDA's autocast, judged by the noise band measured beside
#: it (docs/correctness.md, "Bug or rounding"): each must end exact or within rounding
AUTOCAST_LAYOUTS = [("single", []), ("ddp", []), ("fsdp", []), ("tp", ["--sequence-parallel"]),
                ("pipeline", ["--microbatches", "2"]), ("ddp", ["--experts", "4", "--top-k", "2"])]
#: strategies from the user's own files (docs/own-strategy.md), on the CNN as the course writes them
OWN = ["examples/strategies/gather_scatter.py", "examples/strategies/allreduce.py",
       "examples/strategies/bucketed_ddp.py", "examples/strategies/parameter_server.py"]


def check_row(name: str, workers: int, extra: list[str], out: Path, rc: int, text: str, seconds: float) -> dict:
    s = read_summary(out)
    details = s.get("strategy_details") or {}
    row = {"strategy": name, "workers": workers, "args": extra, "returncode": rc, "seconds": round(seconds, 1),
           "check": (s.get("check") or {}).get("result"), "status": "passed" if rc == 0 else "FAILED",
           "verdict": (s.get("check") or {}).get("verdict"), "worst_ratio": (s.get("check") or {}).get("worst_ratio"),
           "allocator_peak_bytes": {r: (d.get("allocator") or {}).get("peak_bytes") for r, d in details.items()},
           "collectives_timed": {r: d.get("collectives_timed") for r, d in details.items()
                                 if "collectives_timed" in d} or None}
    if rc != 0:
        row["output_tail"] = text
    said = f"{row['check']}, {row['verdict']}" if row["verdict"] not in (None, "exact") else row["check"]
    print(f"gpu-check: {name} {' '.join(extra)} at {workers} worker(s): {row['status']} (check {said}, "
          f"{seconds:.0f}s)", flush=True)
    return row


def strategy_checks(gpus: int, tmp: Path, jobs: int = 1) -> list[dict]:
    """Every check of the plan, ``jobs`` at a time (each its own process on the same GPU(s); the models are
    small, so several share a device), one row each in the plan's order."""
    rows: list[dict | None] = []
    runs: list[tuple[int, str, int, list[str], list[str], Path]] = []  # (row, name, workers, shown, args, out)
    for name, workers, extra, why in plan_checks(gpus):
        if why:
            rows.append({"strategy": name, "status": "left out", "why": why})
            print(f"gpu-check: {name}: left out ({why})", flush=True)
            continue
        out = tmp / f"check-{name}"
        runs.append((len(rows), name, workers, extra, [name, "--workers", str(workers), *CHECK_ARGS, *extra], out))
        rows.append(None)
    for i, (name, extra) in enumerate(DIMENSIONS):
        out = tmp / f"gpt-{i}-{name}"
        runs.append((len(rows), name, 1, ["--model", "gpt", *extra], [name, "--workers", "1", *GPT_CHECK, *extra], out))
        rows.append(None)
    for i, (name, extra) in enumerate(RECIPE_LAYOUTS):
        out = tmp / f"recipe-{i}-{name}"
        runs.append((len(rows), name, 1, ["--model", "gpt", *RECIPE, *extra],
                     [name, "--workers", "1", *GPT_CHECK, *RECIPE, *extra], out))
        rows.append(None)
    for precision in ("bf16", "fp16"):
        for i, (name, extra) in enumerate(AUTOCAST_LAYOUTS):
            out = tmp / f"{precision}-{i}-{name}"
            runs.append((len(rows), name, 1, ["--model", "gpt", "--precision", precision, *extra],
                         [name, "--workers", "1", *GPT_CHECK, "--precision", precision, *extra], out))
            rows.append(None)
    for path in OWN:
        out = tmp / f"own-{Path(path).stem}"
        runs.append((len(rows), path, 1, [], [path, "--workers", "1", *CHECK_ARGS], out))
        rows.append(None)

    def one(run):
        at, name, workers, shown, args, out = run
        rc, text, seconds = paralab("train", *args, "--out", str(out), timeout=600)
        rows[at] = check_row(name, workers, shown, out, rc, text, seconds)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, runs))
    return rows


def guard(tmp: Path) -> dict:
    """A NaN injected into the loss at step 2 (PARALAB_FAULT): --on-nonfinite stop exits 3 naming it,
    skip finishes with that step skipped (summary.json skipped_steps)."""
    rows = {}
    for mode, want in (("stop", 3), ("skip", 0)):
        out = tmp / f"guard-{mode}"
        rc, text, seconds = paralab("train", "ddp", "--workers", "1", *GPT_CHECK[:-1], "--num-batches", "4",
                                    "--on-nonfinite", mode, "--out", str(out), extra_env={"PARALAB_FAULT": "0:2:nan"})
        s = read_summary(out)
        rows[mode] = {"returncode": rc, "expected_returncode": want, "skipped_steps": s.get("skipped_steps"),
                      "error": s.get("error"), "seconds": round(seconds, 1),
                      "status": "passed" if rc == want and (mode == "stop" or s.get("skipped_steps")) else "FAILED"}
        if rows[mode]["status"] == "FAILED":
            rows[mode]["output_tail"] = text
        print(f"gpu-check: --on-nonfinite {mode} with a NaN at step 2: {rows[mode]['status']} (exit {rc})", flush=True)
    return {"status": "FAILED" if any(r["status"] == "FAILED" for r in rows.values()) else "passed", **rows}


def warm_start(tmp: Path) -> dict:
    """One ddp --check at one GPU forked from a `paralab serve` server, beside the same run started cold.

    The server imports torch but must not initialise CUDA (a forked child could not use it): the served
    run passing its check on the GPU is the proof. Timed twice each, alternating."""
    serve = lambda *a: paralab("serve", *a, served=True, timeout=120)  # noqa: E731
    rc, text, _ = serve()
    if rc != 0:
        return {"status": "FAILED", "why": "paralab serve did not start", "output_tail": text}
    rows, times = [], {"served": [], "cold": []}
    try:
        for i in range(4):
            kind = "served" if i % 2 == 0 else "cold"
            out = tmp / f"warm-{i}"
            rc, text, seconds = paralab("train", "ddp", "--workers", "1", *CHECK_ARGS, "--out", str(out),
                                        served=kind == "served")
            row = check_row(f"ddp ({kind})", 1, [], out, rc, text, seconds)
            rows.append(row)
            if rc == 0:
                times[kind].append(round(seconds, 2))
        _, status, _ = serve("--status")
    finally:
        serve("--stop")
    failed = any(r["status"] == "FAILED" for r in rows)
    return {"status": "FAILED" if failed else "passed", "runs": rows, "seconds": times,
            "server_status": status.strip()[-400:]}


# ---------------------------------------------------------------------------- benchmarks
def step_flops(model: str, width: float, batch: int, **shape) -> int:
    """FLOPs of one training step (forward and backward, no optimizer) of ``model`` on ``batch`` samples,
    counted on the meta device by ``torch.utils.flop_counter`` (matmuls and convolutions)."""
    sys.path.insert(0, str(SRC))
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from paralab.training.losses import cross_entropy
    from paralab.models import MODALITY, build_model
    with torch.device("meta"):
        net = build_model(model, width=width, **shape)
        if MODALITY[model] == "text":
            context = shape.get("context", 64)
            x = torch.randint(0, 256, (batch, context))
            y = torch.randint(0, 256, (batch, context))
        else:
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    counter = FlopCounterMode(display=False)
    with counter:
        cross_entropy(net(x), y).backward()
    return int(counter.get_total_flops())


def peak_flops(device_name: str | None, arithmetic: str) -> float | None:
    for fragment, peaks in PEAKS.items():
        if device_name and fragment in device_name:
            return peaks[arithmetic]
    return None


BENCH = [("single", "vgg11", []), ("ddp", "vgg11", []), ("torch-ddp", "vgg11", []), ("fsdp", "vgg11", []),
         ("torch-fsdp", "vgg11", []), ("single", "gpt", [])]


def benchmarks(device: str, tmp: Path, steps: int) -> list[dict]:
    import torch
    # the arithmetic torch uses for fp32 by default: cuDNN convolutions in TF32, matmuls in fp32
    arithmetic = {"vgg11": "tf32" if torch.backends.cudnn.allow_tf32 else "fp32",
                  "gpt": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"}
    rows = []
    for strategy, model, extra in BENCH:
        batch = 256 if model == "vgg11" else 64
        shape = dict(layers=4, heads=4, embed=128, context=64) if model == "gpt" else {}
        dataset = ["--dataset", "synthetic"] if model == "vgg11" else []
        out = tmp / f"bench-{strategy}-{model}"
        rc, text, seconds = paralab("train", strategy, "--workers", "1", "--device", "cuda", "--model", model,
                                    "--batch-size", str(batch), "--num-batches", str(steps), "--warmup", "5",
                                    "--eval-batches", "1", "--no-progress", *dataset, *extra, "--out", str(out))
        s = read_summary(out)
        row = {"strategy": strategy, "model": model, "width": 1.0, "batch": batch, "returncode": rc,
               "seconds_per_iter": s.get("seconds_per_iter"), "samples_per_s": s.get("samples_per_s"),
               "seconds_per_iter_median": s.get("seconds_per_iter_median")}
        if rc != 0:
            row["output_tail"] = text
        try:
            flops = step_flops(model, 1.0, batch, **shape)
            peak = peak_flops(device, arithmetic[model])
            row.update(flops_per_step=flops, arithmetic=arithmetic[model], peak_flops=peak)
            if peak and s.get("seconds_per_iter"):
                row["achieved_flops"] = flops / s["seconds_per_iter"]
                row["mfu"] = row["achieved_flops"] / peak
        except Exception as exc:  # noqa: BLE001 - the samples/s still stand
            row["flops_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(f"gpu-check: bench {strategy} {model}: {row.get('samples_per_s')} samples/s, MFU {row.get('mfu')}",
              flush=True)
    return rows


def write(name: str, obj: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--skip-tests", action="store_true", help="leave out the CUDA-marked tests")
    p.add_argument("--skip-checks", action="store_true", help="leave out the strategies' --check runs")
    p.add_argument("--skip-bench", action="store_true", help="leave out the benchmarks")
    p.add_argument("--jobs", type=int, default=1,
                   help="checks run at a time, each its own process on the same GPU (default 1)")
    p.add_argument("--bench-steps", type=int, default=200, help="training steps per benchmark run (5 warm-up)")
    a = p.parse_args(argv)
    if os.environ.get("PARALAB_GPU_CHECK_CHILD") != "1":
        python, said = choose_python()
        if python is None:
            print("gpu-check: no CUDA device visible, so nothing was run (the GPU run is still owed). "
                  "Interpreters tried:\n  " + "\n  ".join(said)
                  + "\nRun this on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
            return 2
        if python != sys.executable:  # a venv's python links to the system's: compare the paths as given
            os.environ["PARALAB_GPU_CHECK_CHILD"] = "1"
            os.execv(python if os.sep in python else _which(python), [python, __file__, *(argv or sys.argv[1:])])
    import torch
    device = torch.cuda.get_device_name(0)
    gpus = torch.cuda.device_count()
    header = {"device": device, "gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": sys.version.split()[0], "host_cpu": cpu_name(), "host_cores": os.cpu_count(),
              "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"gpu-check: {gpus} x {device}, torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="paralab-gpu-") as d:
        tmp = Path(d)
        result = dict(header)
        if not a.skip_tests:
            result["cuda_tests"] = cuda_tests()
            failed |= result["cuda_tests"]["status"] == "FAILED"
            print(f"gpu-check: CUDA tests: {result['cuda_tests']['status']} {result['cuda_tests'].get('summary', '')}",
                  flush=True)
            write("gpu-check.json", result)
        if not a.skip_checks:
            result["checks"] = strategy_checks(gpus, tmp, a.jobs)
            failed |= any(r["status"] == "FAILED" for r in result["checks"])
            write("gpu-check.json", result)
            result["guard"] = guard(tmp)
            failed |= result["guard"]["status"] == "FAILED"
            write("gpu-check.json", result)
            result["warm_start"] = warm_start(tmp)
            failed |= result["warm_start"]["status"] == "FAILED"
            print(f"gpu-check: warm start: {result['warm_start']['status']}, seconds {result['warm_start'].get('seconds')}",
                  flush=True)
            write("gpu-check.json", result)
        if not a.skip_bench:
            path = write("gpu-bench.json", {**header, "runs": benchmarks(device, tmp, a.bench_steps)})
            print(f"gpu-check: benchmarks -> {path}", flush=True)
            import matmul  # bench/matmul.py
            peak = peak_flops(device, "bf16")
            rows = matmul.measure("cuda", peak=peak, say=lambda line: print(f"gpu-check: matmul{line}", flush=True))
            path = write("gpu-matmul.json", {**header, "dtype": "bf16", "peak_flops": peak, "rows": rows,
                                             "cluster_matmul": matmul.ramp(rows)})
            print(f"gpu-check: matmul ramp -> {path}", flush=True)
    print(f"gpu-check: {'FAILED' if failed else 'passed'}; results in {RESULTS}/gpu-*.json", flush=True)
    return 1 if failed else 0


def _which(name: str) -> str:
    import shutil
    return shutil.which(name) or name


if __name__ == "__main__":
    sys.exit(main())
