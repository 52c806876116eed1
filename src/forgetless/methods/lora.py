"""LoRA through the real `peft` package, injected into any nn.Module (our GPT or HF models).

In a task sequence, `lora` merges each task's adapter into the weights and starts a fresh one
for the next task; `seq-lora` keeps training one adapter through all tasks (the source's SeqLoRA).

Source: Hu et al., LoRA: Low-Rank Adaptation of Large Language Models (ICLR 2022).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless import distributed
from forgetless.errors import ForgetlessError
from forgetless.methods.base import (ALL_LINEAR, PEFT, Method, MethodConfig, default_linear_targets, find_modules,
                                     is_regex, quantized, register_method, replace_module)


@dataclass
class LoRAMethodConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "layers that get LoRA (empty: c_attn, c_proj, c_fc on the forgetless GPT, PEFT's default on a "
                "transformers model, e.g. q_proj, v_proj for Llama); all-linear for every linear"})
    r: int = field(default=8, metadata={"help": "LoRA rank"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / r)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})

    def __post_init__(self):
        super().__post_init__()
        if self.r <= 0:
            raise ForgetlessError(f"methods.lora.r must be positive, got {self.r}")


@register_method("lora")
class LoRA(Method):
    """LoRA via peft on the linears; in a sequence, merged after each task and started afresh."""
    Config = LoRAMethodConfig
    order, merges, export_form, unshardable, prefix_once = 30, True, PEFT, "", True

    def attach(self, model):
        from peft import LoraConfig, inject_adapter_in_model  # here: importing peft (and transformers) takes seconds
        rules = self.cfg.target_modules or default_linear_targets(model)
        found = find_modules(model, rules, self.cfg.exclude_modules)  # clear error if none match
        # peft reads a string as one regex and a list as name suffixes, as `matches` does
        target = [n for n, _ in found] if rules == [ALL_LINEAR] else rules[0] if is_regex(rules) else rules
        config = LoraConfig(r=self.cfg.r, lora_alpha=self.cfg.alpha, lora_dropout=self.cfg.dropout,
                            target_modules=target, exclude_modules=self.cfg.exclude_modules or None,
                            fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()))
        return inject_adapter_in_model(config, model)

    def on_task_start(self, model, task):
        if task > 1:
            if bits := quantized(model):
                raise ForgetlessError(f"lora merges each finished task into the base weights, which are {bits}-quantized "
                                      "here; use seq-lora (one adapter through all tasks, never merged) on a quantized base")
            merge_and_reset(model)

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if "lora_" in n]

    def state_dict(self, model, injected):
        """peft's adapter tensors; after a task was merged, the base weights it was merged into too."""
        from peft import get_peft_model_state_dict
        from peft.tuners.lora import LoraLayer
        merged = {f"{name}.base_layer.weight": m.get_base_layer().weight.detach() for name, m in model.named_modules()
                  if isinstance(m, LoraLayer) and getattr(m, "forgetless_merged", False)}
        return {**get_peft_model_state_dict(model), **merged}

    def load_state_dict(self, model, tensors):
        from peft import set_peft_model_state_dict
        merged = {k: v for k, v in tensors.items() if ".base_layer." in k}
        super().load_state_dict(model, merged)
        for name in merged:
            model.get_submodule(name.rsplit(".base_layer.", 1)[0]).forgetless_merged = True
        result = set_peft_model_state_dict(model, {k: v for k, v in tensors.items() if k not in merged})
        if result.unexpected_keys:
            raise ForgetlessError(f"LoRA state does not fit this model ({result.unexpected_keys[0]}, ...)")

    def merge(self, model):
        """peft's merge of every LoRA layer into its base layer, which then replaces it."""
        from peft.tuners.lora import LoraLayer
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]:
            module.merge()
            replace_module(model, name, module.get_base_layer())
        return model


@register_method("seq-lora")
class SeqLoRA(LoRA):
    """One LoRA (peft) trained through all tasks in order, never merged."""
    order = 62
    default_for = ("sequence",)  # on one task it is `lora`

    def on_task_start(self, model, task):
        pass


@torch.no_grad()
def merge_and_reset(model):
    """Add every LoRA layer's delta (peft's get_delta_weight) to its base weight; re-initialise
    the adapter (A random, B zero) so the model's function is unchanged and a new LoRA starts (under FSDP on
    whole tensors, as in one process)."""
    for module in model.modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            with distributed.whole(module):
                module.get_base_layer().weight += module.get_delta_weight("default")
                module.reset_lora_parameters("default", True)
            module.forgetless_merged = True
