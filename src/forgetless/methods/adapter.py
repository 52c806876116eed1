"""Vanilla bottleneck adapter beside every FFN; only the adapters train."""
from __future__ import annotations

from dataclasses import dataclass, field

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_modules, register_method, replace_module
from forgetless.nn.adapter import Beside, BottleneckAdapter, input_width


@dataclass
class AdapterConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=lambda: ["mlp"], metadata={
        "help": "modules to put an adapter beside (GPT-2 naming: mlp)"})
    bottleneck: int = field(default=64, metadata={"help": "adapter hidden width"})
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})

    def __post_init__(self):
        super().__post_init__()
        if self.bottleneck <= 0:
            raise ForgetlessError(f"methods.adapter.bottleneck must be positive, got {self.bottleneck}")


@register_method("adapter")
class Adapter(Method):
    Config = AdapterConfig

    def attach(self, model):
        for name, module in find_modules(model, self.cfg.target_modules, self.cfg.exclude_modules):
            replace_module(model, name, Beside(module, BottleneckAdapter(input_width(module), self.cfg.bottleneck)))
        return model

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if ".adapter." in n]
