"""Perplexity and next-token accuracy on fixed held-out windows, and the modules' monitors there."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless import distributed
from forgetless.device import autocast
from forgetless.loss import training_loss  # noqa: F401 (its home before loss.py; benchmark scripts import it here)
from forgetless.models.gpt import logits_of, recorded_forward
from forgetless.side import Monitored


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 64, precision: str = "fp32") -> dict:
    """PPL = exp(mean token cross-entropy) over all tokens of `windows` (W, T+1); acc = top-1;
    `window_loss`: each window's mean cross-entropy (W values, for intervals over windows); the forward
    under `precision`'s autocast (the training's), the loss in float32.
    Under torchrun each rank scores its slice of the windows and the sums are added up; every rank runs
    the same number of forward passes (an FSDP forward gathers weights from all ranks): a rank whose
    slice ran out scores the first window again and counts nothing."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ranks = distributed.world_size()
    slices = windows.tensor_split(ranks)
    mine, offset = slices[distributed.rank()], sum(len(s) for s in slices[:distributed.rank()])
    total_loss, total_correct, n = 0.0, 0, 0
    window_loss = [0.0] * len(windows)  # this rank's windows filled in; the sum over ranks fills all
    for i in range(0, -(-len(windows) // ranks), batch_size):  # over the largest slice
        chunk = mine[i:i + batch_size] if i < len(mine) else windows[:1]
        x, y = chunk[:, :-1].to(device), chunk[:, 1:].to(device)  # (b, T)
        with autocast(device, precision):
            logits = logits_of(model, x).float()  # (b, T, V)
        if i >= len(mine):
            continue
        per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)  # (b, T)
        window_loss[offset + i:offset + i + len(chunk)] = per_token.mean(1).tolist()
        total_loss += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()  # as published
        total_correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train(was_training)
    total_loss, total_correct, n, *window_loss = distributed.total([total_loss, total_correct, n, *window_loss], device)
    loss = total_loss / n
    return {"loss": loss, "ppl": math.exp(loss), "acc": total_correct / n, "window_loss": window_loss}


def module_stats(model: nn.Module, windows: torch.Tensor, max_windows: int = 16) -> dict:
    """Mean over the Monitored modules of `m.stats()` (e.g. APN routing monitors) on a few held-out windows."""
    modules = [m for m in model.modules() if isinstance(m, Monitored)]
    if not modules:
        return {}
    recorded_forward(model, modules, windows[:max_windows])
    per_module = [m.stats() for m in modules]
    return {key: sum(s[key] for s in per_module) / len(per_module) for key in per_module[0]}

