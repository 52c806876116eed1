"""Neutral Residues (docs/DESIGN.md §2.3): a gated GLU adapter beside each FFN.

    x'         = x / RMS(x)                               per token (normalize_input; else x' = x)
    Adapter(x) = W_o (act(W_g x') * W_i x')               GLU, hidden width h
    g(x)       = ReLU(w^T x' + c)                         scalar per token (vector: ReLU(W x' + c))
    out        = FFN(x) + g(x) * Adapter(x)

W_o starts at zero (attaching changes nothing); W_i, W_g and the gate weights start with
variance 1/(d L) instead of He's 2/d (L = number of adapted layers). Both variances assume
inputs of unit scale; the FFN inputs of pretrained models are often far smaller (RMS 0.1-0.4
in SmolLM2-135M), which leaves the gates nearly shut (mean 0.013) and the adapter slow to
learn, hence the per-token rescaling (parameter-free; off reproduces runs before it existed). Gate variants for the
source's ablations: `relu` (the method), `sigmoid` (trained as an original-vs-new classifier),
`none` (g = 1). The module keeps its last gated output and gate so the method can add the l1
term on original-distribution rows and report the gates.

Source: Neutral Residues: Revisiting Adapters for Model Extension (ICML 2025, arXiv 2410.02744).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.errors import ForgetlessError

GATES = ("relu", "sigmoid", "none")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass
class NeutralConfig:
    size: float = field(default=0.2, metadata={"help": "extra parameters as a fraction of the base model's"})
    gate: str = field(default="relu", metadata={"help": "relu (the method), sigmoid (domain classifier) or none"})
    vector_gate: bool = field(default=False, metadata={"help": "one gate per channel instead of one per token"})
    activation: str = field(default="silu", metadata={"help": "GLU activation: silu, gelu or relu"})
    low_variance_init: bool = field(default=True, metadata={"help": "W_i, W_g, gate ~ N(0, 1/(d L)); off: He, 2/d"})
    normalize_input: bool = field(default=True, metadata={
        "help": "adapter and gate read the FFN input rescaled to unit RMS per token, the scale their init "
                "assumes (off: the raw input, as before this option existed)", "if_absent": False})

    def __post_init__(self):
        if self.gate not in GATES:
            raise ForgetlessError(f"neutral gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        if self.activation not in ACTIVATIONS:
            raise ForgetlessError(f"neutral activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if not self.size > 0:
            raise ForgetlessError(f"neutral size must be positive, got {self.size}")


class GatedAdapter(nn.Module):
    """g(x) * W_o(act(W_g x) * W_i x), added beside an FFN by `Beside`."""

    def __init__(self, d: int, hidden: int, n_layers: int, cfg: NeutralConfig):
        super().__init__()
        self.cfg = cfg
        self.w_i = nn.Linear(d, hidden, bias=False)
        self.w_g = nn.Linear(d, hidden, bias=False)
        self.w_o = nn.Linear(hidden, d, bias=False)
        self.gate = nn.Linear(d, d if cfg.vector_gate else 1) if cfg.gate != "none" else None
        std = math.sqrt(1 / (d * n_layers) if cfg.low_variance_init else 2 / d)
        for w in (self.w_i.weight, self.w_g.weight, *([self.gate.weight] if self.gate else [])):
            nn.init.normal_(w, std=std)
        if self.gate is not None:
            nn.init.zeros_(self.gate.bias)
        nn.init.zeros_(self.w_o.weight)
        self.last_out: torch.Tensor | None = None    # (B, T, d) gated output of the last forward
        self.last_logit: torch.Tensor | None = None  # (B, T, 1 or d) gate pre-activation

    def gate_values(self, logit: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logit) if self.cfg.gate == "sigmoid" else F.relu(logit)

    def forward(self, x):  # (B, T, d)
        if self.cfg.normalize_input:
            x = F.rms_norm(x, x.shape[-1:], eps=1e-6)                              # (B, T, d) at unit RMS
        out = self.w_o(ACTIVATIONS[self.cfg.activation](self.w_g(x)) * self.w_i(x))  # (B, T, d)
        if self.gate is not None:
            self.last_logit = self.gate(x)                                          # (B, T, 1 or d)
            out = self.gate_values(self.last_logit) * out
        self.last_out = out
        return out
