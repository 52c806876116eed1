"""What the memory optimizers share: the preconditioner P, decoupled weight decay, the step."""
from __future__ import annotations

import torch

from forgetless.errors import ForgetlessError


class MemoryOptimizer(torch.optim.Optimizer):
    """W <- W - lr * (direction(P g) + weight_decay * W); subclasses write `direction`.

    P g = g / (sqrt(v_hat) + eps), with v the bias-corrected EMA of g^2 (Adam's second moment), or
    P = I with precondition="none". Parameters without a gradient are skipped (they do not move).
    """
    name = "memory"

    def __init__(self, params, defaults: dict):
        if defaults["lr"] <= 0:
            raise ForgetlessError(f"{self.name}: lr must be positive, got {defaults['lr']}")
        if defaults.get("precondition", "adam") not in ("adam", "none"):
            raise ForgetlessError(f"{self.name}: precondition must be adam or none, got {defaults['precondition']!r}")
        super().__init__(params, defaults)

    def preconditioned(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["v"] = torch.zeros_like(p)
        state["step"] += 1
        if group["precondition"] == "none":
            return grad
        beta2 = group["beta2"]
        state["v"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v_hat = state["v"] / (1 - beta2 ** state["step"].item())
        return grad / (v_hat.sqrt() + group["eps"])

    def direction(self, p: torch.Tensor, pg: torch.Tensor, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def debiased(self, p: torch.Tensor, m: torch.Tensor, beta: float) -> torch.Tensor:
        """An EMA started at zero, divided by 1 - beta^t as in Adam (so early steps are full-sized)."""
        return m / (1 - beta ** self.state[p]["step"].item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self.direction(p, self.preconditioned(p, p.grad, group), group)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss
