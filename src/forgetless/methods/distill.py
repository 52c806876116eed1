"""Distillation to the starting model on replayed rows: full fine-tuning on the new data mixed with
rows of the original domain (`mix`, default 0.1), plus a KL term that holds the model's next-token
distribution on those rows where it was when the task started.

    loss = LM loss + beta * KL(p_start(. | x) || p(. | x)),   averaged over the scored tokens of the mixed rows

The starting weights are kept as a second copy of the parameters (the model's memory twice) and run
through the model's own forward (`torch.func.functional_call`). In a task sequence the mixed rows are
the earlier tasks' (or the original domain's) and the teacher is the model at the task's start.

Sources: learning without forgetting (Li & Hoiem, 2016) distils on the new task's inputs; dark
experience replay (Buzzega et al., 2020) distils on replayed rows towards logits stored when they were
seen, close in spirit to this (here the targets come from the model at the task's start).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.func import functional_call

from forgetless.errors import ForgetlessError
from forgetless.methods.base import ALL, Method, MethodConfig, copy_weights, register_method
from forgetless.models.gpt import logits_of


@dataclass
class DistillConfig(MethodConfig):
    beta: float = field(default=1.0, metadata={"help": "weight of the KL term on the mixed-in rows"})
    mix: float | None = field(default=0.1, metadata={
        "help": "fraction of every batch from the original domain (the rows the KL term acts on)"})

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 0:
            raise ForgetlessError(f"distill: beta must not be negative, got {self.beta}")
        if self.mix == 0:
            raise ForgetlessError("distill: mix=0 leaves no rows to distil on (plain full fine-tuning); use mix > 0 or method full")


@register_method("distill")
class Distill(Method):
    """Full fine-tuning plus a KL term to the task's starting model on the mixed-in original rows."""
    Config = DistillConfig
    order, trains, injects = 91, ALL, False
    start_copies = ("teacher.",)  # copies of the weights at the task's start
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were
    reads_retained = "distillation's KL term"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.teacher: dict[str, torch.Tensor] = {}

    def trainable_parameters(self, model):
        return list(model.named_parameters())

    def on_task_start(self, model, task):
        self.teacher = copy_weights(model)

    def extra_loss(self, model, batch):
        if not self.teacher or self.cfg.beta == 0 or not batch.from_other.any():
            return None
        x, scored = batch.x[batch.from_other], batch.y[batch.from_other] != -100             # (R, T)
        mask = None if batch.mask is None else batch.mask[batch.from_other]                   # (R, T)
        was_training = model.training
        with torch.no_grad():
            model.eval()  # the teacher without dropout
            out = functional_call(model, self.teacher, (x,), {} if mask is None else {"attention_mask": mask})
            model.train(was_training)
            target = F.log_softmax(getattr(out, "logits", out).float(), -1)                   # (R, T, V)
        log_p = F.log_softmax(logits_of(model, x, mask=mask).float(), -1)                     # (R, T, V)
        kl = F.kl_div(log_p, target, log_target=True, reduction="none").sum(-1)              # (R, T)
        return self.cfg.beta * (kl * scored).sum() / scored.sum().clamp_min(1)

    def hook_state(self):
        return {f"teacher.{n}": t for n, t in self.teacher.items()}

    def load_hook_state(self, tensors):
        self.teacher = {k[len("teacher."):]: v for k, v in tensors.items() if k.startswith("teacher.")}
