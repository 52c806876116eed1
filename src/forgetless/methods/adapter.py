"""Vanilla bottleneck adapter beside every FFN; only the adapters train."""
from __future__ import annotations

from dataclasses import dataclass, field

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_ffns, put_beside, register_method
from forgetless.nn.adapter import BottleneckAdapter, input_width


@dataclass
class AdapterConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "modules to put an adapter beside (empty: every "
                "decoder layer's MLP, found from the model's structure)"})
    bottleneck: int = field(default=64, metadata={"help": "adapter hidden width"})
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})

    def __post_init__(self):
        super().__post_init__()
        if self.bottleneck <= 0:
            raise ForgetlessError(f"methods.adapter.bottleneck must be positive, got {self.bottleneck}")


@register_method("adapter")
class Adapter(Method):
    Config = AdapterConfig
    order, unshardable = 40, ""

    def attach(self, model):
        for name, module in find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules):
            put_beside(model, name, module, BottleneckAdapter(input_width(module), self.cfg.bottleneck))
        return model

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if ".adapter." in n]
