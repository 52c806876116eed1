"""Perplexity and next-token accuracy on fixed held-out windows, and the LM training loss."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless import distributed
from forgetless.data.splits import Batch
from forgetless.models.gpt import aux_loss, logits_of, recorded_forward, takes_logits_to_keep
from forgetless.train import autocast


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 64, precision: str = "fp32") -> dict:
    """PPL = exp(mean token cross-entropy) over all tokens of `windows` (W, T+1); acc = top-1; the forward
    under `precision`'s autocast (the training's), the loss in float32.
    Under torchrun each rank scores its slice of the windows and the sums are added up; every rank runs
    the same number of forward passes (an FSDP forward gathers weights from all ranks): a rank whose
    slice ran out scores the first window again and counts nothing."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ranks = distributed.world_size()
    mine = windows.tensor_split(ranks)[distributed.rank()]
    total_loss, total_correct, n = 0.0, 0, 0
    for i in range(0, -(-len(windows) // ranks), batch_size):  # over the largest slice
        chunk = mine[i:i + batch_size] if i < len(mine) else windows[:1]
        x, y = chunk[:, :-1].to(device), chunk[:, 1:].to(device)  # (b, T)
        with autocast(device, precision):
            logits = logits_of(model, x).float()  # (b, T, V)
        if i >= len(mine):
            continue
        total_loss += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        total_correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train(was_training)
    total_loss, total_correct, n = distributed.total([total_loss, total_correct, n], device)
    loss = total_loss / n
    return {"loss": loss, "ppl": math.exp(loss), "acc": total_correct / n}


def module_stats(model: nn.Module, windows: torch.Tensor, max_windows: int = 16) -> dict:
    """Mean over modules of `m.stats()` (e.g. APN routing monitors) on a few held-out windows."""
    modules = [m for m in model.modules() if hasattr(m, "stats") and hasattr(m, "record")]
    if not modules:
        return {}
    recorded_forward(model, modules, windows[:max_windows])
    per_module = [m.stats() for m in modules]
    return {key: sum(s[key] for s in per_module) / len(per_module) for key in per_module[0]}


def training_loss(model: nn.Module, batch: Batch, extra=None, token_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss + modules' auxiliary losses + `extra(model, batch)`, LM loss alone).

    Targets of -100 are not scored (e.g. prompt tokens of instruction data): on a transformers model
    the output head then runs only at positions some row scores (a third less time per step on
    SmolLM2 with answers-only loss). `token_weights(logits, batch)` may return (B, T) weights for the
    LM loss (None: plain mean); with it, every position's logits are computed.
    """
    whole, scored = batch, batch.y != -100                                           # (B, T)
    keep = None
    if token_weights is None and not scored.all() and takes_logits_to_keep(model):
        keep = scored.any(0).nonzero().flatten()  # (P,) positions some row scores: the head skips the rest
        batch = Batch(batch.x, batch.y[:, keep], batch.from_other, batch.mask)
    logits = logits_of(model, batch.x, keep, batch.mask)                             # (B, T or P, V)
    return loss_terms(model, logits, batch.y, whole, extra, token_weights)


def loss_terms(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, batch: Batch, extra=None,
               token_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss of `logits` (B, P, V) against `targets` (B, P) + the modules' auxiliary losses left by the
    forward that made them + `extra(model, batch)`, LM loss alone); the method sees every position of `batch`."""
    scored = targets != -100                                                         # (B, P)
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(targets)
    lm = per_token.mean() if scored.all() else per_token.sum() / scored.sum().clamp_min(1)
    weights = token_weights(logits, batch) if token_weights else None
    if weights is not None:
        weights = weights * scored
    loss = lm if weights is None else (per_token * weights).sum() / weights.sum().clamp_min(1.0)
    parts = [aux_loss(model), extra(model, batch) if extra else None]
    parts = [p for p in parts if p is not None]
    return (loss + sum(parts) if parts else loss), lm
