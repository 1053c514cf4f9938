"""A pipeline stage: one rank's contiguous slice of the model's units.

The model is a flat ``nn.Sequential`` of units; the partitioner
(``paralab.partition``) cuts it into contiguous ranges, one per stage. A
:class:`Stage` runs its units forward for one microbatch at a time, keeping
what backward needs, and backward one unit at a time; the executor
(``executor.py``) decides in which order, from a schedule (``schedules.py``).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Stage:
    """One rank's contiguous slice of the units, with a per-unit forward and backward.

    ``forward(mb, x)`` runs each unit on a detached copy of the previous
    unit's output and keeps every (input, output) pair until ``backward(mb)``
    walks them back with one autograd call per unit. It also measures the
    bytes autograd saved for the microbatches alive (with
    ``saved_tensors_hooks``) and their peak; how many microbatches were
    alive at once the analysis reads from the spans.
    """

    def __init__(self, units: dict[int, nn.Module], first: bool, last: bool,
                 in_shape: tuple[int, ...], out_shape: tuple[int, ...], ctx):
        self.indices = list(units)
        self.units = nn.ModuleList(units.values()).to(ctx.device)
        self.first, self.last = first, last
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)  # per sample
        self.ctx = ctx
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.saved_bytes: dict[int, int] = {}
        self.weight_work: dict[int, list] = {}  # per microbatch, what its W needs (after its I)
        self.peak_bytes = 0
        self._param_ptrs: set[int] | None = None  # the parameters' storage, left out of the saved bytes

    # ------------------------------------------------------------ bookkeeping
    def parameters(self) -> list[nn.Parameter]:
        return list(self.units.parameters())

    def train(self, mode: bool = True) -> None:
        self.units.train(mode)

    def alive(self) -> int:
        """Microbatches forwarded whose weight gradients are not yet done (B, or W after I)."""
        return len(self.saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under the plain model's keys (``"<unit index>.<name>"``)."""
        return {f"{i}.{k}": v for i, unit in zip(self.indices, self.units) for k, v in unit.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, unit in zip(self.indices, self.units):
            prefix = f"{i}."
            unit.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    # ------------------------------------------------------------ compute
    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """Run the stage on microbatch ``mb``, keeping what backward needs."""
        seen: dict[tuple[int, int], int] = {}
        if self._param_ptrs is None:  # at the first forward, not at build: a data-parallel flavour
            # wrapping the stage may re-point the parameters first (ZeRO-1's flat views)
            self._param_ptrs = {p.data_ptr() for p in self.units.parameters()}
        param_ptrs = self._param_ptrs

        def pack(t: torch.Tensor):
            if t.data_ptr() not in param_ptrs:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        pairs = []
        h = x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.ctx.autocast():
            for n, unit in enumerate(self.units):
                # a leaf per unit: its gradient is what the unit's backward hands to the one before
                inp = h.detach().requires_grad_(n > 0 or not self.first)
                h = unit(inp)
                pairs.append((inp, h))
        self.saved[mb] = pairs
        self.saved_bytes[mb] = sum(seen.values())
        self.peak_bytes = max(self.peak_bytes, sum(self.saved_bytes.values()))
        return h

    def backward(self, mb: int, grad_output: torch.Tensor | None = None,
                 loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back through the units of microbatch ``mb``, last to first, one autograd call each.

        Starts from ``loss`` (last stage) or from ``grad_output``, the gradient
        of this stage's output. Each call is ``torch.autograd.backward`` limited
        to the unit's input and parameters (``inputs=``), so parameter
        gradients accumulate in ``.grad`` the ordinary way and the
        post-accumulate hooks of a data-parallel flavour fire as they would in
        one ``loss.backward()``. Returns the gradient of the stage's input
        (None on the first stage).
        """
        pairs = self.saved.pop(mb)
        self.saved_bytes.pop(mb)
        grad = grad_output
        for unit, (inp, out) in zip(reversed(self.units), reversed(pairs)):
            params = [p for p in unit.parameters() if p.requires_grad]
            wrt = ([inp] if inp.requires_grad else []) + params
            if not wrt:
                grad = None
                continue
            if loss is not None:  # the last unit of the last stage: the loss is a function of its output
                torch.autograd.backward(loss, inputs=wrt)
                loss = None
            else:
                torch.autograd.backward(out, grad_tensors=grad.to(out.dtype), inputs=wrt)
            grad = inp.grad if inp.requires_grad else None
        return grad

    # ------------------------------------------------------------ zero-bubble: backward in two parts
    def backward_input(self, mb: int, grad_output: torch.Tensor | None = None,
                       loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """The input-gradient part (``I``) of microbatch ``mb``'s backward, last unit to first.

        Each unit's input gradient is ``torch.autograd.grad`` of its output
        with respect to its input alone, keeping the unit's graph
        (``retain_graph``) when the unit has weights, with the gradient of its
        output, for :meth:`backward_weight`. Parameter gradients are not
        touched. Returns the gradient of the stage's input (None on the first
        stage). Between a unit's weights and its output lies work both parts
        walk (a BatchNorm and ReLU after a convolution): ``I`` plus ``W`` cost
        a little more than one whole backward.
        """
        pairs = self.saved[mb]
        pending = []
        grad = grad_output
        for unit, (inp, out) in zip(reversed(self.units), reversed(pairs)):
            params = [p for p in unit.parameters() if p.requires_grad]
            root, root_grad = (loss, None) if loss is not None else (out, grad.to(out.dtype))
            loss = None
            if params:
                pending.append((root, root_grad, params))
            if inp.requires_grad:
                (grad,) = torch.autograd.grad(root, inp, grad_outputs=root_grad, retain_graph=bool(params))
            else:
                grad = None
        self.weight_work[mb] = pending
        return grad

    def backward_weight(self, mb: int) -> None:
        """The weight-gradient part (``W``) of microbatch ``mb``: each unit's ``torch.autograd.backward``
        limited to its parameters, from the output gradient ``I`` kept; ``.grad`` accumulates and a
        data-parallel flavour's hooks fire as in a whole backward. Frees the microbatch."""
        for root, root_grad, params in self.weight_work.pop(mb):
            torch.autograd.backward(root, grad_tensors=root_grad, inputs=params)
        self.saved.pop(mb)
        self.saved_bytes.pop(mb)

    @torch.no_grad()
    def infer(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx.autocast():
            for unit in self.units:
                x = unit(x)
        return x
