"""Continuum Memory System (DESIGN.md §2.4): the FFN as a chain of MLP levels updated at different
frequencies.

    h_0 = x;   y_l = MLP_l(norm_l(h_{l-1}));   h_l = h_{l-1} + y_l;   CMS(x) = y_1 + ... + y_L

Level l's parameters change only every C_l steps (its `update_period`), by what that chunk gathered;
the training loop does that (train.ChunkedUpdates). Fast levels take new data first; slow levels
consolidate. With one level of period 1 and the dense width, CMS is exactly the dense FFN (same module
names c_fc / c_proj, same initialisation order). By default the levels split the dense FFN's hidden
width, so a CMS base has the dense base's parameter count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
import torch.nn.functional as F

from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPTConfig, register_ffn

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


@register_ffn("cms")
class CMS(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = opts = from_dict(CMSConfig, cfg.ffn_options, "cms")
        hidden = opts.level_hidden or max(1, cfg.ffn_mult * cfg.d_model // len(opts.periods))
        self.levels = nn.ModuleList(
            Level(cfg.d_model, hidden, period, opts.accumulate, norm=opts.level_norm and i > 0, bias=cfg.bias)
            for i, period in enumerate(opts.periods))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, d)
        h, out = x, None
        for level in self.levels:
            y = level(h)
            out = y if out is None else out + y
            h = h + y
        return self.dropout(out)
