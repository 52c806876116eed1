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
from forgetless.nn.olora import OLoRAConfig, OLoRALinear


@dataclass
class MoELoRAConfig(OLoRAConfig):
    router_tau: float = field(default=1.0, metadata={"help": "router softmax temperature"})

    def __post_init__(self):
        super().__post_init__()
        if self.router_tau <= 0:
            raise ForgetlessError(f"moe-lora: router_tau must be positive, got {self.router_tau}")


class MoELoRALinear(OLoRALinear):
    """`base(x)` plus the router-weighted sum of the per-task LoRA experts; `base` stays frozen."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int, cfg: MoELoRAConfig):
        super().__init__(base, d_in, d_out, cfg)
        self.router = nn.ParameterList()  # per expert: (1, d_in)  its row of W_r

    def add_task(self):
        """Freeze the experts so far and add one; every router row stays trainable."""
        super().add_task()
        like = self.up[-1]
        self.router.append(nn.Parameter(torch.zeros(1, self.d_in, device=like.device, dtype=like.dtype)))

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
