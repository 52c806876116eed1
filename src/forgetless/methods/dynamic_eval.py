"""Dynamic evaluation: plain SGD on the text as it is read, decaying toward the original weights.

After every step, theta <- theta + decay * (theta_0 - theta), with theta_0 the weights at attach time,
so what one chunk teaches fades unless later chunks teach it again (*Dynamic Evaluation of Neural
Sequence Models*, Krause et al., 2018, without its RMS-normalised steps). The online protocol's
baseline (docs/DESIGN.md §3.5); named only, in no protocol's `--methods all`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless.errors import ForgetlessError
from forgetless.methods.base import ALL, Method, MethodConfig, copy_weights, register_method


@dataclass
class DynamicEvalConfig(MethodConfig):
    lr: float | None = field(default=3e-2, metadata={"help": "SGD learning rate (default 3e-2, not the protocol's)"})
    decay: float = field(default=0.02, metadata={
        "help": "after every step, move this fraction of the way back to the original weights (0: no decay)"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.decay <= 1.0:
            raise ForgetlessError(f"dynamic-eval decay must be in [0, 1], got {self.decay}")


@register_method("dynamic-eval")
class DynamicEval(Method):
    """Dynamic evaluation: SGD on every weight, decaying toward the original weights."""
    Config = DynamicEvalConfig
    order, trains, injects, takes_terms, copies = 110, ALL, False, False, 1  # it anchors itself (its decay to the origin)
    unshardable = ""
    start_copies = ("origin.",)  # copies of the weights at the task's start
    default_for = ()

    def attach(self, model):
        self.origin = copy_weights(model)  # theta_0
        return model

    def trainable_parameters(self, model):
        return list(model.named_parameters())

    def make_optimizer(self, params, cfg):
        return torch.optim.SGD([p for _, p in params], lr=cfg.lr)

    @torch.no_grad()
    def after_step(self, model, optimizer, step, last):
        if self.cfg.decay > 0:
            for name, p in model.named_parameters():
                p.lerp_(self.origin[name], self.cfg.decay)

    def hook_state(self):
        return {f"origin.{k}": v for k, v in self.origin.items()}

    def load_hook_state(self, tensors):
        for name, t in tensors.items():
            if name.startswith("origin."):
                self.origin[name[len("origin."):]].copy_(t)
