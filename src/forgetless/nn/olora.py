"""O-LoRA: one LoRA per task beside a linear layer, learned in a subspace orthogonal to the earlier
tasks' (docs/DESIGN.md §2.6).

    y = W0 x + (alpha / r) * sum_t B_t A_t x                  every task's LoRA, always on
    L_orth = sum_{s < t} ||A_s A_t^T||_F^2                    added to task t's loss (weight lambda)

Task t adds (A_t Kaiming-uniform, B_t zero) and freezes the earlier LoRAs, which stay in the sum
(not merged), so the orthogonality term can keep A_t's row space away from theirs.

Source: Wang et al., Orthogonal Subspace Learning for Language Model Continual Learning (EMNLP 2023 Findings).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from forgetless.distributed import gathered
from forgetless.errors import ForgetlessError
from forgetless.nn.adapter import float_like, lora_pair


@dataclass
class OLoRAConfig:
    r: int = field(default=8, metadata={"help": "rank of each task's LoRA"})
    alpha: float = field(default=16.0, metadata={"help": "scaling numerator (scale = alpha / r), as in LoRA"})

    def __post_init__(self):
        if self.r <= 0:
            raise ForgetlessError(f"the LoRA rank r must be positive, got {self.r}")


class OLoRALinear(nn.Module):
    """`base(x)` plus the sum of every task's LoRA; `base` stays frozen."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int, cfg: OLoRAConfig):
        super().__init__()
        self.base, self.cfg, self.d_in, self.d_out = base, cfg, d_in, d_out
        self.down = nn.ParameterList()  # per task: (r, d_in)  A_t
        self.up = nn.ParameterList()    # per task: (d_out, r) B_t

    def add_task(self):
        """Freeze the LoRAs so far and add task t's (A random, B zero: the output is unchanged)."""
        for p in [*self.down, *self.up]:
            p.requires_grad_(False)
        down, up = lora_pair(self.cfg.r, self.d_in, self.d_out, float_like(self.base))
        self.down.append(down)
        self.up.append(up)

    def orthogonality(self) -> torch.Tensor | None:
        """sum over earlier tasks s of ||A_s A_t^T||_F^2 for the newest task t (None on task 1)."""
        if len(self.down) < 2:
            return None
        new = self.down[-1]                                           # (r, d_in)
        old = torch.cat([gathered(a) for a in list(self.down)[:-1]])  # ((t-1) r, d_in); task 1's sharded by FSDP
        return (old @ new.T).square().sum()

    def forward(self, x):  # (..., d_in)
        out = self.base(x)
        h = x @ torch.cat(list(self.down)).T                          # (..., t r)
        return out + (self.cfg.alpha / self.cfg.r) * h @ torch.cat(list(self.up), dim=1).T  # (..., d_out)
