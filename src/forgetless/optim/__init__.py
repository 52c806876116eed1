"""Optimizers as associative memories (docs/DESIGN.md §2.4), and the registry the training loop builds from.

    adamw   torch.optim.AdamW: the reference
    muon    torch.optim.Muon (momentum with a Newton-Schulz output) on hidden matrices, AdamW on the rest
    delta   delta-rule momentum: the memory erases its answer to the current gradient before writing it
    deep    deep momentum: a small MLP memory on top of momentum, trained online on the gradients
    l2reg   the L2-regression update W <- W (I - x x^T) - lr grad for linear layers (inputs recorded)

`build_optimizer(name, params, cfg, model)` returns a torch.optim.Optimizer for the (name, parameter)
pairs; `cfg` is a TrainConfig (lr, weight_decay, optimizer_options). The memory optimizers (delta,
deep, l2reg) precondition the gradient like Adam (P = diag(1 / sqrt(v))) unless precondition="none",
so that one lr schedule serves every optimizer.

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.optim.deep import DeepMomentum
from forgetless.optim.delta import DeltaMomentum
from forgetless.optim.l2reg import L2Regression
from forgetless.optim.muon import Chained

Named = list[tuple[str, nn.Parameter]]
OPTIMIZERS: dict[str, Callable] = {}


def register_optimizer(name: str):
    def wrap(fn):
        OPTIMIZERS[name] = fn
        return fn
    return wrap


def param_groups(params: Named, weight_decay: float) -> list[dict]:
    """Decay matrices, not biases and norms (as nanoGPT)."""
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_options(cls, options: dict, name: str) -> dict:
    valid = [p for p in inspect.signature(cls).parameters if p not in ("params", "lr", "weight_decay")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ForgetlessError(f"unknown option {unknown[0]!r} of optimizer {name}; valid: {', '.join(valid)}")
    return options


@register_optimizer("adamw")
def adamw(params: Named, cfg, model=None, options=None):
    options = {"betas": (0.9, 0.95), **check_options(torch.optim.AdamW, options or {}, "adamw")}
    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), lr=cfg.lr, **options)


@register_optimizer("muon")
def muon(params: Named, cfg, model=None, options=None):
    """Muon on the 2-D weights of hidden layers; AdamW on embeddings (and the tied head), biases, norms.
    Muon's step is scaled to AdamW's update RMS (`match_rms_adamw`), so the same lr schedule applies."""
    if not hasattr(torch.optim, "Muon"):
        raise ForgetlessError(f"the muon optimizer needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}: "
                              "upgrade torch or choose another optimizer")
    embeddings = {id(p) for m in (model.modules() if model is not None else []) if isinstance(m, nn.Embedding)
                  for p in m.parameters()}
    hidden = [(n, p) for n, p in params if p.dim() == 2 and id(p) not in embeddings]
    rest = [(n, p) for n, p in params if p.dim() != 2 or id(p) in embeddings]
    options = {"adjust_lr_fn": "match_rms_adamw", **check_options(torch.optim.Muon, options or {}, "muon")}
    parts = [torch.optim.Muon([p for _, p in hidden], lr=cfg.lr, weight_decay=cfg.weight_decay, **options)] \
        if hidden else []
    if rest:
        parts.append(adamw(rest, cfg))
    return Chained(parts)


def memory_optimizer(cls):
    def build(params: Named, cfg, model=None, options=None):
        opt = cls(param_groups(params, cfg.weight_decay), lr=cfg.lr, **check_options(cls, options or {}, cls.name))
        if model is not None and hasattr(opt, "watch"):
            opt.watch(model)
        return opt
    return build


for _cls in (DeltaMomentum, DeepMomentum, L2Regression):
    register_optimizer(_cls.name)(memory_optimizer(_cls))


def build_optimizer(name: str, params: Named, cfg, model: nn.Module | None = None) -> torch.optim.Optimizer:
    """Optimizer `name` over `params` with cfg.lr, cfg.weight_decay and cfg.optimizer_options."""
    if name not in OPTIMIZERS:
        raise ForgetlessError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, cfg, model, dict(getattr(cfg, "optimizer_options", None) or {}))


__all__ = ["OPTIMIZERS", "DeltaMomentum", "DeepMomentum", "L2Regression", "Chained", "build_optimizer",
           "register_optimizer", "param_groups"]
