"""CMS arms (docs/DESIGN.md §2.4): a base whose FFNs are Continuum Memory System chains, pretrained with
their update periods, then adapted with every level still on its period.

    cms        every level trains on its own period (1, 4, 32, 128 steps): new data lands in the fast
               levels at once, the slow ones consolidate a whole chunk in one update
    cms-fast   only the fast levels (period <= 4) train; the slow levels keep what the base knew

Attention, embeddings and norms outside the chain stay frozen, as for `ffn` (the dense arm with the
same trainable set). `cms[periods=1,1,1,1]` is the same chain with one frequency: the control that
separates the multi-frequency updates from the change of architecture. The periods are kept by the
training loop through the CMS module's own hooks (nn/cms.py, `CMS.training_hooks`). On a transformers
model (no CMS base to pretrain) a CMS chain is attached beside every MLP, starting at zero.

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_ffns, put_beside, register_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.nn.adapter import input_width, n_params, width_for
from forgetless.nn.cms import CMS, CMSConfig, Level

ALIGN = 16  # retrofit widths are multiples of this (see aligned)


@dataclass
class CMSMethodConfig(MethodConfig, CMSConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "on models other than the forgetless GPT: the MLPs that get a CMS chain beside them (empty: every "
                "decoder layer's MLP, found from the model's structure)"})
    max_period: int = field(default=0, metadata={"help": "train only levels whose period is <= this (0: every level)"})
    retrofit_size: float = field(default=0.05, metadata={
        "help": "on transformers models: the chains' parameters as a fraction of the model's (sets the level "
                "width unless level_hidden is given)"})

    def __post_init__(self):
        super().__post_init__()
        if self.max_period < 0:
            raise ForgetlessError(f"cms max_period must not be negative, got {self.max_period}")
        if not self.retrofit_size > 0:
            raise ForgetlessError(f"cms retrofit_size must be positive, got {self.retrofit_size}")


def aligned(width: int, multiple: int = ALIGN) -> int:
    """A retrofit's width rounded to the nearest multiple of `multiple`, where matrix products run at full speed
    (beside SmolLM2, a CMS chain 576 -> 48 -> 576 ran in 0.76x the time of 576 -> 47 on an AVX2 CPU); widths
    below it (tiny models) are kept."""
    return multiple * round(width / multiple) if width >= multiple else width


def levels(model) -> list[tuple[str, Level]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Level)]


@register_method("cms")
class CMSMethod(Method):
    """CMS base (FFN = MLP levels updated every 1, 4, 32, 128 steps); the levels adapt on their periods."""
    Config = CMSMethodConfig
    order = 100
    unshardable = ("its levels keep their update periods through the CMS module's own training hooks, which "
                   "accumulate whole gradients")

    def base_config(self, model_cfg: GPTConfig) -> GPTConfig:
        options = {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(CMSConfig)}
        return dataclasses.replace(model_cfg, ffn="cms", ffn_options=options)

    def check_base(self, model):
        if isinstance(model, GPT):  # other models (transformers) get a CMS chain beside their MLPs
            super().check_base(model)

    def attach(self, model):
        if not isinstance(model, GPT):
            self.retrofit(model)
        if not levels(model):
            raise ForgetlessError(f"method {self.name} found no CMS level: it needs a CMS base (model.ffn = cms)")
        self.start = {name: p.detach().clone() for name, p in self.level_parameters(model, every=True)}
        return model

    def retrofit(self, model):
        """A CMS chain beside every target MLP, its output projections at zero (attaching changes nothing);
        the levels' hidden width is level_hidden, else sized so all the chains have about `retrofit_size` times
        the model's parameters (a chain as wide as the MLP would add 40 % to SmolLM2), `aligned`."""
        opts = CMSConfig(**{f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(CMSConfig)})
        targets = find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules)
        budget = self.cfg.retrofit_size * n_params(model) / max(1, len(targets))
        for name, mlp in targets:
            d = input_width(mlp)
            width = opts.level_hidden or aligned(width_for(lambda w: n_params(CMS(d, w, opts)), budget))
            put_beside(model, name, mlp, CMS(d, width, opts, zero_out=True))

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
    order = 101

