"""A small GPT (nanoGPT-style) over bytes or chars, with a pluggable FFN slot.

Module names follow GPT-2 (`transformer.h.0.attn.c_attn`, `transformer.h.0.mlp.c_fc`, ...)
so the same `target_modules` rules work on this model and on Hugging Face GPT-2.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.side import Recorded


@dataclass
class GPTConfig:
    vocab_size: int = field(default=256, metadata={"help": "vocabulary size (256 for bytes; set from the tokenizer)"})
    block_size: int = field(default=128, metadata={"help": "context length in tokens"})
    n_layer: int = field(default=4, metadata={"help": "number of Transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads per block"})
    d_model: int = field(default=128, metadata={"help": "width of the residual stream"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on attention, residual and embeddings"})
    bias: bool = field(default=True, metadata={"help": "biases in Linear and LayerNorm layers"})
    ffn: str = field(default="dense", metadata={"help": "FFN kind in every block (registered in models.gpt.FFN_KINDS)"})
    ffn_mult: int = field(default=4, metadata={"help": "hidden width of the dense FFN = ffn_mult * d_model"})
    ffn_options: dict = field(default_factory=dict, metadata={"help": "options passed to a non-dense FFN kind"})

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "ffn_mult"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ForgetlessError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ForgetlessError(f"model.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FFNKind:
    """A registered FFN: its constructor and the dataclass of its `ffn_options` (None: it takes none)."""
    build: Callable[[GPTConfig], nn.Module]
    options: type | None = None


FFN_KINDS: dict[str, FFNKind] = {}


def register_ffn(name: str, options: type | None = None):
    """Decorator: make an FFN class available as `GPTConfig.ffn = name`."""
    def wrap(cls):
        FFN_KINDS[name] = FFNKind(cls, options)
        return cls
    return wrap


def ffn_kind(name: str) -> FFNKind:
    import forgetless.nn  # noqa: F401  (registers the FFN kinds defined there)
    if name not in FFN_KINDS:
        raise ForgetlessError(f"unknown FFN kind {name!r}; valid: {', '.join(sorted(FFN_KINDS))}")
    return FFN_KINDS[name]


def build_ffn(cfg: GPTConfig) -> nn.Module:
    return ffn_kind(cfg.ffn).build(cfg)


def ffn_signature(cfg: GPTConfig) -> dict:
    """The FFN kind and its options with every default filled in, to compare two configs."""
    options_cls = ffn_kind(cfg.ffn).options
    options = asdict(from_dict(options_cls, cfg.ffn_options, cfg.ffn)) if options_cls else dict(cfg.ffn_options)
    return {"ffn": cfg.ffn, "ffn_mult": cfg.ffn_mult, **options}



@register_ffn("dense")
class DenseFFN(nn.Module):
    """The standard Transformer FFN: d -> ffn_mult*d -> d with GELU."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.ffn_mult * cfg.d_model
        self.c_fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, d)
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d/h)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, d)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    """x + attn(ln_1 x), then x + mlp(ln_2 x). An FFN kind whose module sets `replaces_attention` (HOPE without
    attention) mixes over the sequence itself: the block then has no attention and no ln_1."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = build_ffn(cfg)
        if getattr(self.mlp, "replaces_attention", False):
            self.ln_1 = self.attn = None

    def forward(self, x):  # (B, T, d)
        if self.attn is not None:
            x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            wpe=nn.Embedding(cfg.block_size, cfg.d_model),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.d_model, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):  # (B, T) -> logits (B, T, vocab)
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ForgetlessError(f"sequence of {T} tokens exceeds the context length {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, d)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def logits_of(model: nn.Module, idx: torch.Tensor, keep: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, params: dict[str, torch.Tensor] | None = None,
              cache=None) -> torch.Tensor:
    """Logits (B, T, V) from our GPT or from a Hugging Face causal LM; with `keep` (P,) positions, only
    those (B, P, V), through the HF model's `logits_to_keep` (see `takes_logits_to_keep`); `mask` (B, T)
    is the HF model's attention_mask (our GPT is causal and takes none: pad it on the right); `params`
    (named as in the model) in place of the model's own (torch.func.functional_call); `cache`: a HF model's KV
    cache of tokens before `idx` (the mask then covers them too)."""
    kwargs = {} if keep is None else {"logits_to_keep": keep}
    if mask is not None and not isinstance(model, GPT):
        kwargs["attention_mask"] = mask
    if cache is not None:
        kwargs[cache_arg(model)] = cache
    out = model(idx, **kwargs) if params is None else functional_call(model, params, (idx,), kwargs)
    return out.logits if hasattr(out, "logits") else out


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (outermost) transformers model's forward computes logits at chosen positions only
    (`logits_to_keep`, transformers >= 4.50): the output head then skips every other position."""
    return forward_takes(model, "logits_to_keep")


def cache_arg(model: nn.Module) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` where it has it (transformers 5's
    newer releases; `past_key_values` there is deprecated, to be removed in 5.40), else `past_key_values`."""
    return "cache" if forward_takes(model, "cache") else "past_key_values"


def cache_of(out) -> object:
    """The KV cache a transformers forward returned (`cache`, or `past_key_values` before it was renamed)."""
    return out["cache"] if "cache" in out else out.past_key_values


def last_logits_only(model: nn.Module) -> dict:
    """{"logits_to_keep": 1} when the model's forward takes it (transformers >= 4.50): a prompt pass then
    skips the output head on every position but the last."""
    return {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}


def windowed(model: nn.Module) -> bool:
    """Whether some layer of a transformers model is not full attention: sliding-window or chunked attention (a KV
    cache there may drop keys, a custom mask would replace the window), linear attention or state-space layers."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None) or
                any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []))


def forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the forward of the outermost transformers model in `model` (a PEFT or forgetless wrapper's
    inner model too) has the parameter `name`."""
    transformers = sys.modules.get("transformers")  # not imported: no transformers model exists
    if transformers is None:
        return False
    lm = next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)
    return lm is not None and name in inspect.signature(lm.forward).parameters


@torch.no_grad()
def recorded_forward(model: nn.Module, modules: list[Recorded], windows: torch.Tensor):
    """Run `model` in eval mode on windows (W, T+1) with `record` on for `modules` (they keep
    what they saw, e.g. APN routing), then restore the training mode and the flags."""
    was_training, flags = model.training, [m.record for m in modules]
    model.eval()
    for m in modules:
        m.record = True
    logits_of(model, windows[:, :-1].to(next(model.parameters()).device))
    for m, flag in zip(modules, flags):
        m.record = flag
    model.train(was_training)
