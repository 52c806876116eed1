"""Bottleneck adapter placed beside a sub-layer: out = sublayer(x) + up(act(down(x))).

Source: Houlsby et al., Parameter-Efficient Transfer Learning for NLP (ICML 2019).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BottleneckAdapter(nn.Module):
    """d -> bottleneck -> d with GELU; `up` starts at zero so attaching changes nothing."""

    def __init__(self, d: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(d, bottleneck)
        self.up = nn.Linear(bottleneck, d)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):  # (B, T, d)
        return self.up(F.gelu(self.down(x)))


class Beside(nn.Module):
    """Run `adapter` in parallel with the wrapped `base` module and add the outputs."""

    def __init__(self, base: nn.Module, adapter: nn.Module):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x, *args, **kwargs):  # (B, T, d)
        out = self.base(x, *args, **kwargs)
        return out + self.adapter(x)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(d_in, d_out) of an nn.Linear or a transformers Conv1D (GPT-2; weight is (in, out)), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":
        return module.weight.shape[0], module.weight.shape[1]
    return None


def lora_pair(r: int, d_in: int, d_out: int, like: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """A new LoRA's (A (r, d_in) Kaiming-uniform, B (d_out, r) zero), on `like`'s device and dtype."""
    down = torch.empty(r, d_in, device=like.device, dtype=like.dtype)
    nn.init.kaiming_uniform_(down, a=math.sqrt(5))
    return nn.Parameter(down), nn.Parameter(torch.zeros(d_out, r, device=like.device, dtype=like.dtype))


def width_for(params_of, budget: float, least: int = 1) -> int:
    """The width n whose module has about `budget` parameters, for modules whose parameter count is
    linear in n: `params_of(n)` counts them (built at n = 1 and 2 only)."""
    one, two = params_of(1), params_of(2)
    return max(least, round((budget - (2 * one - two)) / (two - one)))


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def input_width(module: nn.Module) -> int:
    """Width d of the input of an FFN-like module (first Linear or HF Conv1D inside it)."""
    for m in module.modules():
        if shape := linear_shape(m):
            return shape[0]
    raise ValueError(f"cannot tell the input width of {type(module).__name__}")
