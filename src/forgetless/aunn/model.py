"""The Absolute Unit NN: a deep residual MLP from an absolute index to the datum stored there.

    h_0 = W_in enc(i)                                    enc: binary or Fourier code of index i
    h_l = h_{l-1} + W2 GELU(W1 [LN(h_{l-1}); m_l])       m_l: `fast_units` constant inputs (optional)
    out = W_out LN(h_L)                                  256 logits over the byte at i (or one value)

The m_l are the source's "implicit memory units": parameters disconnected from the index, which
the trainer gives a higher learning rate so they can serve as fast weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.aunn.encoding import ENCODINGS, build_encoding
from forgetless.errors import ForgetlessError

OUTPUTS = {"bytes": 256, "value": 1}


@dataclass
class AUNNConfig:
    encoding: str = field(default="binary", metadata={"help": "index encoding: binary or fourier"})
    bits: int = field(default=38, metadata={"help": "binary: code width (indices < 2**bits); fourier: longest period 2**bits"})
    fourier_features: int = field(default=64, metadata={"help": "number of Fourier features (sin and cos halves)"})
    encoding_seed: int = field(default=0, metadata={"help": "seed of the random Fourier periods"})
    d_model: int = field(default=128, metadata={"help": "width of the residual stream"})
    n_layer: int = field(default=3, metadata={"help": "residual MLP blocks"})
    mlp_mult: int = field(default=4, metadata={"help": "hidden width of a block = mlp_mult * d_model"})
    fast_units: int = field(default=0, metadata={"help": "constant memory inputs per block, trained at a higher lr (0 = none)"})
    output: str = field(default="bytes", metadata={"help": "bytes (256-way softmax) or value (one number, squared error)"})

    def __post_init__(self):
        for name in ("d_model", "n_layer", "mlp_mult"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.fast_units < 0:
            raise ForgetlessError(f"model.fast_units must not be negative, got {self.fast_units}")
        if self.encoding not in ENCODINGS:
            raise ForgetlessError(f"unknown model.encoding {self.encoding!r}; valid: {', '.join(ENCODINGS)}")
        if not 1 <= self.bits <= 62:
            raise ForgetlessError(f"model.bits must be in [1, 62], got {self.bits}")
        if self.encoding == "fourier" and (self.fourier_features <= 0 or self.fourier_features % 2):
            raise ForgetlessError(f"model.fourier_features must be a positive even number, got {self.fourier_features}")
        if self.output not in OUTPUTS:
            raise ForgetlessError(f"unknown model.output {self.output!r}; valid: {', '.join(OUTPUTS)}")


# Size presets (`--size`): width and depth; everything else stays as configured.
SIZES = {"tiny": {"d_model": 64, "n_layer": 2}, "small": {"d_model": 128, "n_layer": 3},
         "base": {"d_model": 256, "n_layer": 4}, "large": {"d_model": 512, "n_layer": 8}}


class Block(nn.Module):
    def __init__(self, d: int, mult: int, fast_units: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.memory = nn.Parameter(torch.zeros(fast_units)) if fast_units else None
        self.fc1 = nn.Linear(d + fast_units, mult * d)
        self.fc2 = nn.Linear(mult * d, d)

    def forward(self, x):  # (B, d)
        h = self.ln(x)
        if self.memory is not None:
            h = torch.cat([h, self.memory.expand(len(h), -1)], dim=1)  # (B, d + fast_units)
        return x + self.fc2(F.gelu(self.fc1(h)))


class AUNN(nn.Module):
    def __init__(self, cfg: AUNNConfig):
        super().__init__()
        self.config = cfg
        self.encode = build_encoding(cfg.encoding, cfg.bits, cfg.fourier_features, cfg.encoding_seed)
        self.inp = nn.Linear(self.encode.dim, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.mlp_mult, cfg.fast_units) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, OUTPUTS[cfg.output])
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        for block in self.blocks:  # each block starts near the identity
            nn.init.normal_(block.fc2.weight, std=0.02 / cfg.n_layer ** 0.5)

    def forward(self, idx):  # (B,) int64 -> (B, 256) logits, or (B,) values
        x = self.inp(self.encode(idx))  # (B, d)
        for block in self.blocks:
            x = block(x)
        out = self.head(self.ln_f(x))
        return out.squeeze(1) if self.config.output == "value" else out

    def item_losses(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Loss of every pair, (B,): cross-entropy in nats (bytes) or squared error (value)."""
        out = self(idx)
        if self.config.output == "value":
            return F.mse_loss(out, target.float(), reduction="none")
        return F.cross_entropy(out, target, reduction="none")

    def fast_parameters(self) -> list[nn.Parameter]:
        return [b.memory for b in self.blocks if b.memory is not None]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def size_overrides(size: str) -> dict:
    """The model fields a size preset sets."""
    if size not in SIZES:
        raise ForgetlessError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    return dict(SIZES[size])


def count_params(cfg: AUNNConfig) -> int:
    """Parameters of AUNN(cfg), without building it."""
    e = cfg.bits if cfg.encoding == "binary" else cfg.fourier_features
    d, k, h = cfg.d_model, cfg.fast_units, cfg.mlp_mult * cfg.d_model
    block = 2 * d + k + (d + k + 1) * h + (h + 1) * d  # LayerNorm, memory, fc1, fc2
    return (e + 1) * d + cfg.n_layer * block + 2 * d + (d + 1) * OUTPUTS[cfg.output]


def match_width(cfg: AUNNConfig, target_params: int) -> AUNNConfig:
    """A copy of `cfg` whose d_model (a multiple of 8) brings its parameter count closest to `target_params`."""
    best = min(range(8, 4097, 8), key=lambda d: abs(count_params(replace(cfg, d_model=d)) - target_params))
    return replace(cfg, d_model=best)
