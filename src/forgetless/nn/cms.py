"""Continuum Memory System (docs/DESIGN.md §2.4): the FFN as a chain of MLP levels updated at different
frequencies.

    h_0 = x;   y_l = MLP_l(norm_l(h_{l-1}));   h_l = h_{l-1} + y_l;   CMS(x) = y_1 + ... + y_L

Level l's parameters change only every C_l steps (its `update_period`), by what that chunk gathered
(`ChunkedUpdates`: the loop hooks that a CMS module hands the training loop, see `CMS.training_hooks`). Fast levels take new data first; slow levels
consolidate. With one level of period 1 and the dense width, CMS is exactly the dense FFN (same module
names c_fc / c_proj, same initialisation order). By default the levels split the dense FFN's hidden
width, so a CMS base has the dense base's parameter count.

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.hooks import StepHooks
from forgetless.models.gpt import GPTConfig, register_ffn
from forgetless.side import LoopHooks

ACCUMULATE = ("grads", "updates")


@dataclass
class CMSConfig:
    periods: list[int] = field(default_factory=lambda: [1, 4, 32, 128], metadata={
        "help": "update period C_l of each level, fastest first"})
    level_hidden: int = field(default=0, metadata={
        "help": "hidden width of each level (0: ffn_mult * d_model / levels, the dense FFN's parameters)"})
    accumulate: str = field(default="grads", metadata={
        "help": "grads: one optimizer step per chunk on its summed gradients; updates: the sum of the "
                "optimizer's per-step updates, applied at the chunk's end"})
    level_norm: bool = field(default=True, metadata={"help": "LayerNorm before every level after the first"})

    def __post_init__(self):
        if not self.periods or any(c <= 0 for c in self.periods):
            raise ForgetlessError(f"cms.periods must be positive integers, e.g. 1,4,32,128; got {self.periods}")
        if self.level_hidden < 0:
            raise ForgetlessError(f"cms.level_hidden must not be negative, got {self.level_hidden}")
        if self.accumulate not in ACCUMULATE:
            raise ForgetlessError(f"cms.accumulate must be one of {', '.join(ACCUMULATE)}, got {self.accumulate!r}")


class Level(nn.Module):
    """One level: d -> hidden -> d with GELU (as the dense FFN), optionally pre-normed."""

    def __init__(self, d: int, hidden: int, period: int, accumulate: str, norm: bool, bias: bool):
        super().__init__()
        self.update_period, self.accumulate = period, accumulate
        self.ln = nn.LayerNorm(d, bias=bias) if norm else None
        self.c_fc = nn.Linear(d, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, d, bias=bias)

    def forward(self, h):  # (B, T, d)
        return self.c_proj(F.gelu(self.c_fc(self.ln(h) if self.ln is not None else h)))


class ChunkedUpdates(StepHooks):
    """Multi-frequency updates: a parameter of a module with `update_period` C > 1 changes only every
    C steps (and when training ends), by what the chunk gathered: with the module's `accumulate` =
    "grads", one optimizer step on the chunk's summed gradients; with "updates", the sum of the
    optimizer's per-step updates, each computed at the unchanged weights. Works with any optimizer."""

    def __init__(self, model: nn.Module, params: list[tuple[str, nn.Parameter]]):
        owner = {id(p): m for m in model.modules() if isinstance(m, Level) and m.update_period > 1 for p in m.parameters()}
        self.slow = [(name, p, owner[id(p)].update_period, owner[id(p)].accumulate)
                     for name, p in params if id(p) in owner]
        self.gathered = {name: torch.zeros_like(p) for name, p, _, _ in self.slow}
        self.before: dict[str, torch.Tensor] = {}

    def before_step(self, model, optimizer, step: int, last: bool):
        """After backward: hold back the gradients of levels between their boundaries (gathered in one fused add:
        a retrofit beside 30 MLPs has 540 such tensors)."""
        held = [(name, p.grad) for name, p, _, accumulate in self.slow if accumulate == "grads" and p.grad is not None]
        if held:
            torch._foreach_add_([self.gathered[name] for name, _ in held], [grad for _, grad in held])
        for name, p, period, accumulate in self.slow:
            if accumulate == "updates":
                self.before[name] = p.detach().clone()
                continue
            boundary = step % period == 0 or last
            p.grad = self.gathered[name] if boundary else None
            if boundary:
                self.gathered[name] = torch.zeros_like(p)

    def after_step(self, model, optimizer, step: int, last: bool):
        """After the optimizer step ("updates"): gather the step's update and undo it, except at a boundary."""
        with torch.no_grad():
            for name, p, period, accumulate in self.slow:
                if accumulate == "updates":
                    self.gathered[name] += p - self.before[name]
                    p.copy_(self.before[name])
                    if step % period == 0 or last:
                        p += self.gathered[name]
                        self.gathered[name].zero_()

    def hook_state(self) -> dict[str, torch.Tensor]:
        return dict(self.gathered)

    def load_hook_state(self, tensors: dict[str, torch.Tensor]):
        for name in self.gathered:
            if name in tensors:
                self.gathered[name] = tensors[name].clone()


class CMS(LoopHooks, nn.Module):
    """The chain of levels: `cms_ffn(cfg)` as a GPT's FFN, `CMS(d, hidden, opts, ...)` anywhere else
    (e.g. beside a pretrained model's MLP, with `zero_out=True` so it starts as a no-op)."""

    def __init__(self, d: int, hidden: int, opts: CMSConfig, dropout: float = 0.0, bias: bool = True,
                 zero_out: bool = False):
        super().__init__()
        self.cfg = opts
        self.levels = nn.ModuleList(
            Level(d, hidden, period, opts.accumulate, norm=opts.level_norm and i > 0, bias=bias)
            for i, period in enumerate(opts.periods))
        self.dropout = nn.Dropout(dropout)
        if zero_out:
            for level in self.levels:
                nn.init.zeros_(level.c_proj.weight)
                if level.c_proj.bias is not None:
                    nn.init.zeros_(level.c_proj.bias)

    @staticmethod
    def training_hooks(model: nn.Module, params) -> ChunkedUpdates | None:
        """Asked by the training loop (hooks.module_hooks): multi-frequency updates of the levels
        whose period is > 1 among the trained `params`, whoever trains them (CMS methods, `full`, ...)."""
        hooks = ChunkedUpdates(model, params)
        return hooks if hooks.slow else None

    def forward(self, x):  # (B, T, d)
        h, out = x, None
        for level in self.levels:
            y = level(h)
            out = y if out is None else out + y
            h = h + y
        return self.dropout(out)


@register_ffn("cms", options=CMSConfig)
def cms_ffn(cfg: GPTConfig) -> CMS:
    """CMS as the FFN of every block; `GPTConfig.ffn_options` holds its CMSConfig fields."""
    opts = from_dict(CMSConfig, cfg.ffn_options, "cms")
    hidden = opts.level_hidden or max(1, cfg.ffn_mult * cfg.d_model // len(opts.periods))
    return CMS(cfg.d_model, hidden, opts, cfg.dropout, cfg.bias)
