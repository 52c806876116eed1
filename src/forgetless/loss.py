"""The LM training loss of a batch: the (token-weighted) cross-entropy, the modules' auxiliary losses and a
method's extra term."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.data.splits import Batch
from forgetless.models.gpt import logits_of, takes_logits_to_keep
from forgetless.side import aux_loss


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
