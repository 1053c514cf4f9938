"""Faults at random moments, and what survives them: ``python bench/chaos.py [--trials 20] [--seed 0]``.

Each trial is a run (ddp, fp64, a checkpoint every step, ``--max-restarts``)
on 2 to 4 local ranks that meets one fault at a random moment, drawn from a
seeded generator:

- ``rank``: a random rank killed (SIGKILL) at the start of a random step;
- ``save``: a random rank killed while it saves a random step's checkpoint,
  its own file written and the generation not yet committed (the torn save);
- ``records``: a random rank killed while the run's records are written
  (rank 0: its step records written, ``summary.json`` not yet; another: its
  records sent to rank 0);
- ``done``: a random rank killed once the records are written (a finished
  run: nothing may restart);
- ``launcher``: the launching process killed (SIGKILL) after a random delay,
  its ranks going with it; the run is then started again by hand with
  ``--resume``, as a user would, until it finishes.

A rank's fault fires in the first start of the group only; the launcher's
restarts (``--max-restarts 2``) take the run on from its newest committed
checkpoint. For each trial: whether the run finished, the steps done twice
(a restart's ``steps_lost``, a launcher kill's last logged step minus the step
it resumed from: at most K = 1), bytes lost (every committed generation's
files checked against their manifest: 0), and whether the final weights are
bit-identical to an uninterrupted run of the same layout, and whether its
``steps.jsonl`` holds every (step, rank) exactly once with the uninterrupted
run's losses. Then one disk-full
trial on a 10 MiB tmpfs (root only): the run stops with exit 4, its last
committed checkpoint verifies, and a resume into a folder with room finishes
bit-identical. The table goes to stdout, the trials to bench/results/chaos.json.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, SRC, cpu_name, paralab_train, write_result

sys.path.insert(0, str(SRC))
import torch  # noqa: E402

from paralab.run import generations  # noqa: E402

STEPS, EVERY = 8, 1
COMMON = ["--dataset", "synthetic", "--synthetic-size", "256", "--width", "0.125", "--batch-size", "24",
          "--precision", "fp64", "--num-batches", str(STEPS), "--checkpoint-every", str(EVERY),
          "--no-progress", "--log-every", "1", "--eval-batches", "1", "--eval-batch-size", "24", "--timeout", "30"]


def losses(run: Path) -> list | None:
    """Every (step, rank, loss) of a run's steps.jsonl, sorted (a pair twice shows up twice); None if absent."""
    import json
    try:
        rows = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    except OSError:
        return None
    return sorted((r["step"], r["rank"], r["loss"]) for r in rows)


def final_weights(run: Path) -> dict:
    gen = generations.newest(run)
    return torch.load(gen.verify(0), weights_only=True)["state"]["model"]


def bytes_lost(run: Path) -> int:
    """Bytes of committed generations that no longer match their manifest (a committed file gone, changed)."""
    lost = 0
    for gen in generations.committed(run):
        for rank, entry in gen.files.items():
            try:
                gen.verify(rank)
            except Exception:  # noqa: BLE001 - what does not verify is lost
                lost += entry["bytes"]
    return lost


def last_logged_step(text: str) -> int:
    steps = [int(m) for m in re.findall(r"^step\s+(\d+)/", text, re.M)]
    return max(steps, default=0)


def launch(workers: int, out: Path, extra: list[str], env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paralab", "train", "ddp", "--workers", str(workers), *COMMON, *extra,
           "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {}), "PYTHONPATH": str(SRC), "PARALAB_SERVE": "off"})


def trial(n: int, rng: random.Random, scratch: Path, baselines: dict) -> dict:
    workers = rng.choice([2, 3, 4])
    kind = rng.choice(["rank", "save", "records", "done", "launcher"])
    out = scratch / f"trial{n}"
    if workers not in baselines:
        base = paralab_train(["ddp", "--workers", str(workers), *COMMON], scratch / f"base{workers}")
        if base.returncode != 0:
            raise RuntimeError(base.stdout[-2000:] + base.stderr[-2000:])
        baselines[workers] = final_weights(scratch / f"base{workers}")
        baselines[("losses", workers)] = losses(scratch / f"base{workers}")
    record = {"trial": n, "workers": workers, "fault": kind, "redone": 0}
    if kind in ("rank", "save", "records", "done"):
        rank = rng.randrange(workers)
        step = rng.randrange(1, STEPS) if kind in ("rank", "save") else STEPS  # records, done: after the last
        record |= {"rank": rank, "step": step}
        p = launch(workers, out, ["--max-restarts", "2"], {"PARALAB_FAULT": f"{rank}:{step}:"
                                                            f"{'kill' if kind == 'rank' else kind}:1"})
        text, _ = p.communicate(timeout=600)
        record["exit"] = p.returncode
        summary = out / "summary.json"
        if summary.exists():
            import json
            restarts = json.loads(summary.read_text()).get("restarts") or []
            record["restarts"] = len(restarts)
            record["redone"] = max((r.get("steps_lost") or 0 for r in restarts), default=0)
    else:
        delay = rng.uniform(1.0, 6.0)
        record["after_s"] = round(delay, 2)
        p = launch(workers, out, [])
        time.sleep(delay)
        killed = p.poll() is None
        if killed:
            os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate(timeout=600)
        record["killed"] = killed
        reached, attempts = last_logged_step(text), 1
        while not (out / "summary.json").exists() and attempts < 5:  # resumed by hand until it finishes
            resume = generations.newest(out)
            args = ["--resume", str(out)] if resume is not None else (["--overwrite"] if out.exists() else [])
            record["redone"] = max(record["redone"], reached - (resume.step if resume else 0))
            q = launch(workers, out, args)
            text, _ = q.communicate(timeout=600)
            reached, attempts = last_logged_step(text), attempts + 1
        record["exit"] = 0 if (out / "summary.json").exists() else 1
    record["finished"] = (out / "summary.json").exists() and generations.newest(out) is not None \
        and generations.newest(out).step == STEPS
    record["bytes_lost"] = bytes_lost(out) if (out / "checkpoint").exists() else 0
    if record["finished"]:
        mine, base = final_weights(out), baselines[workers]
        record["identical"] = all(torch.equal(mine[k], base[k]) for k in base)
    else:
        record["identical"] = False
    record["records_whole"] = losses(out) == baselines[("losses", workers)]  # every (step, rank) once, same losses
    return record


def disk_full(scratch: Path, baselines: dict) -> dict:
    """A run on a 10 MiB tmpfs (two generations of this run fit, a third does not): it must stop with exit 4,
    keep its committed checkpoints, and resume elsewhere."""
    if os.geteuid() != 0:
        return {"skipped": "needs root to mount a tmpfs"}
    disk = scratch / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], capture_output=True).returncode:
        return {"skipped": "mount -t tmpfs failed"}
    try:
        out = disk / "run"
        p = launch(2, out, [])
        text, _ = p.communicate(timeout=600)
        last = generations.newest(out)
        record = {"exit": p.returncode, "one_line": len([x for x in text.splitlines() if "No space left" in x]) == 1,
                  "committed_step": last.step if last else None, "bytes_lost": bytes_lost(out)}
        room = scratch / "room"
        shutil.copytree(out, room)
        q = launch(2, room, ["--resume", str(room)])
        q.communicate(timeout=600)
        record["resumed_identical"] = (room / "summary.json").exists() and all(
            torch.equal(final_weights(room)[k], v) for k, v in baselines[2].items())
        return record
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "chaos.json"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    baselines: dict = {}
    with tempfile.TemporaryDirectory(prefix="paralab-chaos-") as tmp:
        scratch = Path(tmp)
        trials = []
        for n in range(args.trials):
            t = trial(n, rng, scratch, baselines)
            trials.append(t)
            print(f"trial {n:>2}: {t['workers']} ranks, {t['fault']:<8} -> finished {t['finished']}, redone "
                  f"{t['redone']}, bytes lost {t['bytes_lost']}, identical {t['identical']}, records whole "
                  f"{t['records_whole']}", flush=True)
        if 2 not in baselines:
            paralab_train(["ddp", "--workers", "2", *COMMON], scratch / "base2")
            baselines[2] = final_weights(scratch / "base2")
        full = disk_full(scratch, baselines)
    totals = {"faults": len(trials), "finished": sum(t["finished"] for t in trials),
              "identical": sum(t["identical"] for t in trials), "records_whole": sum(t["records_whole"] for t in trials),
              "max_redone": max(t["redone"] for t in trials),
              "bytes_lost": sum(t["bytes_lost"] for t in trials), "K": EVERY}
    print(f"\n{totals['faults']} faults: {totals['finished']} runs finished, {totals['identical']} bit-identical to an "
          f"uninterrupted run, {totals['records_whole']} with every step's records once, at most {totals['max_redone']} step(s) redone (K = {EVERY}), "
          f"{totals['bytes_lost']} bytes lost; disk full: {full}")
    write_result(args.out, {"bench": "chaos", "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                            "steps": STEPS, "checkpoint_every": EVERY, "totals": totals, "disk_full": full,
                            "trials": trials})
    ok = totals["finished"] == totals["faults"] == totals["identical"] == totals["records_whole"] \
        and totals["max_redone"] <= EVERY \
        and totals["bytes_lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
