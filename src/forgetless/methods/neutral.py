"""Neutral Residues (docs/DESIGN.md §2.3): gated GLU adapters beside the FFNs of a frozen base,
trained on batches that mix a fraction `mix` (default 0.1) of original-domain rows, with
loss = LM + alpha * mean over adapters of ||g(x) Adapter(x)||_1 / d on those rows only.

Ablations as arms (the source's): `neutral[gate=none]` (no gate + l1), `neutral[gate=sigmoid]`
(sigmoid gate trained as an original-vs-new classifier instead of the l1 term),
`neutral[gate=none;alpha=0]` (vanilla GLU adapter), and the mixing sweep `neutral[mix=0.5]`.

Source: Neutral Residues: Revisiting Adapters for Model Extension (ICML 2025, arXiv 2410.02744).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_ffns, put_beside, register_method
from forgetless.models.gpt import logits_of
from forgetless.nn.adapter import input_width
from forgetless.nn.neutral import GatedAdapter, NeutralConfig


@dataclass
class NeutralMethodConfig(MethodConfig, NeutralConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "modules to put a gated adapter beside (empty: every "
                "decoder layer's MLP, found from the model's structure)"})
    alpha: float = field(default=0.01, metadata={"help": "weight of the l1 term on original-domain rows"})
    domain_weight: float = field(default=1.0, metadata={"help": "gate=sigmoid: weight of the domain cross-entropy"})
    mix: float | None = field(default=0.1, metadata={"help": "fraction of every batch from the original domain"})
    lr: float | None = field(default=1e-3, metadata={"help": "learning rate (new zero-initialised weights)"})

    def __post_init__(self):
        super().__post_init__()
        if self.alpha < 0 or self.domain_weight < 0:
            raise ForgetlessError("neutral alpha and domain_weight must not be negative")


@register_method("neutral")
class Neutral(Method):
    """Gated GLU adapters beside the FFNs, kept silent on original data by an l1 term (base frozen)."""
    Config = NeutralMethodConfig
    order, unshardable = 80, ""
    pretrained_lr = 3e-4  # on SmolLM2 it learns at LoRA's pace there (docs/results/real-models.md, "Neutral
    # Residues at LoRA's pace on a pretrained model", chosen on validation windows); on the byte GPT its own 1e-3 does
    mixes_original = True  # the l1 term silences the adapters on the mixed rows: they must not be earlier tasks
    reads_retained = "the l1 term that keeps its adapters silent on old data"

    def attach(self, model):
        base_params = sum(p.numel() for p in model.parameters())
        targets = find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules)
        for name, module in targets:
            d = input_width(module)
            hidden = max(1, round(self.cfg.size * base_params / (len(targets) * 3 * d)))  # W_i, W_g, W_o
            put_beside(model, name, module, GatedAdapter(d, hidden, len(targets), self.cfg))
        return model

    def adapters(self, model) -> list[GatedAdapter]:
        return [m for m in model.modules() if isinstance(m, GatedAdapter)]

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if ".adapter." in n]

    def extra_loss(self, model, batch):
        adapters = self.adapters(model)
        if self.cfg.gate == "sigmoid":  # the gate as a classifier: 0 on original rows, 1 on new rows
            target = (~batch.from_other).float()[:, None].expand(batch.x.shape)       # (B, T)
            losses = [F.binary_cross_entropy_with_logits(a.last_logit.mean(-1), target) for a in adapters]
            return self.cfg.domain_weight * torch.stack(losses).mean()
        if self.cfg.alpha == 0 or not batch.from_other.any():
            return None
        rows = batch.from_other
        tokens = None if batch.mask is None else batch.mask[rows].to(adapters[0].last_out.dtype)  # (R, T): no padding
        l1 = [per_token_mean(a.last_out[rows].abs().sum(-1), tokens) / a.last_out.shape[-1] for a in adapters]
        return self.cfg.alpha * torch.stack(l1).mean()

    @torch.no_grad()
    def gates(self, model, windows: torch.Tensor) -> list[torch.Tensor]:
        """Per adapted layer, the gate of every token of `windows` (mean over channels for vector gates)."""
        was_training = model.training
        model.eval()
        logits_of(model, windows[:, :-1].to(next(model.parameters()).device))
        model.train(was_training)
        return [a.gate_values(a.last_logit).mean(-1).flatten() for a in self.adapters(model)]

    def report(self, model, windows_a, windows_b, max_windows: int = 32, bins: int = 40, top: float = 2.0):
        """Gate distributions on held-out original (A) and new (B) data, per layer (fixed bins on
        [0, top], larger gates counted in the last bin, so seeds average bin by bin)."""
        if self.cfg.gate == "none":
            return {}
        ga, gb = self.gates(model, windows_a[:max_windows]), self.gates(model, windows_b[:max_windows])
        hist = lambda g: (torch.histc(g.clamp(max=top), bins=bins, min=0.0, max=top) / len(g)).tolist()  # noqa: E731
        return {"gate_bins": torch.linspace(0, top, bins + 1).tolist(),
                "gate_hist_a": [hist(g) for g in ga], "gate_hist_b": [hist(g) for g in gb],
                "gate_mean_a": [g.mean().item() for g in ga], "gate_mean_b": [g.mean().item() for g in gb],
                "gate_closed_a": [(g == 0).float().mean().item() for g in ga],
                "gate_closed_b": [(g == 0).float().mean().item() for g in gb]}


def per_token_mean(values: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """Mean of `values` (R, T) over the positions where `tokens` (R, T) is 1 (all when None)."""
    return values.mean() if tokens is None else (values * tokens).sum() / tokens.sum().clamp_min(1)

