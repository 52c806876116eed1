"""Deep momentum (docs/DESIGN.md §2.4): the momentum memory gains an MLP, trained online on the gradients.

    m   <- alpha m + (1 - alpha) P g                  the linear memory of past gradients (EMA,
                                                      divided by 1 - alpha^t as in Adam)
    f    = [P g, m]                                   each coordinate's key, (n, 2)
    o    = m + MLP_phi(f)                             the memory's answer: the update direction
    W   <- W - lr (o + weight_decay W)

phi (one MLP 2 -> hidden -> 1 per tensor; its output layer starts at zero, so the optimizer starts as
momentum) learns by one step per iteration on the source's momentum objective, the dot product of
the memory's last answer with the gradient that followed it:

    loss(phi) = - mean_c o_{t-1,c}(phi) (P g_t)_c            did the last update point downhill?
    phi <- phi - inner_lr clip(grad loss, 1);  output layer *= decay   (forgetting, back to momentum)

so the memory learns which updates the following gradients agree with (a one-step hypergradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.optim.base import MemoryOptimizer

PHI = ("w1", "b1", "w2", "b2")


class DeepMomentum(MemoryOptimizer):
    name = "deep"

    def __init__(self, params, lr: float = 1e-3, alpha: float = 0.9, hidden: int = 16, inner_lr: float = 1e-2,
                 decay: float = 0.99, precondition: str = "adam", beta2: float = 0.95, eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if not (0 <= alpha < 1 and hidden > 0 and inner_lr >= 0 and 0 <= decay <= 1):
            raise ForgetlessError("deep: need alpha in [0, 1), hidden > 0, inner_lr >= 0 and decay in [0, 1]")
        super().__init__(params, dict(lr=lr, alpha=alpha, hidden=hidden, inner_lr=inner_lr, decay=decay,
                                      precondition=precondition, beta2=beta2, eps=eps, weight_decay=weight_decay))

    def direction(self, p, pg, group):
        state = self.state[p]
        if "momentum" not in state:
            self.init_memory(p, state, group["hidden"])
        pg_flat = pg.flatten()
        if state["keys"].numel():
            self.learn(state, pg_flat, group)
        state["momentum"].mul_(group["alpha"]).add_(pg, alpha=1 - group["alpha"])
        m = self.debiased(p, state["momentum"], group["alpha"])
        keys = torch.stack([pg_flat, m.flatten()], dim=1)                     # (n, 2)
        state["keys"] = keys
        return m + mlp([state[k] for k in PHI], keys).view_as(p)

    def init_memory(self, p, state, hidden: int):
        g = torch.Generator().manual_seed(p.numel() * 7919 + hidden)  # deterministic, leaves torch's RNG alone
        state["momentum"] = torch.zeros_like(p)
        state["keys"] = p.new_zeros(0, 2)
        state["w1"] = torch.randn(2, hidden, generator=g).to(p)
        state["b1"] = p.new_zeros(hidden)
        state["w2"] = p.new_zeros(hidden, 1)
        state["b2"] = p.new_zeros(1)

    def learn(self, state, target: torch.Tensor, group):
        """One step on -<o_{t-1}(phi), P g_t>: the memory's part of the last answer vs the new gradient."""
        with torch.enable_grad():
            phi = [state[k].detach().requires_grad_(True) for k in PHI]
            loss = -(mlp(phi, state["keys"]) * target).mean()
            grads = torch.autograd.grad(loss, phi)
        norm = torch.sqrt(sum(gr.square().sum() for gr in grads))
        scale = group["inner_lr"] / max(1.0, norm.item())
        for key, gr in zip(PHI, grads):
            state[key].sub_(gr, alpha=scale)
        state["w2"].mul_(group["decay"])
        state["b2"].mul_(group["decay"])


def mlp(phi: list[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = phi
    return (F.gelu(keys @ w1 + b1) @ w2 + b2).squeeze(-1)                   # (n,)
