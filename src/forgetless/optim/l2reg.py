"""The L2-regression update (docs/DESIGN.md §2.4) for linear layers, whose inputs x are recorded:

    W <- W (I - x x^T) - lr grad_y L x^T            (the source, one token, ||x|| = 1)

Backprop maps an input to its error by a dot-product objective; an L2 objective adds the erase term
W x x^T, which first removes what W currently answers to x. Over a batch, and scaled like decoupled
weight decay so the lr schedule applies to it:

    C  = mean over the batch's tokens of x_hat x_hat^T       (x_hat = x / ||x||; trace C = 1)
    W <- W - lr (d + erase W C)                              d = EMA momentum of P grad (debiased)

Call `watch(model)` to record the inputs of every nn.Linear whose weight it trains; other tensors
(biases, embeddings, norms) get `d` alone.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.optim.base import MemoryOptimizer


class L2Regression(MemoryOptimizer):
    name = "l2reg"

    def __init__(self, params, lr: float = 1e-3, erase: float = 1.0, momentum: float = 0.9,
                 precondition: str = "adam", beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0):
        if erase < 0 or not 0 <= momentum < 1:
            raise ForgetlessError(f"l2reg: erase must be >= 0 and momentum in [0, 1), got {erase}, {momentum}")
        super().__init__(params, dict(lr=lr, erase=erase, momentum=momentum, precondition=precondition,
                                      beta2=beta2, eps=eps, weight_decay=weight_decay))
        self.inputs: dict[nn.Parameter, torch.Tensor] = {}  # weight -> C of the last training forward
        self.handles = []

    def watch(self, model: nn.Module) -> "L2Regression":
        trained = {p for group in self.param_groups for p in group["params"]}
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight in trained:
                self.handles.append(module.register_forward_pre_hook(self.recorder(module.weight)))
        return self

    def recorder(self, weight: nn.Parameter):
        def record(module, args):
            if module.training and torch.is_grad_enabled():
                x = args[0].detach().reshape(-1, args[0].shape[-1])                       # (N, d_in)
                x_hat = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
                self.inputs[weight] = x_hat.T @ x_hat / len(x_hat)                        # (d_in, d_in)
        return record

    def direction(self, p, pg, group):
        m = self.state[p].setdefault("momentum", torch.zeros_like(p))
        m.mul_(group["momentum"]).add_(pg, alpha=1 - group["momentum"])
        m = self.debiased(p, m, group["momentum"])
        C = self.inputs.get(p)
        if C is None or not group["erase"]:
            return m
        return m + group["erase"] * (p @ C)
