"""MoE-LoRA: a growing set of rank-r LoRA experts beside a linear layer, mixed by a learned router.

    g = softmax(W_r x / tau)                               (..., E)  one router row per expert
    y = W0 x + (alpha / r) * sum_e g_e B_e A_e x

The coarse-grained baseline of the MoRAM source: each task adds one expert (A Kaiming-uniform,
B zero, as in LoRA) and freezes the earlier experts; the router rows of all experts keep
training, so routing for old tasks can drift (the interference MoRAM's self-activation avoids).

Source: the MoE-LoRA baseline of Mixture of Rank-1 Memory (MoRAM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.nn.adapter import lora_pair


@dataclass
class MoELoRAConfig:
    r: int = field(default=8, metadata={"help": "rank of each task's expert"})
    alpha: float = field(default=16.0, metadata={"help": "scaling numerator (scale = alpha / r), as in LoRA"})
    router_tau: float = field(default=1.0, metadata={"help": "router softmax temperature"})

    def __post_init__(self):
        if self.r <= 0 or self.router_tau <= 0:
            raise ForgetlessError("moe-lora: r and router_tau must be positive")


class MoELoRALinear(nn.Module):
    """`base(x)` plus the router-weighted sum of the LoRA experts; `base` stays frozen."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int, cfg: MoELoRAConfig):
        super().__init__()
        self.base, self.cfg, self.d_in, self.d_out = base, cfg, d_in, d_out
        self.down = nn.ParameterList()    # per expert: (r, d_in)  A_e
        self.up = nn.ParameterList()      # per expert: (d_out, r) B_e
        self.router = nn.ParameterList()  # per expert: (1, d_in)  its row of W_r

    def add_task(self):
        """Freeze the experts so far and add one; every router row stays trainable."""
        for p in [*self.down, *self.up]:
            p.requires_grad_(False)
        down, up = lora_pair(self.cfg.r, self.d_in, self.d_out, next(self.base.parameters()))
        self.down.append(down)
        self.up.append(up)
        self.router.append(nn.Parameter(torch.zeros(1, self.d_in, device=up.device, dtype=up.dtype)))

    def gates(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., E)
        return (x @ torch.cat(list(self.router)).T / self.cfg.router_tau).softmax(-1)

    def forward(self, x):  # (..., d_in)
        out = self.base(x)
        if not len(self.down):
            return out
        h = x @ torch.cat(list(self.down)).T                          # (..., E*r)
        g = self.gates(x).repeat_interleave(self.cfg.r, dim=-1)       # (..., E*r)
        up = torch.cat(list(self.up), dim=1)                           # (d_out, E*r)
        return out + (self.cfg.alpha / self.cfg.r) * (h * g) @ up.T    # (..., d_out)
