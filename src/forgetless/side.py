"""Declared module state (docs/DESIGN.md §7.2): what a module's forward leaves beside its output, and what it asks
of the training loop, has a declared place on a mixin class; the loss, the monitors and the loop find the
modules by that type, never by an attribute's name.

    AuxLoss    `aux_loss`: the term the last training forward adds to the loss (APN's routing regularizer);
               the training loss adds `aux_loss(model)`, the sum over the model's AuxLoss modules
    Recorded   `record`: on, the forward keeps what it saw (APN's routing, MoRAM's atom weights), in a field
               the class declares; models.gpt.recorded_forward turns it on for one pass
    Monitored  a Recorded module whose `stats()` sums its last recorded forward into numbers (APN's routing
               monitors), averaged over the modules into the curves (continual.evaluate.module_stats)
    LoopHooks  `training_hooks(model, params)`: the loop hooks a module asks for (CMS's chunked updates,
               hooks.module_hooks)
"""
from __future__ import annotations

import torch
import torch.nn as nn


class AuxLoss:
    """Mixin of an nn.Module whose training forward sets `aux_loss` (a scalar; None: no term)."""
    aux_loss: torch.Tensor | None = None


class Recorded:
    """Mixin of an nn.Module that keeps what its forward saw while `record` is on."""
    record: bool = False


class Monitored(Recorded):
    """A Recorded module with monitors of its last recorded forward."""

    def stats(self) -> dict[str, float]:
        raise NotImplementedError


class LoopHooks:
    """Mixin of an nn.Module that asks the training loop for hooks (a hooks.StepHooks, or None: none now)."""

    @staticmethod
    def training_hooks(model: nn.Module, params: list[tuple[str, nn.Parameter]]):
        raise NotImplementedError


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the auxiliary losses the last forward left on the model's AuxLoss modules (None: none)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, AuxLoss) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
