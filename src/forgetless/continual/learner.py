"""A method learning in small steps from text as it arrives: the online protocol's and `forgetless serve`'s
update (docs/DESIGN.md §3.5).

One optimizer and the method's loop hooks live for the whole stream (no schedule: a constant learning
rate); each `learn` call takes a few steps on one chunk's windows, with a share `mix` of rows from the
original domain when the method or the protocol asks for it.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from forgetless.adapted import attach
from forgetless.data.splits import Batch, Sampler
from forgetless.device import autocast, training_attention
from forgetless.errors import ForgetlessError
from forgetless.hooks import HookChain, module_hooks
from forgetless.methods import Method
from forgetless.optim import build_optimizer
from forgetless.train import TrainConfig, TrainingDiverged


class Learner:
    """`method` attached to `model` (in place) and its optimizer. `original` is what the model learned
    before (a Domain or (N, T+1) windows; EWC protects it); `mix_from` (N,) tokens of that domain feed
    the mixed rows."""

    def __init__(self, model: nn.Module, method: Method, cfg: TrainConfig, original=None,
                 mix_from: torch.Tensor | None = None, seed: int = 0, mix: float = 0.0):
        self.adapted = attach(model, method)
        self.adapted.start_task(1, original)
        self.model, self.method = self.adapted.model, method
        self.params = self.adapted.trainable_parameters()
        if not self.params:
            raise ForgetlessError(f"method {method.name} selected no parameters to learn; check its target_modules")
        self.cfg = method.training_config(cfg)
        self.hooks = HookChain([method, *module_hooks(self.model, self.params)])
        self.opt = self.hooks.make_optimizer(self.params, self.cfg) or \
            build_optimizer(self.cfg.optimizer, self.params, self.cfg, self.model)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr
        self.mix = method.own("mix", mix)
        if self.mix > 0 and mix_from is None:
            raise ForgetlessError(f"method {method.name} mixes in original-domain rows (mix={self.mix}) but none were "
                                  "given; pass mix_from tokens or set mix=0")
        self.mix_from, self.seed = mix_from, seed
        self.sampler = None
        self.steps = 0
        self.device = self.params[0][1].device
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.precision == "fp16")

    def batch(self, windows) -> Batch:
        """The chunk's windows (W, T+1) (or a Batch), plus round(mix * W) (at least one) rows of the original
        domain."""
        batch = Batch.of(windows).to(self.device)
        if self.mix <= 0:
            return batch
        n, T = max(1, round(self.mix * len(batch.x))), batch.x.shape[1]
        if self.sampler is None or (self.sampler.batch_size, self.sampler.block_size) != (n, T):
            self.sampler = Sampler(self.mix_from, n, T, self.seed)
        other = self.sampler.next().to(self.device)
        from_other = torch.cat([batch.from_other, torch.ones_like(other.from_other)])  # (W + n,)
        return Batch(torch.cat([batch.x, other.x]), torch.cat([batch.y, other.y]), from_other)

    def learn(self, windows, steps: int = 1) -> float:
        """`steps` updates on the windows (W, T+1) of one chunk (or a Batch); returns the last step's LM loss. A
        non-finite loss raises TrainingDiverged before any weight moves."""
        lm = float("nan")
        for _ in range(steps):
            self.model.train()
            batch = self.batch(windows)
            with autocast(self.device, self.cfg.precision), \
                    training_attention(self.model, self.device, self.cfg.precision, batch.x):
                loss, lm_loss = self.adapted.losses(batch)
            if not torch.isfinite(loss):
                raise TrainingDiverged(f"online update {self.steps + 1}: loss is {loss.item()}; lower the learning rate")
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in self.params], self.cfg.grad_clip)
            self.steps += 1
            self.hooks.before_step(self.model, self.opt, self.steps, False)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.hooks.after_step(self.model, self.opt, self.steps, False)
            lm = lm_loss.item()
        return lm


def chunk_windows(tokens: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N,) tokens -> (W, T+1) consecutive windows, each overlapping the next by one token (every token
    but the first is a target once); W = (N - 1) // T."""
    n = (len(tokens) - 1) // block_size
    if n < 1:
        raise ForgetlessError(f"a chunk of {len(tokens)} tokens holds no window of {block_size + 1}; "
                              f"give at least {block_size + 1} tokens")
    return tokens[:n * block_size + 1].unfold(0, block_size + 1, block_size)
