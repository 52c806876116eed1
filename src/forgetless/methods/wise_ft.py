"""WiSE-FT: full fine-tuning, then the weights averaged with the task's starting weights.

    theta <- theta_start + weight * (theta - theta_start)      at the end of every task

`weight` 1 is plain full fine-tuning, 0 the starting model; the training curves show the model
before the average, the scores after the task (and what is saved) the averaged one.

Source: Wortsman et al., Robust fine-tuning of zero-shot models (CVPR 2022).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless.errors import ForgetlessError
from forgetless.methods.base import ALL, Method, MethodConfig, copy_weights, register_method


@dataclass
class WiseFTConfig(MethodConfig):
    weight: float = field(default=0.5, metadata={
        "help": "fraction of the task's weight change kept at its end (1: full fine-tuning, 0: no change)"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.weight <= 1.0:
            raise ForgetlessError(f"wise-ft: weight must be in [0, 1], got {self.weight}")


@register_method("wise-ft")
class WiseFT(Method):
    """Full fine-tuning whose task change is scaled by `weight` at the end of every task."""
    Config = WiseFTConfig
    order, trains, injects, copies, unshardable = 92, ALL, False, 1, ""
    start_copies = ("start.",)  # copies of the weights at the task's start
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were

    def __init__(self, cfg):
        super().__init__(cfg)
        self.start: dict[str, torch.Tensor] = {}

    def trainable_parameters(self, model):
        return list(model.named_parameters())

    def on_task_start(self, model, task):
        self.start = copy_weights(model)

    @torch.no_grad()
    def on_task_end(self, model, task):
        for name, p in model.named_parameters():
            if name in self.start:
                p.lerp_(self.start[name], 1.0 - self.cfg.weight)

    def hook_state(self):
        return {f"start.{n}": t for n, t in self.start.items()}

    def load_hook_state(self, tensors):
        self.start = {k[len("start."):]: v for k, v in tensors.items() if k.startswith("start.")}
