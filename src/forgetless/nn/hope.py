"""HOPE (docs/DESIGN.md §2.4): a Titans neural memory followed by the Continuum Memory System chain, as the FFN
slot of a block (FFN kind `hope`).

    m = Memory(x)                        read, then written chunk by chunk inside the forward (nn/titans.py)
    HOPE(x) = m + CMS(LN(x + m))          MLP levels updated every C_l steps (nn/cms.py)

By default the block's causal attention stays in front of the slot: attention is the exact short-term memory
over the context, the neural memory a compressed one written at test time, the CMS levels the persistent
knowledge at several update frequencies. With `attention=false` the block drops its attention and the memory is
its only mixer over the sequence, as in the source's HOPE block.

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from forgetless.config import from_dict
from forgetless.models.gpt import GPTConfig, register_ffn
from forgetless.nn.cms import CMS, CMSConfig
from forgetless.nn.titans import NeuralMemory, TitansConfig


@dataclass
class HopeConfig(TitansConfig, CMSConfig):
    """The memory's options (TitansConfig), the CMS chain's (CMSConfig), and whether the block keeps attention."""
    attention: bool = field(default=True, metadata={
        "help": "keep the block's causal attention before the slot; false: the memory is the block's only mixer "
                "over the sequence (the source's HOPE block)"})


class HOPE(nn.Module):
    """Memory then CMS chain: (B, T, d) -> (B, T, d). `zero_out=True` starts it as a no-op (beside an MLP)."""

    def __init__(self, d: int, hidden: int, opts: HopeConfig, dropout: float = 0.0, bias: bool = True,
                 zero_out: bool = False):
        super().__init__()
        self.memory = NeuralMemory(d, opts, bias)
        self.ln_cms = nn.LayerNorm(d, bias=bias)
        self.cms = CMS(d, hidden, opts, dropout, bias, zero_out)
        self.dropout = nn.Dropout(dropout)
        self.replaces_attention = not opts.attention  # read by models.gpt.Block
        if zero_out:
            nn.init.zeros_(self.memory.c_proj.weight)
            if self.memory.c_proj.bias is not None:
                nn.init.zeros_(self.memory.c_proj.bias)

    def forward(self, x):  # (B, T, d)
        m = self.dropout(self.memory(x))
        return m + self.cms(self.ln_cms(x + m))


@register_ffn("hope", options=HopeConfig)
def hope_ffn(cfg: GPTConfig) -> HOPE:
    """HOPE as the FFN slot of every block; `GPTConfig.ffn_options` holds its HopeConfig fields. The CMS levels
    split the dense FFN's hidden width as in a CMS base; the memory comes on top (about 4 d^2 per block)."""
    opts = from_dict(HopeConfig, cfg.ffn_options, "hope")
    hidden = opts.level_hidden or max(1, cfg.ffn_mult * cfg.d_model // len(opts.periods))
    return HOPE(cfg.d_model, hidden, opts, cfg.dropout, cfg.bias)
