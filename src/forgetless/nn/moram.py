"""MoRAM: a growing bank of rank-1 associative-memory atoms beside a linear layer (docs/DESIGN.md §2.2).

    z_i = a_i^T x,   s_i = z_i / ||z||_2                  self-activation of atom i, no router
    m_i = s_i if i in TopK(s, k) else -inf,   w = softmax(m / tau)
    eval only: w_i <- w_i * 1[s_i >= delta]              (no renormalisation)
    y = W0 x + sum_i w_i z_i b_i

Each task adds r atoms (keys Kaiming-uniform, values zero) and freezes the earlier ones; routing
runs over the union. (The source's text normalises by sum_j z_j^2; docs/DESIGN.md restores ||z||_2.)

Source: Mixture of Rank-1 Memory (MoRAM), the MoRAM poster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.nn.adapter import float_like
from forgetless.side import Recorded


@dataclass
class MoRAMConfig:
    atoms_per_task: int = field(default=8, metadata={"help": "r, atoms added for every new task"})
    top_k: int = field(default=8, metadata={"help": "k, atoms kept per input (0 = all, no sparsity)"})
    tau: float = field(default=0.03, metadata={"help": "softmax temperature (1 = no temperature scaling)"})
    delta: float | None = field(default=0.2, metadata={
        "help": "evaluation threshold on s_i, atoms below it are dropped (none = no threshold)"})

    def __post_init__(self):
        if self.atoms_per_task <= 0 or self.top_k < 0 or self.tau <= 0:
            raise ForgetlessError("moram: atoms_per_task and tau must be positive, top_k >= 0 (0 = all atoms)")


class MoRAMLinear(Recorded, nn.Module):
    """`base(x)` plus the atoms' mixture; `base` is any layer mapping d_in -> d_out (kept frozen). With `record`
    on, `last_weights` keeps the mean w per atom of the last forward."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int, cfg: MoRAMConfig):
        super().__init__()
        self.base, self.cfg, self.d_in, self.d_out = base, cfg, d_in, d_out
        self.keys = nn.ParameterList()    # per task: (r, d_in) a_i
        self.values = nn.ParameterList()  # per task: (r, d_out) b_i
        self.last_weights: torch.Tensor | None = None  # (R,)

    def add_task(self):
        """Freeze every atom so far and add r fresh ones (keys Kaiming-uniform, values zero)."""
        for p in [*self.keys, *self.values]:
            p.requires_grad_(False)
        like = float_like(self.base)  # new atoms on the base layer's device and compute dtype
        keys = torch.empty(self.cfg.atoms_per_task, self.d_in, device=like.device, dtype=like.dtype)
        nn.init.kaiming_uniform_(keys, a=math.sqrt(5))
        self.keys.append(nn.Parameter(keys))
        self.values.append(nn.Parameter(torch.zeros(self.cfg.atoms_per_task, self.d_out, device=like.device,
                                                    dtype=like.dtype)))

    @property
    def n_atoms(self) -> int:
        return sum(k.shape[0] for k in self.keys)

    def weights(self, z: torch.Tensor) -> torch.Tensor:  # z: (..., R) -> w: (..., R)
        s = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        masked = s
        if 0 < self.cfg.top_k < z.shape[-1]:  # keep the k largest: mask what is below the k-th
            kth = s.topk(self.cfg.top_k, dim=-1).values[..., -1:]
            masked = s.masked_fill(s < kth, float("-inf"))
        w = F.softmax(masked / self.cfg.tau, dim=-1)
        if not self.training and self.cfg.delta is not None:
            w = w * (s >= self.cfg.delta)
        return w

    def atom_task(self) -> list[int]:
        """Index (1-based) of the task that added each atom, in routing order."""
        return [t for t, k in enumerate(self.keys, start=1) for _ in range(k.shape[0])]

    def forward(self, x):  # (..., d_in)
        out = self.base(x)
        if not len(self.keys):
            return out
        z = x @ torch.cat(list(self.keys)).T               # (..., R)
        w = self.weights(z)                                 # (..., R)
        if self.record:
            self.last_weights = w.detach().flatten(0, -2).mean(0)  # (R,)
        return out + (w * z) @ torch.cat(list(self.values))  # (..., d_out)
