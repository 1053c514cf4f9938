"""The first divergence: where a run that failed ``--check`` first went wrong.

A FAIL says which tensor ended furthest from the single-process reference; a
student needs where it *started*. After a failed check every rank builds the
run again and replays its steps from the first, one step at a time, beside a
fresh reference, and at each step compares three things in the order they
happen:

1. **forward**: every module's output, on every rank, call by call in the
   order the reference's calls return (a module called twice in a forward, a
   block's dropout, at each call). Hooks record each module call of the rank
   (outside backward, so a recomputation's second forward is not counted) and
   of the reference fed the rank's own shard, microbatch by microbatch. A
   rank's output that is a slice of the whole (tensor parallelism splits the
   features, sequence and context parallelism the sequence) is compared with
   the slice at the rank's own coordinate: the contiguous chunk, or the pair
   of chunks a balanced context split holds. An output that maps to no slice
   (an expert's routed tokens) is not compared.
2. **backward**: every parameter's gradient as the optimizer receives it
   (after the strategy's synchronisation and any clipping), in reverse order
   of the modules' calls. No strategy needs to say where its shards sit: the
   step is taken once with every optimizer replaced by ``w = -g``, and the
   strategy's own ``full_state_dict`` (what ``--check`` compares) gives the
   whole tensors, so ``-after`` is the whole gradient, exactly (``w - g``
   would round it to the weight's precision); a tensor the probe left as it
   was (a skipped step) had none. Every tensor the step wrote is then put
   back and the real step taken.
3. **optimizer step**: the weights after the step.

The first difference beyond the check's tolerance, over every rank, is one
line: ``first divergence: step 1, rank 0, backward of features.3 (Conv2d)
weight gradient, max |d| 0.5``. A forward difference comes before any
gradient's at its step, and a gradient's before the step's weights'; the
backward's first is the one nearest the loss. docs/correctness.md.

In fp64 the tolerance is fixed (``TOLERANCES``). Below fp64 (and for a
strategy with a lossy ``gradient_wire``) every one of those quantities differs
from the reference by rounding, so each is judged as the check's verdict
judges the weights (:class:`Judge`): within fp64's tolerances it is exact,
beyond them it must lie inside its own noise band, measured by the band's
three perturbed references (``check/band.py``) replayed beside the reference,
step for step, on the same shard: the first divergence is the first quantity
outside its band, said with how far (``..., max |d| 0.5, 41 x its band``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..data.loader import to_device

from ..strategies.base import split_microbatches
from ..training import step as steps
from .reference import TOLERANCES, max_abs_diff

#: path segments wrappers add to a module's name (activation checkpointing, DDP, torch.compile)
WRAPPERS = ("_checkpoint_wrapped_module.", "module.", "_orig_mod.")
#: the directions, in the order they happen within a step
DIRECTIONS = ("forward", "backward", "optimizer step")


def plain_name(name: str) -> str:
    for segment in WRAPPERS:
        name = name.replace(segment, "")
    return name


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


def host(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``t`` on the host in float64; a DTensor's local part, None where that is a partial sum (global
    hooks run before DTensor's own, which would reduce it)."""
    if hasattr(t, "to_local"):
        if any(p.is_partial() for p in t.placements):
            return None
        t = t.to_local()
    return t.detach().to("cpu", torch.float64).clone()


@dataclass(order=True)
class Finding:
    """One difference beyond tolerance; findings sort by when they happen."""
    step: int           # counted from 1
    direction: int      # index in DIRECTIONS
    order: int          # forward: the module's place in the reference's calls; else the parameter's in its order
    rank: int
    module: str
    kind: str           # the module's class
    tensor: str         # "output", "weight gradient", "bias"
    deviation: float
    ratio: float = field(default=0.0, compare=False)  # the deviation over its noise band (0: a fixed tolerance)

    def line(self) -> str:
        return (f"first divergence: step {self.step}, rank {self.rank}, {DIRECTIONS[self.direction]} of "
                f"{self.module} ({self.kind}) {self.tensor}, max |d| {self.deviation:.3g}"
                + (f", {self.ratio:.3g} x its band" if self.ratio else ""))


class BandAt:
    """The band's references at one replayed step, worked out on first need (a step whose every quantity is
    within fp64's tolerances trains none of them, as the check trains its band only beyond exact): ``calls()``
    their module outputs on the rank's shard, then ``stepped()`` each one's (gradients, state after) and its
    losses. They catch up from wherever they stand (``Reference.advance_to``), so a step that needed none
    costs nothing later."""

    def __init__(self, band, step: int, replica: int):
        self.band, self.step, self.replica = band, step, replica
        self._calls = self._stepped = None

    def calls(self) -> list:
        if self._calls is None:
            assert self._stepped is None, "a step's forward is compared before its step"
            for ref in self.band.refs:
                ref.advance_to(self.step)
            self._calls = [reference_calls(ref, self.step, self.replica) for ref in self.band.refs]
        return self._calls

    def stepped(self) -> list:
        if self._stepped is None:
            self._stepped = [reference_step(ref, self.step) for ref in self.band.refs]
        return self._stepped

    def losses(self) -> list:
        self.stepped()
        return [ref.losses[self.step][self.replica] for ref in self.band.refs]


class Judge:
    """How far a replayed quantity may lie from the reference's: fp64's fixed tolerances; with a ``band``
    (below fp64, or a lossy wire) beyond them its own noise band, from the values the band's references
    (``check/band.py``, standing at the same step) hold for it."""

    def __init__(self, precision: str, band=None):
        self.band = band
        self.tol = TOLERANCES["fp64" if band is not None else precision]
        self.worst = 0.0  # the largest ratio to its band of any quantity beyond fp64's tolerances so far

    def limit(self, kind: str, value, others) -> float:
        """``others()``: the band's references' values of the quantity, asked for only where a band is."""
        if self.band is None:
            return self.tol[kind]
        return max(self.tol[kind], self.band.of(value, others()))

    def ratio(self, deviation: float, limit: float) -> float:
        return deviation / limit if self.band is not None and limit > 0 else 0.0


class Calls:
    """Every named module's outputs in the order of its calls, while entered. ``names``: id(module) -> name."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.sequence: list[tuple[str, int]] = []  # every call as (name, its k-th), in the order they returned
        self.started: list[str] = []  # names in the order their first call began (a parent before its children)

    def pre_hook(self, module, args):
        name = self.names.get(id(module))
        if name is not None and name not in self.started and torch._C._current_graph_task_id() == -1:
            self.started.append(name)

    def hook(self, module, args, output):
        name = self.names.get(id(module))
        t = first_tensor(output)
        if name is None or t is None or torch._C._current_graph_task_id() != -1:  # inside backward: recomputed
            return
        t = host(t)
        if t is None:
            return
        self.sequence.append((name, len(self.calls.get(name, ()))))
        self.calls.setdefault(name, []).append(t)

    def __enter__(self):
        self.handles = [nn.modules.module.register_module_forward_hook(self.hook),
                        nn.modules.module.register_module_forward_pre_hook(self.pre_hook)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def names_of(roots: list[nn.Module]) -> dict[int, str]:
    """id -> name of every module the rank's models hold now, named as the reference names it (the
    wrappers' segments removed; a module a strategy put in a layer's place takes the layer's name)."""
    return {id(m): plain_name(name) for root in roots for name, m in root.named_modules() if name}


def slices(whole: torch.Tensor, shape: torch.Size, coords: dict[str, int], sizes: dict[str, int], cp_layout=None):
    """The slices of ``whole`` a rank at ``coords`` may hold with ``shape``: the chunk at its tp or cp
    coordinate along the one dimension that differs, or a balanced cp split's pair of chunks, or (``cp_layout``:
    the context split the rank's strategy used this step, ``strategies/context/layout.py``) the chunks it says
    the rank held, as dealt for packed documents."""
    if whole.shape == shape:
        return [whole]
    if whole.dim() != len(shape):
        return []
    differ = [d for d in range(whole.dim()) if whole.shape[d] != shape[d]]
    if len(differ) != 1 or whole.shape[differ[0]] % shape[differ[0]]:
        return []
    d = differ[0]
    k = whole.shape[d] // shape[d]
    out = []
    for dim in ("tp", "cp"):
        if sizes.get(dim, 1) != k:
            continue
        i = coords.get(dim, 0)
        out.append(whole.chunk(k, d)[i])
        halves = whole.chunk(2 * k, d)
        if len(halves) == 2 * k:
            out.append(torch.cat([halves[i], halves[2 * k - 1 - i]], d))
        if dim == "cp" and cp_layout is not None and whole.shape[d] == cp_layout.context:
            out.append(cp_layout.take(whole, i, dim=d))
    return out


def deviation(mine: torch.Tensor, whole: torch.Tensor, coords, sizes, cp_layout=None) -> float | None:
    candidates = [c for c in slices(whole, mine.shape, coords, sizes, cp_layout) if c.shape == mine.shape]
    if not candidates:
        return None
    devs = [float((mine - c).abs().max()) if mine.numel() else 0.0 for c in candidates]
    return min(float("inf") if d != d else d for d in devs)


def reference_calls(ref, step: int, replica: int) -> Calls:
    """The module outputs of ``ref`` (a ``verdict.Reference``) on this rank's shard of ``step``, microbatch by
    microbatch, under the reference's autocast (a copy of its model: its BatchNorm statistics are left as they
    are)."""
    twin = copy.deepcopy(ref.model)
    twin.train()
    calls = Calls(names_of([twin]))
    dtype = next(twin.parameters()).dtype
    x, y = ref.source.batch(step, rank=replica)
    x = to_device(x, x.device, dtype)
    autocast = torch.autocast(x.device.type, dtype=ref.autocast, enabled=ref.autocast is not None)
    with steps.entered(steps.of_shard(ref.source, step, x, y, ref.seed)), calls, torch.no_grad(), autocast:
        chunks = split_microbatches(x, y, ref.microbatches)
        steps.split([len(c[1]) for c in chunks])
        for i, (xs, _, _) in enumerate(chunks):
            with steps.microbatch(i):
                twin(xs)
    return calls


class Probe:
    """Every optimizer's step replaced by ``w = -g`` while entered (a parameter without a gradient left as it
    is), so a step leaves ``-g`` behind, exactly: ``w - g`` would round ``g`` to ``w``'s precision."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers

    @staticmethod
    def descend(optimizer, closure=None):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:  # torch.optim skips the others (fsdp steps unit by unit)
                        p.copy_(p.grad).neg_()

    def __enter__(self):
        for opt in self.optimizers:
            opt.step = self.descend.__get__(opt)
        return self

    def __exit__(self, *exc):
        for opt in self.optimizers:
            del opt.step


def weights_of(strategy, roots: list[nn.Module], optimizers: list) -> list[torch.Tensor]:
    """Every floating-point tensor reachable from the strategy's attributes (through modules, lists, dicts and
    paralab's own objects), the models and the optimizers' parameters: what a step may write."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [(strategy, 0), *((r, 0) for r in roots),
            *((p, 0) for opt in optimizers for g in opt.param_groups for p in g["params"])]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and fits(obj):
                found.setdefault(id(obj), obj)
            continue
        if isinstance(obj, torch.optim.Optimizer):
            continue  # its parameters are listed above; its state is not the probe's to touch
        if isinstance(obj, nn.Module):
            todo += [(t, depth + 1) for t in (*obj.parameters(), *obj.buffers())]
            todo += [(v, depth + 1) for v in vars(obj).values() if isinstance(v, torch.Tensor)]
            todo += [(m, depth + 1) for m in obj.children()]
        elif isinstance(obj, dict):
            todo += [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, (list, tuple)):
            todo += [(v, depth + 1) for v in obj]
        elif type(obj).__module__.startswith("paralab") and hasattr(obj, "__dict__"):
            todo += [(v, depth + 1) for v in vars(obj).values()]
    return list(found.values())


def fits(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds it: a freed buffer (ZeRO-3's gathered parameters between uses, its
    storage resized to nothing) is gathered again from the shards, neither read nor written here."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().nbytes() >= local.numel() * local.element_size()


def _plain(v) -> bool:
    """A value copied and put back as it is: numbers, strings, None, and containers of them."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


def held_objects(strategy, wanted) -> list:
    """The objects a strategy holds for which ``wanted(o)``: itself, its data-parallel flavour (a pipeline's, one
    per stage it holds), an inner strategy's, their compressors (followed through paralab's and a user's file's
    objects and the dicts, lists and tuples they hold, not modules or tensors)."""
    from ..strategies.user import PREFIX
    found, seen, todo = [], set(), [strategy]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if wanted(o):
            found.append(o)
        values = list(o.values()) if isinstance(o, dict) else list(o) if isinstance(o, (list, tuple)) else \
            list(getattr(o, "__dict__", {}).values())
        todo += [v for v in values if isinstance(v, (dict, list, tuple)) or (
            type(v).__module__.startswith(("paralab.", PREFIX)) and not isinstance(v, (nn.Module, torch.Tensor)))]
    return found


def users_objects(strategy) -> list:
    """The objects of classes from a user's file (``strategies/user.py``) a strategy holds."""
    from ..strategies.user import PREFIX
    return held_objects(strategy, lambda o: type(o).__module__.startswith(PREFIX))


class CarriedState:
    """What a strategy's gradient compressors carry from step to step (PowerSGD's step count, Q and error
    feedback: ``state_dict``), kept before the probed step and put back after it, so the real step compresses
    as the run did."""

    def __init__(self, strategy):
        from ..strategies.compression import NoCompression
        self.kept = [(c, c.state_dict()) for c in held_objects(strategy, lambda o: isinstance(o, NoCompression))]
        self.device = getattr(getattr(strategy, "ctx", None), "device", torch.device("cpu"))

    def restore(self) -> None:
        for compressor, state in self.kept:
            compressor.load_state_dict(state, self.device)


class UsersState:
    """What a user's objects hold in plain values (a step count, a flag), kept before the probed step and put
    back after it: the replay takes each step twice, and a user's strategy counting its own steps would
    otherwise count two a step and go wrong a step early. (Their tensors are put back as every strategy's are.)"""

    def __init__(self, strategy):
        self.kept = [(o, copy.deepcopy({k: v for k, v in vars(o).items() if _plain(v)}))
                     for o in users_objects(strategy)]

    def restore(self) -> None:
        for o, state in self.kept:
            for k in [k for k, v in vars(o).items() if _plain(v) and k not in state]:
                delattr(o, k)  # set by the probed step (a count a class attribute started)
            vars(o).update(copy.deepcopy(state))


def step_twice(step: steps.Step, strategy, roots: list[nn.Module], optimizers: list):
    """The rank's step taken twice: once probed (its module outputs, and the whole gradient as ``-after`` of
    ``full_state_dict`` under ``w = -g``), then, every tensor put back, for real. Returns (the
    module outputs, the gradients by name, the real step's ``StepResult``, the weights after). An fp16 loss
    scale is put back too (the probed step would count it, or halve it on an overflow), and what a compressor
    carries between steps (:class:`CarriedState`). What a parameter holds in
    ``.grad`` when the step starts is put back too: a gradient a strategy wrongly keeps from one step to the
    next is then seen in the next step's gradients, where the run first differs, not doubled by the probe
    into this step's update; what a user's strategy holds in plain values is put back too (:class:`UsersState`)."""
    held = weights_of(strategy, roots, optimizers)
    kept = [t.detach().clone() for t in held]
    grads = [(t, None if t.grad is None else t.grad.detach().clone()) for t in held if t.requires_grad]
    before = {k: v.detach().clone() for k, v in strategy.full_state_dict().items()}
    users, carried = UsersState(strategy), CarriedState(strategy)
    scale = getattr(getattr(strategy, "ctx", None), "loss_scale", None)
    scale_before = scale.state_dict() if scale is not None else None
    with steps.entered(step), Calls(names_of(roots)) as mine, Probe(optimizers):
        strategy.run_step(step.x, step.y)
    users.restore()
    carried.restore()
    if scale is not None:
        scale.load_state_dict(scale_before)
    probed = strategy.full_state_dict()
    # -g where the probe stepped, 0 where nothing stepped a tensor (a skipped step; it kept its value)
    gradients = {k: torch.where(v.detach() == before[k], 0.0, -v.detach()) for k, v in probed.items()
                 if v.is_floating_point()}
    with torch.no_grad():
        for t, k in zip(held, kept):
            if fits(t):
                t.copy_(k)
        for t, g in grads:
            t.grad = g
    with steps.entered(step):
        result = strategy.run_step(step.x, step.y)
    return mine, gradients, result, strategy.full_state_dict()


def reference_step(ref, step: int) -> tuple[dict, dict]:
    """The reference's step ``step``: (each parameter's gradient as its optimizer receives it, none where it
    did not step: an fp16 overflow; the state after)."""
    grads: dict[str, torch.Tensor] = {}
    named = dict(ref.model.named_parameters())

    def keep(optimizer, args, kwargs):
        grads.update({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                      for n, p in named.items()})
    handle = ref.optimizer.register_step_pre_hook(keep)
    try:
        ref.advance_to(step + 1)
    finally:
        handle.remove()
    return grads, ref.model.state_dict()


def locate(step: int, x, y, strategy, roots: list[nn.Module], optimizers: list, ref, mesh, replica: int,
           judge: Judge, routing=None) -> Finding | None:
    """Step ``step`` (from 0) of the run on this rank, beside the reference (``check.verdict.Reference`` at
    ``step``, advanced by one here, and so are the band's references where ``judge`` has them): this rank's first
    difference, or None. ``routing``: a mixture of experts below fp64, the run's ``routing.Recording`` and the
    ``Routes`` the references follow, every rank's choices of this step handed to them before they step.
    Collective, as a step is."""
    rank = strategy.ctx.rank
    at = BandAt(judge.band, step, replica) if judge.band is not None else None
    kinds = {n: type(m).__name__ for n, m in ref.model.named_modules() if n}

    mine, gradients, result, after = step_twice(steps.of_shard(ref.source, step, x, y, ref.seed), strategy, roots,
                                                optimizers)
    if routing is not None:  # every rank's shard is replayed by every rank's reference
        recording, routes = routing
        routes.add(strategy.ctx.comm.all_gather_objects(recording.take()))
    expected = reference_calls(ref, step, replica)
    if ref.run_scales is not None:  # fp16: the reference follows the run's overflow decision, as the check's does
        ref.run_scales[step] = (bool(result.skipped), strategy.ctx.loss_scale.state_dict())
    grads, ref_after = reference_step(ref, step)
    ref_loss = ref.losses[step][replica]
    params = [n for n, _ in ref.model.named_parameters()]

    def beyond(kind: str, dev: float | None, value, values, direction: int, order: int, name: str,
               tensor: str) -> Finding | None:
        """A finding where ``dev`` (this rank's deviation from the reference's ``value``) is beyond its limit;
        ``values()``: the band's references' values of the same quantity, asked for only beyond exact (no band
        admits an infinity or a NaN)."""
        if dev is None or dev <= judge.tol[kind]:
            return None
        limit = judge.limit(kind, value, values) if dev == dev and dev != float("inf") else judge.tol[kind]
        judge.worst = max(judge.worst, judge.ratio(dev, limit))
        if dev <= limit:
            return None
        return Finding(step + 1, direction, order, rank, name, kinds.get(name, "?"), tensor, dev,
                       judge.ratio(dev, limit))

    # 1. forward: the modules' outputs in the order the reference's calls return (a module called twice in a
    # forward, as a block's dropout is, at each of its calls: its second after what runs between), then the
    # loss, then buffers
    coords = dict(mesh.coords)
    sizes = {d: mesh.size(d) for d in ("tp", "cp") if d in coords}
    skip_experts = "ep" in coords and mesh.size("ep") > 1  # an expert's rows are the tokens routed to it
    cp = getattr(strategy, "cp", None)  # context parallelism: its split of this step (dealt for packed documents)
    cp_layout = getattr(cp, "layout", None)
    for order, (name, k) in enumerate(expected.sequence):
        if skip_experts and ".experts." in f".{name}.":
            continue
        ours, whole = mine.calls.get(name, []), expected.calls[name][k]
        dev = deviation(ours[k], whole, coords, sizes, cp_layout) if k < len(ours) else None
        found = beyond("outputs", dev, whole, lambda: [c.calls[name][k] for c in at.calls()
                                                        if k < len(c.calls.get(name, ()))], 0, order, name, "output")
        if found:
            return found
    if result.loss is not None:
        found = beyond("loss", abs(result.loss - ref_loss), ref_loss, lambda: at.losses(), 0,
                       len(expected.sequence), "the loss", "value")
        if found:
            found.kind = "as the rank reports it"
            return found
    for name, value in ref_after.items():  # what forward updates besides (BatchNorm's running statistics)
        if name not in params and value.is_floating_point():
            module, _, leaf = name.rpartition(".")
            found = beyond("weights", max_abs(after[name], value), value, lambda: [a[name] for _, a in at.stepped()], 0,
                           len(expected.sequence) + 1, module, f"{leaf} buffer")
            if found:
                return found
    # 2. backward: a parameter's gradient, in the reverse order of its use (a module's own parameters after its
    # children's: it began before them); a module whose weights its parent uses directly takes its parent's place
    place = {n: i for i, n in enumerate(expected.started)}

    def used(name: str) -> int:
        while name and name not in place:
            name = name.rpartition(".")[0]
        return place.get(name, -1)
    backward = sorted(params, key=lambda n: -used(n.rpartition(".")[0]))
    for order, name in enumerate(backward):
        if name not in grads:  # the reference did not step (fp16: its gradient overflowed)
            continue
        module, _, leaf = name.rpartition(".")
        found = beyond("weights", max_abs(gradients[name], grads[name]), grads[name],
                       lambda: [g[name] for g, _ in at.stepped() if name in g], 1, order, module,
                       f"{leaf} gradient")
        if found:
            return found
    # 3. the optimizer's step: the weights after it
    for order, name in enumerate(params):
        module, _, leaf = name.rpartition(".")
        found = beyond("weights", max_abs(after[name], ref_after[name]), ref_after[name],
                       lambda: [a[name] for _, a in at.stepped()], 2, order, module, leaf)
        if found:
            return found
    return None


def max_abs(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest |mine - theirs|, exactly, on the host (NaN where either has one)."""
    return max_abs_diff(mine.detach().cpu(), theirs.detach().cpu())
