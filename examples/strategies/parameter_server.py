"""A parameter server, written as a whole ``Strategy``: rank 0 holds the optimizer and steps it.

Every rank trains on its shard of the batch. Rank 0 (the server) gathers every rank's gradients, weighted by
its samples, sums them into the mean, takes the optimizer step and broadcasts the new weights; the other
ranks (the workers) hold weights but no optimizer state. A ``Replicas`` cannot say that (its optimizer steps
on every rank), so the whole step is written here, with the rest of the contract: evaluation, the weights,
a checkpoint of each rank, and the state put together again offline (docs/own-strategy.md, "A whole
strategy").

    paralab train examples/strategies/parameter_server.py --workers 2 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --check
"""
import torch

from paralab.strategies.base import StepResult, Strategy, broadcast_buffers
from paralab.strategies.portable import Portable, optimizer_by_name, optimizer_for


class ParameterServer(Strategy):
    def __init__(self, ctx, model_fn, optim_fn):
        super().__init__(ctx, model_fn, optim_fn)
        self.model = model_fn().to(ctx.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.server = self.comm.rank == 0
        self.optimizer = optim_fn(self.params) if self.server else None
        with torch.no_grad():  # every rank starts from the server's weights and buffers
            for t in self.model.state_dict().values():
                self.comm.broadcast(t, src=0, name="start")

    def train_step(self, x, y):
        self.model.train()
        loss = self.forward_backward(self.model, x, y)  # this rank's shard: gradients in p.grad
        self.push_and_pull(len(y))
        return StepResult(loss, len(y))

    @torch.no_grad()
    def push_and_pull(self, samples: int):
        """Gradients (times this rank's samples) to the server, which steps; the weights back to every rank."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) * samples for g in grads] + [grads[0].new_tensor([samples])])
        gathered = [torch.empty_like(flat) for _ in range(self.comm.world)] if self.server else None
        self.comm.gather(flat, gathered, dst=0, name="push")
        weights = torch.cat([p.reshape(-1) for p in self.params])
        if self.server:
            total = sum(gathered)  # every rank's weighted gradients, summed in rank order
            mean = total[:-1] / total[-1]
            for p, g in zip(self.params, mean.split([p.numel() for p in self.params])):
                p.grad = g.view_as(p).clone()
            with self.rec.span("optimizer", "step"):
                self.ctx.update(self.optimizer)
            weights = torch.cat([p.reshape(-1) for p in self.params])
        self.comm.broadcast(weights, src=0, name="pull")
        for p, w in zip(self.params, weights.split([p.numel() for p in self.params])):
            p.copy_(w.view_as(p))
            p.grad = None
        broadcast_buffers(self.comm, self.model)  # BatchNorm's running statistics: the server's

    def predict(self, x):
        return self.eval_logits(self.model, x)

    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self):
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.server else None}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        if self.server:
            self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate(cls, states, model):
        return dict(states[0]["model"])  # every rank holds the server's weights

    @classmethod
    def portable(cls, states, model):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return Portable(dict(states[0]["model"]), optimizer_by_name(states[0]["optimizer"], names))

    def load_portable(self, portable):
        self.model.load_state_dict({k: portable.tensors[k] for k in self.model.state_dict()})
        if self.server:
            self.optimizer.load_state_dict(optimizer_for(self.optimizer, self.names, portable.optimizer))
