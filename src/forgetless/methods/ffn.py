"""FFN-only fine-tuning: the FFN weights train; attention, embeddings and norms stay frozen."""
from __future__ import annotations

from dataclasses import dataclass, field

from forgetless.methods.base import WEIGHTS, Method, MethodConfig, find_ffns, register_method


@dataclass
class FFNConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "FFN modules whose weights train (empty: every "
                "decoder layer's MLP, found from the model's structure)"})


@register_method("ffn")
class FFNOnly(Method):
    """Fine-tune only the FFN weights; attention, embeddings and norms stay frozen."""
    Config = FFNConfig
    order, trains, injects, unshardable = 20, WEIGHTS, False, ""

    def trainable_parameters(self, model):
        out = []
        for name, module in find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules):
            out += [(f"{name}.{n}", p) for n, p in module.named_parameters()]
        return out
