"""O-LoRA, the orthogonal-subspace baseline the MoRAM source compares against (docs/DESIGN.md §2.6):
one LoRA per task on the target linears, earlier LoRAs frozen and kept, and the new LoRA's A pushed
orthogonal to the earlier ones' by lambda * sum_{s<t} ||A_s A_t^T||_F^2.

Source: Wang et al., Orthogonal Subspace Learning for Language Model Continual Learning (EMNLP 2023 Findings).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless.errors import ForgetlessError
from forgetless.methods.bank import BankConfig, GrowingBank
from forgetless.methods.base import register_method, replace_module
from forgetless.nn.olora import OLoRAConfig, OLoRALinear


@dataclass
class OLoRAMethodConfig(BankConfig, OLoRAConfig):
    lam: float = field(default=0.5, metadata={"help": "weight lambda_1 of the orthogonality loss (the source's 0.5)"})
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})

    def __post_init__(self):
        super().__post_init__()
        if self.lam < 0:
            raise ForgetlessError(f"o-lora lam must not be negative, got {self.lam}")


@register_method("o-lora")
class OLoRA(GrowingBank):
    """One LoRA per task, kept and frozen after it; each new LoRA orthogonal to the earlier ones."""
    Config = OLoRAMethodConfig
    order, merges, prefix_once = 63, True, True
    module_cls = OLoRALinear
    per_task = ("down", "up")

    def merge(self, model):
        """The sum of linear LoRAs folds exactly into the base weights: W0 + (alpha / r) sum_t B_t A_t."""
        for name, bank in self.banks(model):
            delta = (bank.cfg.alpha / bank.cfg.r) * torch.cat(list(bank.up), dim=1) @ torch.cat(list(bank.down))
            weight = bank.base.weight                                    # (d_out, d_in); Conv1D: (d_in, d_out)
            with torch.no_grad():
                weight += delta if isinstance(bank.base, torch.nn.Linear) else delta.T
            replace_module(model, name, bank.base)
        return model

    def extra_loss(self, model, batch):
        terms = [t for _, bank in self.banks(model) if (t := bank.orthogonality()) is not None]
        return self.cfg.lam * torch.stack(terms).sum() if terms and self.cfg.lam else None
