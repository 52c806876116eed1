"""Distillation to the starting model on replayed rows: full fine-tuning on the new data mixed with
rows of the original domain (`mix`, default 0.1), plus a KL term that holds the model's next-token
distribution on those rows where it was when the task started.

    loss = LM loss + beta * KL(p_start(. | x) || p(. | x)),   averaged over the scored tokens of the mixed rows

The term composes with any method (`lora+distill`, methods/base.py Composed): the teacher is the model run with the
trainable parameters' values at the task's start (`torch.func.functional_call`), a copy of every weight
for full fine-tuning, of the adapters' few weights for LoRA-style methods. The KL runs at the positions the mixed
rows score, a chunk of them at a time in fp32, the output head included (forgetless.loss.chunked_sum): student
and teacher stop at what the head reads, and each chunk's logits are made again in the backward, so no (rows, T,
V) logits tensor is kept, the teacher's included. In a task sequence the mixed rows are the earlier tasks' (or the original
domain's) and the teacher is the model at the task's start.

Sources: learning without forgetting (Li & Hoiem, 2016) distils on the new task's inputs; dark
experience replay (Buzzega et al., 2020) distils on replayed rows towards logits stored when they were
seen, close in spirit to this (here the targets come from the model at the task's start).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.loss import chunked_sum, head_inputs
from forgetless.methods.base import ALL, Composed, MethodConfig, Term, register_method, register_term
from forgetless.methods.full import Full
from forgetless.models.gpt import takes_logits_to_keep


@dataclass
class DistillTermConfig:
    beta: float = field(default=1.0, metadata={"help": "weight of the KL term on the mixed-in rows"})

    def __post_init__(self):
        if self.beta < 0:
            raise ForgetlessError(f"distill: beta must not be negative, got {self.beta}")
        if post := getattr(super(), "__post_init__", None):
            post()


@dataclass
class DistillConfig(DistillTermConfig, MethodConfig):
    mix: float | None = field(default=0.1, metadata={
        "help": "fraction of every batch from the original domain (the rows the KL term acts on)"})

    def __post_init__(self):
        super().__post_init__()
        if self.mix == 0:
            raise ForgetlessError("distill: mix=0 leaves no rows to distil on (plain full fine-tuning); use mix > 0 or method full")


@register_term("distill")
class DistillTerm(Term):
    """A KL term to the model at the task's start on the mixed-in rows of old data."""
    Config = DistillTermConfig
    unshardable = ""
    reads_retained = "distillation's KL term"
    default_mix, prefix_once = 0.1, True  # its KL runs its own forward of the retained rows

    def loss(self, method, model, batch):
        if not method.start or self.cfg.beta == 0 or not batch.from_other.any():
            return None
        x, scored = batch.x[batch.from_other], batch.y[batch.from_other] != -100             # (R, T)
        mask = None if batch.mask is None else batch.mask[batch.from_other]                   # (R, T)
        keep = None
        if not scored.all() and takes_logits_to_keep(model):
            keep = scored.any(0).nonzero().flatten()  # (P,) positions some row scores: the rest reach no head
            scored = scored[:, keep]                                                           # (R, P)
        was_training = model.training
        with torch.no_grad():
            model.eval()  # the teacher without dropout
            teacher, teacher_head, _ = head_inputs(model, x, keep, mask, method.start)         # (R, P, d) or logits
            model.train(was_training)
        student, head, vocab = head_inputs(model, x, keep, mask)                              # (R, P, d) or logits
        rows = [t.flatten(0, 1) if scored.all() else t[scored] for t in (student, teacher)]  # (N, d or V)
        kl = chunked_sum(kl_sum, vocab, *rows, head=head, teacher_head=teacher_head)
        return self.cfg.beta * kl / scored.sum().clamp_min(1)


def kl_sum(student: torch.Tensor, teacher: torch.Tensor, head=None, teacher_head=None) -> torch.Tensor:
    """Summed KL(softmax(teacher logits) || softmax(student logits)) over rows (n, V) in fp32, the logits made by
    `head` and `teacher_head` of their inputs (n, d) where given; the teacher's outside autograd."""
    log_p = F.log_softmax((student if head is None else head(student)).float(), -1)             # (n, V)
    with torch.no_grad():
        target = F.log_softmax((teacher if teacher_head is None else teacher_head(teacher)).float(), -1)  # (n, V)
    return F.kl_div(log_p, target, log_target=True, reduction="sum")


@register_method("distill")
class Distill(Composed):
    """Full fine-tuning plus a KL term to the task's starting model on the mixed-in original rows."""
    Config = DistillConfig
    order, trains, injects, takes_terms, copies, prefix_once = 91, ALL, False, False, 1, True
    unshardable = ""
    start_copies = ("start.",)  # copies of the weights at the task's start
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were
    reads_retained = DistillTerm.reads_retained

    def __init__(self, cfg):
        super().__init__(cfg, Full(cfg), [DistillTerm(cfg)])
