"""A pipeline stage: one rank's contiguous slice of the model's units.

The model is a flat ``nn.Sequential`` of units; the partitioner
(``paralab.strategies.pipeline.partition``) cuts it into contiguous ranges, one per stage. A
:class:`Stage` runs its units forward for one microbatch at a time, keeping
what backward needs, and backward whole or in two parts; the executor
(``executor.py``) decides in which order, from a schedule (``schedules.py``).

A whole backward (``B``) needs only the stage's input and output: the
forward builds one autograd graph for the stage and backward is one call.
A split backward (zero-bubble ``I`` then ``W``) needs more: the forward
cuts the graph at every unit (each unit runs on a detached copy of the
previous unit's output), so ``I`` can stop at each unit's input and ``W``
can start from each unit's output instead of walking the whole stage
again. The cut costs a few per cent (one autograd call per unit), so it is
made only for the microbatches whose backward is split.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...training import step as steps
from ...models.moe import carry_aux_loss
from ...training import saved


class Stage:
    """One rank's contiguous slice of the units, with a forward and a whole or split backward.

    ``forward(mb, x, split)`` keeps, for microbatch ``mb``, the segments its
    backward walks back: one (parameters, input, output) for the whole stage,
    or one per unit when ``split``. It also measures the bytes autograd saved
    for the microbatches alive (with ``saved_tensors_hooks``) and their peak;
    how many microbatches were alive at once the analysis reads from the spans.
    """

    def __init__(self, units: dict[int, nn.Module], first: bool, last: bool,
                 in_shape: tuple[int, ...], out_shape: tuple[int, ...], ctx):
        self.indices = list(units)
        self.units = nn.ModuleList(units.values()).to(ctx.device)
        self.first, self.last = first, last
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)  # per sample
        self.ctx = ctx
        self.saved: dict[int, list[tuple[list, torch.Tensor, torch.Tensor]]] = {}  # (params, input, output)
        self.saved_bytes: dict[int, int] = {}
        self.weight_work: dict[int, list] = {}  # per microbatch, what its W needs (after its I)
        self.peak_bytes = 0
        self._param_ptrs: set[int] | None = None  # the parameters' storage, left out of the saved bytes
        self._trained: list[list[nn.Parameter]] | None = None  # each unit's parameters that train ...
        self._trained_all: list[nn.Parameter] = []                # ... and the whole stage's

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
    def forward(self, mb: int, x: torch.Tensor, split: bool = False, weight: float = 1.0) -> torch.Tensor:
        """Run the stage on microbatch ``mb``, keeping what its backward needs (per unit if ``split``).

        A mixture of experts' load-balancing loss (``models/moe.py``) is carried by each unit's output,
        times ``weight`` (the microbatch's share of the loss), so the stage's backward includes it."""
        seen: dict[tuple[int, int], int] = {}
        if self._param_ptrs is None:  # at the first forward, not at build: a data-parallel flavour
            # wrapping the stage may re-point the parameters first (ZeRO-1's flat views)
            self._param_ptrs = {p.data_ptr() for p in self.units.parameters()}
            self._trained = [[p for p in unit.parameters() if p.requires_grad] for unit in self.units]
            self._trained_all = [p for ps in self._trained for p in ps]
        param_ptrs = self._param_ptrs

        outer_pack, outer_unpack = saved.outer_hooks()

        def pack(t: torch.Tensor):
            if t.data_ptr() not in param_ptrs:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return outer_pack(t)  # on to the hooks outside (the run's probe of the step, when one watches)

        segments = []
        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), self.ctx.autocast(), \
                steps.microbatch(mb):  # its rows in the step (dropout masks, documents)
            # a leaf at the stage's input (its gradient is what goes to the stage before) and, when
            # split, at every unit's input (its gradient is what the unit hands to the one before)
            inp = h = x.detach().requires_grad_(not self.first)
            for n, unit in enumerate(self.units):
                if split and n > 0:
                    inp = h = h.detach().requires_grad_()
                h = carry_aux_loss(unit, unit(h), weight, self.ctx.scaled)
                if split:
                    segments.append((self._trained[n], inp, h))
            if not split:
                segments.append((self._trained_all, inp, h))
        self.saved[mb] = segments
        self.saved_bytes[mb] = sum(seen.values())
        self.peak_bytes = max(self.peak_bytes, sum(self.saved_bytes.values()))
        return h

    def backward(self, mb: int, grad_output: torch.Tensor | None = None,
                 loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back through microbatch ``mb``'s segments, last to first, one autograd call each.

        Starts from ``loss`` (last stage) or from ``grad_output``, the gradient
        of this stage's output. Each call is ``torch.autograd.backward`` limited
        to the segment's input and parameters (``inputs=``), so parameter
        gradients accumulate in ``.grad`` the ordinary way and the
        post-accumulate hooks of a data-parallel flavour fire as they would in
        one ``loss.backward()``. Returns the gradient of the stage's input
        (None on the first stage).
        """
        segments = self.saved.pop(mb)
        self.saved_bytes.pop(mb)
        grad = grad_output
        for params, inp, out in reversed(segments):
            wrt = ([inp] if inp.requires_grad else []) + params
            if not wrt:
                grad = None
                continue
            if loss is not None:  # the last segment of the last stage: the loss is a function of its output
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
        pending = []
        grad = grad_output
        for params, inp, out in reversed(self.saved[mb]):
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
