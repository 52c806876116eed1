"""The loop's hooks (docs/DESIGN.md §7.2, §7.4): what a method, or a module with its own update rule, adds to a
training loop around each optimizer step. Every loop runs them (train.train, continual.learner, hf_trainer's
callback); methods are StepHooks, so the loop depends on none of them."""
from __future__ import annotations

import torch
import torch.nn as nn

from forgetless.side import LoopHooks


class StepHooks:
    """What a method (or an FFN kind with its own update rule) may add to the loop; all optional.
    `step` counts finished optimizer steps (1 after the first); `last` is true on the final step."""

    def make_optimizer(self, params: list[tuple[str, nn.Parameter]], cfg) -> torch.optim.Optimizer | None:
        """The optimizer of `params` under `cfg` (a train.TrainConfig); None: the config's (AdamW by default)."""
        return None

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, last: bool):
        """After backward and clipping, before the optimizer step (e.g. mask or clip gradients)."""

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, last: bool):
        """After the optimizer step (e.g. project weights, allocate patches)."""

    def hook_state(self) -> dict[str, torch.Tensor]:
        """Tensors the hooks need for an exact resume."""
        return {}

    def load_hook_state(self, tensors: dict[str, torch.Tensor]):
        pass


class HookChain(StepHooks):
    """Several hooks run in order (before_step in order, after_step in reverse); the first that
    makes an optimizer makes it; their states are saved under "<i>." prefixes."""

    def __init__(self, hooks: list[StepHooks]):
        self.hooks = hooks

    def make_optimizer(self, params, cfg):
        return next((opt for h in self.hooks if (opt := h.make_optimizer(params, cfg)) is not None), None)

    def before_step(self, model, optimizer, step, last):
        for h in self.hooks:
            h.before_step(model, optimizer, step, last)

    def after_step(self, model, optimizer, step, last):
        for h in reversed(self.hooks):
            h.after_step(model, optimizer, step, last)

    def hook_state(self):
        return {f"{i}.{k}": v for i, h in enumerate(self.hooks) for k, v in h.hook_state().items()}

    def load_hook_state(self, tensors):
        for i, h in enumerate(self.hooks):
            h.load_hook_state({k[len(f"{i}."):]: v for k, v in tensors.items() if k.startswith(f"{i}.")})


def module_hooks(model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[StepHooks]:
    """Loop hooks that the LoopHooks modules of `model` ask for (`training_hooks(model, params)`, e.g. CMS levels
    updated every C steps), one per module class."""
    makers = {type(m): m.training_hooks for m in model.modules() if isinstance(m, LoopHooks)}
    return [h for make in makers.values() if (h := make(model, params)) is not None]
