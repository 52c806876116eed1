"""Distillation to the starting model on replayed rows: full fine-tuning on the new data mixed with
rows of the original domain (`mix`, default 0.1), plus a KL term that holds the model's next-token
distribution on those rows where it was when the task started.

    loss = LM loss + beta * KL(p_start(. | x) || p(. | x)),   averaged over the scored tokens of the mixed rows

The term composes with any method (`lora+distill`, methods/base.py Composed): the teacher is the model run with the
trainable parameters' values at the task's start (`torch.func.functional_call`), a copy of every weight
for full fine-tuning, of the adapters' few weights for LoRA-style methods. The KL runs a chunk of positions
at a time in fp32 and only at positions some mixed row scores; its backward recomputes the softmaxes, so no
fp32 (rows, T, V) tensor is kept. In a task sequence the mixed rows are the earlier tasks' (or the original
domain's) and the teacher is the model at the task's start.

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
from forgetless.methods.base import ALL, Composed, MethodConfig, Term, register_method, register_term
from forgetless.methods.full import Full
from forgetless.models.gpt import logits_of, takes_logits_to_keep

CHUNK_BYTES = 64 << 20  # fp32 bytes of one chunk of (positions, V) in the KL


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
    default_mix = 0.1

    def loss(self, method, model, batch):
        if not method.start or self.cfg.beta == 0 or not batch.from_other.any():
            return None
        x, scored = batch.x[batch.from_other], batch.y[batch.from_other] != -100             # (R, T)
        mask = None if batch.mask is None else batch.mask[batch.from_other]                   # (R, T)
        keep = None
        if not scored.all() and takes_logits_to_keep(model):
            keep = scored.any(0).nonzero().flatten()  # (P,) positions some row scores: the head skips the rest
            scored = scored[:, keep]                                                           # (R, P)
        was_training = model.training
        with torch.no_grad():
            model.eval()  # the teacher without dropout
            kwargs = {**({} if mask is None else {"attention_mask": mask}), **({} if keep is None else {"logits_to_keep": keep})}
            out = functional_call(model, method.start, (x,), kwargs)
            model.train(was_training)
        teacher = getattr(out, "logits", out)                                                  # (R, P, V)
        student = logits_of(model, x, keep, mask)                                              # (R, P, V)
        kl = ChunkedKL.apply(student, teacher)                                                 # (R, P)
        return self.cfg.beta * (kl * scored).sum() / scored.sum().clamp_min(1)


class ChunkedKL(torch.autograd.Function):
    """KL(softmax(teacher) || softmax(student)) at every position of logits (R, T, V) -> (R, T), in fp32 a chunk
    of positions at a time; keeps only the two logits tensors (their dtype) for the backward, which recomputes
    each chunk's log-softmaxes and runs autograd's own kernels on them (the same numbers as autograd's graph)."""

    @staticmethod
    def forward(ctx, student, teacher):
        ctx.save_for_backward(student, teacher)
        s, t = student.flatten(0, -2), teacher.flatten(0, -2)                                # (N, V)
        out = torch.cat([kl_rows(a, b)[0] for a, b in chunks(s, t)])                            # (N,)
        return out.view(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        student, teacher = ctx.saved_tensors
        s, t, g = student.flatten(0, -2), teacher.flatten(0, -2), grad.flatten()
        out = torch.empty_like(s)                                                             # (N, V)
        i = 0
        for a, b in chunks(s, t):
            _, log_p, target = kl_rows(a, b)
            d_log_p = -(g[i:i + len(a), None].expand_as(log_p) * target.exp())                # kl_div's backward
            d = torch.ops.aten._log_softmax_backward_data(d_log_p, log_p, -1, torch.float32)  # log_softmax's
            out[i:i + len(a)] = d.to(out.dtype)
            i += len(a)
        return out.view_as(student), None


def chunks(s: torch.Tensor, t: torch.Tensor):
    """(student, teacher) rows (n, V) of at most CHUNK_BYTES in fp32."""
    n = max(1, CHUNK_BYTES // (4 * s.shape[-1]))
    return zip(s.split(n), t.split(n))


def kl_rows(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL per row (n,), student log-softmax (n, V), teacher log-softmax (n, V)) in fp32."""
    log_p, target = F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1)
    return F.kl_div(log_p, target, log_target=True, reduction="none").sum(-1), log_p, target


@register_method("distill")
class Distill(Composed):
    """Full fine-tuning plus a KL term to the task's starting model on the mixed-in original rows."""
    Config = DistillConfig
    order, trains, injects, takes_terms, copies = 91, ALL, False, False, 1
    unshardable = ""
    start_copies = ("start.",)  # copies of the weights at the task's start
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were
    reads_retained = DistillTerm.reads_retained

    def __init__(self, cfg):
        super().__init__(cfg, Full(cfg), [DistillTerm(cfg)])
