"""``torch-cp``: PyTorch's own context parallelism, beside ``cp``: refused here, with the exact reason.

PyTorch 2.13's ``torch.distributed.tensor.experimental.context_parallel(mesh,
buffers=..., buffer_seq_dims=...)`` shards the given buffers along the
sequence (head-tail load balancing) and, inside the context, swaps
``F.scaled_dot_product_attention`` for a ring over the cp group by
intercepting the ATen operator it dispatches to. It registers ring versions
of the CUDA kernels only: ``_scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention``, ``_scaled_dot_product_cudnn_attention``
and their backwards. On CPU, SDPA dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, which has no entry, so the
first attention raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered``; and the CUDA kernels it does handle have no
CPU implementation to call instead. So on gloo/CPU it cannot run at all,
whatever the model. :func:`cpu_probe` tries it (one rank, gloo) and returns
the error, so a test notices the day a PyTorch release runs it.

On CUDA it could run (its flash kernel takes fp16/bf16 only, so an exact
fp64 ``--check`` would not apply); paralab has no CUDA path for it yet, and
refuses that too, saying so.
"""
from __future__ import annotations

from ..errors import UsageError
from .base import Strategy

WHY_NOT_CPU = ("PyTorch's context_parallel (torch 2.13) replaces only the CUDA attention kernels (flash, "
               "efficient, cuDNN) by its ring; on CPU scaled_dot_product_attention dispatches to "
               "aten._scaled_dot_product_flash_attention_for_cpu, for which it has no handler (NotImplementedError: "
               "'does not have a sharding strategy registered'), and the CUDA kernels have no CPU version. Use "
               "paralab's own: 'paralab train cp --workers 2 --model gpt' (ring) or add --cp-method all-to-all")


class TorchCP(Strategy):
    name = "torch-cp"
    data_parallel = False

    @classmethod
    def validate(cls, cfg, world: int) -> None:
        import torch
        if not (cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())):
            raise UsageError(f"torch-cp cannot run on CPU/gloo: {WHY_NOT_CPU}")
        raise UsageError("torch-cp on CUDA is not written yet (no GPU to verify it against --check); use "
                         "paralab's 'cp' strategy")


def cpu_probe(port: int) -> str | None:
    """In a fresh process: a one-rank gloo group, causal SDPA inside ``context_parallel`` on CPU.
    Returns the error it raises (None: it ran)."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        q = torch.randn(1, 2, 8, 4)
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2], no_restore_buffers={q}):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return None
    except Exception as exc:  # noqa: BLE001 - what PyTorch raises is the finding
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
