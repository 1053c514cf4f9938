"""Write a run's model as one plain state_dict, whatever strategy trained it.

Every strategy checkpoints in its own layout: a full model per rank (the
data-parallel strategies), padded flat shards (fsdp), per-stage key sets
(model, pipeline, and any strategy under --pp), DTensor chunks (torch-fsdp).
This reads every rank's file in RUN/checkpoint/ (with --init, the starting
state that `paralab train --save-init` wrote to RUN/checkpoint/init/) with
torch.load(weights_only=True), so a checkpoint's bytes cannot run code; the
strategy that wrote them puts them back together in this one process (its
`consolidate`, no process group); the result must load into the run's model
(config.json, or the checkpoint's identity); it is written with torch.save as
a dict of plain tensors under the model's own keys:

  paralab export runs/fsdp-w2-20250101-120000                 # -> RUN/model.pt
  paralab export runs/ddp-w4-20250101-120000 -o vgg11.pt
  paralab export runs/ddp-w4-20250101-120000 --init           # -> RUN/model-init.pt

and in Python:

  model = paralab.models.build_model("vgg11", width=1.0, norm="batch", num_classes=10)
  model.load_state_dict(torch.load("vgg11.pt", weights_only=True))

An existing output file is kept unless --force. Exit 2 when RUN has no
complete checkpoint (a run saves one when it finishes, and every N steps with
--checkpoint-every N).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError, write_refused
from ..run.consolidate import consolidate

HELP = "write a run's model as one plain state_dict, put together from any strategy's checkpoint"


def add_arguments(p) -> None:
    p.add_argument("run", help="run directory (holds checkpoint/ and, once finished, config.json)")
    p.add_argument("-o", "--output", help="file to write (default RUN/model.pt; with --init RUN/model-init.pt)")
    p.add_argument("--init", action="store_true",
                   help="the starting weights (RUN/checkpoint/init/, written by `paralab train --save-init`)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")


def write(tensors: dict, output: Path) -> None:
    """torch.save of plain, compact tensors, atomically (a partly written file is never left)."""
    import torch
    plain = {k: v.detach().clone().contiguous() for k, v in tensors.items()}  # no shared or padded storage
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(plain, f)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args) -> int:
    import torch
    from ..run.checkpoint import INIT
    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory; give a run directory (paralab train --out)")
    output = Path(args.output) if args.output else run_dir / ("model-init.pt" if args.init else "model.pt")
    if output.is_dir():
        raise UsageError(f"-o {output} is a directory; name a file")
    if output.exists() and not args.force:
        raise UsageError(f"{output} exists; pass --force to replace it, or -o another file")
    try:
        tensors, facts = consolidate(run_dir, INIT if args.init else None)
    except (ValueError, RuntimeError, KeyError, IndexError, TypeError) as exc:
        print(f"paralab: error: {run_dir}'s checkpoint could not be put together: {exc}", file=sys.stderr)
        return 1
    try:
        write(tensors, output)
    except OSError as exc:  # no permission, a full disk (exit 4); a path that cannot be (2)
        raise write_refused(f"-o {output}", exc) from None
    what = "starting weights" if args.init else f"weights at step {facts['step']}"
    print(f"paralab: exported {facts['strategy']}'s {what} ({facts['layout']}, {facts['world']} rank file(s)): "
          f"{len(tensors)} tensors, {facts['parameters']:,} parameters -> {output}")
    double = any(v.dtype == torch.float64 for v in tensors.values())  # --precision fp64: keep them exact
    print(f"load with: model = paralab.models.{facts['build']}{'.double()' if double else ''}; "
          f"model.load_state_dict(torch.load({str(output)!r}, weights_only=True))")
    return 0
