"""Index encodings: an absolute position in the data list -> a dense input vector.

`binary`: the index's low `bits` bits as ±1 (the source's 38-bit code, enough for 256 GiB).
`fourier`: random Fourier features sin/cos(2π i / period) with periods log-uniform in
[2, 2**bits], drawn once from a seed and kept in the checkpoint; any index below 2**53 (exact
in float64) has a code.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from forgetless.errors import ForgetlessError


def check_indices(idx: torch.Tensor, bits: int, fix: str) -> torch.Tensor:
    if idx.dtype != torch.int64:
        raise ForgetlessError(f"indices must be int64, got {idx.dtype}")
    if idx.numel() and (idx.min() < 0 or idx.max() >= 2 ** bits):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        raise ForgetlessError(f"index {bad} is outside [0, 2**{bits}); {fix}")
    return idx


class BinaryEncoding(nn.Module):
    def __init__(self, bits: int):
        super().__init__()
        self.bits, self.dim = bits, bits
        self.register_buffer("powers", 2 ** torch.arange(bits, dtype=torch.int64), persistent=False)

    def forward(self, idx):  # (B,) int64 -> (B, bits)
        on = (check_indices(idx, self.bits, "raise --model-bits")[:, None] & self.powers) != 0
        return on.float() * 2 - 1


class FourierEncoding(nn.Module):
    def __init__(self, bits: int, features: int, seed: int):
        super().__init__()
        self.bits, self.dim = bits, features
        g = torch.Generator().manual_seed(seed)
        log_periods = torch.rand(features // 2, generator=g, dtype=torch.float64) * (bits - 1) + 1  # log2 in [1, bits)
        self.register_buffer("omega", 2 * math.pi / 2 ** log_periods)  # (F/2,) float64

    def forward(self, idx):  # (B,) int64 -> (B, features)
        idx = check_indices(idx, 53, "float64 holds no larger index exactly")
        angle = (idx.double()[:, None] * self.omega) % (2 * math.pi)  # (B, F/2)
        return torch.cat([angle.sin(), angle.cos()], dim=1).float()


ENCODINGS = ("binary", "fourier")


def build_encoding(kind: str, bits: int, features: int, seed: int) -> nn.Module:
    """The encoding of an AUNNConfig (which validates the arguments)."""
    return BinaryEncoding(bits) if kind == "binary" else FourierEncoding(bits, features, seed)
