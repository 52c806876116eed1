"""MoRAM (docs/DESIGN.md §2.2): rank-1 memory atoms beside the target linears, r new atoms per task.

Only the current task's atoms train; earlier atoms are frozen and keep routing (self-activation
over the union). The default lr is the source's 5e-4; the LoRA-style arms use 1e-3.
Ablations as in the source: `moram[top_k=0;tau=1;delta=none]` is plain self-activated retrieval;
add back top_k=8, tau=0.03 or delta=0.2 one at a time.

Source: Mixture of Rank-1 Memory (MoRAM), the MoRAM poster.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless.methods.bank import BankConfig, GrowingBank
from forgetless.methods.base import register_method
from forgetless.models.gpt import recorded_forward
from forgetless.nn.moram import MoRAMConfig, MoRAMLinear


@dataclass
class MoRAMMethodConfig(BankConfig, MoRAMConfig):
    lr: float | None = field(default=5e-4, metadata={"help": "learning rate (the source's LLM setting)"})


@register_method("moram")
class MoRAM(GrowingBank):
    """Rank-1 memory atoms beside the linears, r new atoms per task, self-activated retrieval."""
    Config = MoRAMMethodConfig
    order, prefix_once = 60, True
    module_cls = MoRAMLinear
    per_task = ("keys", "values")

    def task_report(self, model, windows, max_windows: int = 32):
        """Atom-activation map: mean evaluation mixture weight of every atom (averaged over the
        wrapped layers) on each task's held-out windows; `atom_task` says which task added it."""
        layers = [m for _, m in self.banks(model)]
        if not layers or not layers[0].n_atoms:
            return {}
        weights = []
        for w in windows:
            recorded_forward(model, layers, w[:max_windows])
            weights.append(torch.stack([m.last_weights for m in layers]).mean(0).tolist())  # (R,)
        return {"atom_task": layers[0].atom_task(), "atom_weights": weights}

