"""Delta-rule momentum (docs/DESIGN.md §2.4): momentum as an associative memory of gradients that, like
the delta rule, erases what it holds along the current gradient before writing the new one.

    g_hat = g / ||g||                                   (per tensor: "normalise for stability")
    m    <- alpha m - erase * g_hat (g_hat . m) + P g     = (alpha I - erase g_hat g_hat^T) m + P g
    W    <- W - lr (m + weight_decay W)

the source's m <- (alpha I - g g^T) m - eta P g with the gradient normalised (m here is -m / eta).
erase=0 is heavy-ball momentum on P g; with erase=1 the memory keeps (alpha - 1) of its old content
along the current gradient, so consistent directions no longer pile up there (about P g / (2 - alpha)
instead of P g / (1 - alpha)), while directions the gradient has left keep their momentum.
"""
from __future__ import annotations

from forgetless.errors import ForgetlessError
from forgetless.optim.base import MemoryOptimizer


class DeltaMomentum(MemoryOptimizer):
    name = "delta"

    def __init__(self, params, lr: float = 1e-3, alpha: float = 0.9, erase: float = 1.0, precondition: str = "adam",
                 beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0):
        if not (0 <= alpha < 1 and 0 <= erase <= 1):
            raise ForgetlessError(f"delta: alpha must be in [0, 1) and erase in [0, 1], got {alpha}, {erase}")
        super().__init__(params, dict(lr=lr, alpha=alpha, erase=erase, precondition=precondition, beta2=beta2,
                                      eps=eps, weight_decay=weight_decay))

    def direction(self, p, pg, group):
        state = self.state[p]
        m = state.setdefault("momentum", pg.new_zeros(pg.shape))
        g = p.grad.flatten()
        g_hat = g / g.norm().clamp_min(1e-12)
        held = g_hat @ m.flatten()                       # what the memory holds along the gradient
        m.mul_(group["alpha"]).sub_((g_hat * held).view_as(m), alpha=group["erase"])
        return m.add_(pg)
