"""CMS arms (DESIGN.md §2.4): a base whose FFNs are Continuum Memory System chains, pretrained with
their update periods, then adapted with every level still on its period.

    cms        every level trains on its own period (1, 4, 32, 128 steps): new data lands in the fast
               levels at once, the slow ones consolidate a whole chunk in one update
    cms-fast   only the fast levels (period <= 4) train; the slow levels keep what the base knew

Attention, embeddings and norms outside the chain stay frozen, as for `ffn` (the dense arm with the
same trainable set). `cms[periods=1,1,1,1]` is the same chain with one frequency: the control that
separates the multi-frequency updates from the change of architecture.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, register_method
from forgetless.models.gpt import GPTConfig
from forgetless.nn.cms import CMSConfig, Level


@dataclass
class CMSMethodConfig(MethodConfig, CMSConfig):
    max_period: int = field(default=0, metadata={"help": "train only levels whose period is <= this (0: every level)"})

    def __post_init__(self):
        super().__post_init__()
        if self.max_period < 0:
            raise ForgetlessError(f"cms max_period must not be negative, got {self.max_period}")


def levels(model) -> list[tuple[str, Level]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Level)]


@register_method("cms")
class CMSMethod(Method):
    """CMS base (FFN = MLP levels updated every 1, 4, 32, 128 steps); the levels adapt on their periods."""
    Config = CMSMethodConfig

    def base_config(self, model_cfg: GPTConfig) -> GPTConfig:
        options = {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(CMSConfig)}
        return dataclasses.replace(model_cfg, ffn="cms", ffn_options=options)

    def attach(self, model):
        if not levels(model):
            raise ForgetlessError(f"method {self.name} found no CMS level: it needs a CMS base (model.ffn = cms)")
        self.start = {name: p.detach().clone() for name, p in self.level_parameters(model, every=True)}
        return model

    def level_parameters(self, model, every: bool = False) -> list[tuple[str, torch.nn.Parameter]]:
        cap = self.cfg.max_period
        return [(f"{name}.{n}", p) for name, level in levels(model)
                if every or not cap or level.update_period <= cap for n, p in level.named_parameters()]

    def trainable_parameters(self, model):
        return self.level_parameters(model)

    def report(self, model, windows_a, windows_b):
        """How far each level moved since attach: ||theta - theta_0|| / ||theta_0|| per period (mean over layers)."""
        own = dict(self.level_parameters(model, every=True))
        change: dict[int, list[float]] = {}
        for name, level in levels(model):
            keys = [f"{name}.{n}" for n, _ in level.named_parameters()]
            delta = torch.cat([(own[k] - self.start[k]).flatten() for k in keys]).norm()
            size = torch.cat([self.start[k].flatten() for k in keys]).norm()
            change.setdefault(level.update_period, []).append((delta / size).item())
        periods = sorted(change)
        return {"level_periods": periods, "level_change": [sum(change[c]) / len(change[c]) for c in periods]}


@dataclass
class CMSFastConfig(CMSMethodConfig):
    max_period: int = field(default=4, metadata={"help": "train only levels whose period is <= this (0: every level)"})


@register_method("cms-fast")
class CMSFast(CMSMethod):
    """CMS base; only the fast levels (period <= 4) adapt, the slow levels stay as pretrained."""
    Config = CMSFastConfig
