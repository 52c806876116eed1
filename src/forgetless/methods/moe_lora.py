"""MoE-LoRA, the coarse-grained baseline of the MoRAM source: one rank-r LoRA expert per task
beside the target linears, mixed by a learned router whose rows all keep training."""
from __future__ import annotations

from dataclasses import dataclass, field

from forgetless.methods.bank import BankConfig, GrowingBank
from forgetless.methods.base import register_method
from forgetless.nn.moe_lora import MoELoRAConfig, MoELoRALinear


@dataclass
class MoELoRAMethodConfig(BankConfig, MoELoRAConfig):
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})


@register_method("moe-lora")
class MoELoRA(GrowingBank):
    """One rank-r LoRA expert per task beside the linears, mixed by a learned router."""
    Config = MoELoRAMethodConfig
    order = 61
    module_cls = MoELoRALinear
    per_task = ("down", "up")
    shared = ("router",)
