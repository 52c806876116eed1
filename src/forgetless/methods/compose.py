"""A method plus protecting terms: `lora+ewc`, `lora[r=16]+distill[beta=0.5]`, `neutral+distill`, `moram+ewc`.

The method chooses what trains (its modules, or the model's own weights); each term (EWC's Fisher penalty,
distillation's KL to the task's starting model) acts on exactly that set. State lives only over the trainable
parameters: at every task's start the composition keeps one copy of them (`start`, in the model's dtype), which
is EWC's anchor and, run through the model's own forward with `torch.func.functional_call`, distillation's
teacher. For a method that injects modules (LoRA, adapters, atoms) that copy is the modules' few weights, so the
teacher is the model at the task's start without a copy of the base (at task 1 the base itself: LoRA's B is 0);
for full fine-tuning it is a copy of every weight, as in `ewc` and `distill`, which are full+ewc and full+distill.
"""
from __future__ import annotations

import dataclasses

import torch

from forgetless.config import from_dict
from forgetless.errors import ForgetlessError
from forgetless.methods.base import METHODS, TERMS, Method, build_method


class Composed(Method):
    """`base` (what trains, its modules and hooks) with `terms` added to its loss; traits are the base's, plus
    the terms' need for old rows."""

    def __init__(self, cfg, base: Method, terms: list, label: str | None = None):
        super().__init__(cfg)
        self.base, self.terms, self.label = base, terms, label
        self.start: dict[str, torch.Tensor] = {}  # the trainable parameters at the task's start
        self.previous = None  # rows of the task learned last, for the terms at on_task_start
        if label:  # `METHOD+TERM`: the method's traits, and the terms' needs (a registered one declares its own)
            for trait in ("name", "order", "trains", "injects", "merges", "export_form", "grows", "mixes_original",
                          "token_weights", "attach_rounding", "pretrained_lr", "default_for"):
                setattr(self, trait, label if trait == "name" else getattr(base, trait))
            self.shardable, self.takes_terms = False, False
            self.copies = base.copies + 1 + sum(t.copies for t in terms)  # + the start copy
            self.needs_previous = base.needs_previous or any(t.needs_previous for t in terms)
            self.reads_retained = " and ".join(filter(None, [base.reads_retained, *(t.reads_retained for t in terms)]))
            self.start_copies = () if base.injects else ("start.",)  # at task 1 the base's (from_pretrained has them)

    # ---- what trains: the base's ----------------------------------------------------------
    def base_config(self, model_cfg):
        return self.base.base_config(model_cfg)

    def check_base(self, model):
        self.base.check_base(model)

    def attach(self, model):
        return self.base.attach(model)

    def trainable_parameters(self, model):
        return self.base.trainable_parameters(model)

    def state_dict(self, model, injected):
        return self.base.state_dict(model, injected)

    def load_state_dict(self, model, tensors):
        self.base.load_state_dict(model, tensors)

    def merge(self, model):
        return self.base.merge(model)

    def report(self, model, windows_a, windows_b):
        return self.base.report(model, windows_a, windows_b)

    def task_report(self, model, windows):
        return self.base.task_report(model, windows)

    def make_optimizer(self, params, cfg):
        return self.base.make_optimizer(params, cfg)

    def before_step(self, model, optimizer, step, last):
        self.base.before_step(model, optimizer, step, last)

    def after_step(self, model, optimizer, step, last):
        self.base.after_step(model, optimizer, step, last)

    # ---- tasks and the terms ------------------------------------------------------------------
    def remember(self, model, data):
        self.base.remember(model, data)
        self.previous = data  # the terms take it at on_task_start, once the base has set up the task's parameters

    def on_task_start(self, model, task):
        self.base.on_task_start(model, task)  # e.g. LoRA merges and restarts, MoRAM grows atoms
        self.start = {n: p.detach().clone() for n, p in self.trainable_parameters(model)}
        if self.previous is not None:
            for term in self.terms:
                term.remember(self, model, self.previous)
        self.previous = None

    def on_task_end(self, model, task):
        self.base.on_task_end(model, task)

    def extra_loss(self, model, batch):
        parts = [t for t in (self.base.extra_loss(model, batch), *(term.loss(self, model, batch) for term in self.terms))
                 if t is not None]
        return sum(parts) if parts else None

    def hook_state(self):
        return {**{f"base.{k}": v for k, v in self.base.hook_state().items()},
                **{k: v for term in self.terms for k, v in term.hook_state().items()},
                **{f"start.{n}": t for n, t in self.start.items()}}

    def load_hook_state(self, tensors):
        self.base.load_hook_state({k[len("base."):]: v for k, v in tensors.items() if k.startswith("base.")})
        for term in self.terms:
            term.load_hook_state(tensors)
        for old in ("start.", "anchor.", "teacher."):  # anchor., teacher.: ewc's and distill's saves before compose
            self.start = self.start or {k[len(old):]: v for k, v in tensors.items() if k.startswith(old)}

    def options(self):
        """A registered composition (ewc): its config's fields; `METHOD+TERM`: the method's, then each term's
        prefixed 'TERM.' (build_method takes them back)."""
        if not self.label:
            return super().options()
        return {**super().options(), **{f"{t.name}.{f.name}": getattr(t.cfg, f.name)
                                          for t in self.terms for f in dataclasses.fields(t.cfg)}}


def compose(name: str, options: dict) -> Composed:
    """The Composed method `name` ('lora+ewc'): options without a prefix go to the method, 'TERM.OPTION' to a term."""
    method, *terms = name.split("+")
    takes = ", ".join(n for n, cls in METHODS.items() if cls.takes_terms)
    if method not in METHODS:
        raise ForgetlessError(f"unknown method {method!r} in {name!r}; a term follows a method, e.g. lora+ewc "
                              f"(methods that take terms: {takes})")
    if not METHODS[method].takes_terms:
        raise ForgetlessError(f"{name}: {method} cannot take terms (it has its own anchor); use one of {takes}, "
                              "e.g. full+ewc+distill for ewc-distill's pair")
    for term in terms:
        if term not in TERMS:
            raise ForgetlessError(f"unknown term {term!r} in {name!r}; valid terms: {', '.join(TERMS)}")
    if len(set(terms)) != len(terms):
        raise ForgetlessError(f"{name}: each term once; set its options in one bracket, e.g. lora+ewc[lam=1e3]")
    stray = [k for k in options if "." in k and k.split(".")[0] not in terms]
    if stray:
        raise ForgetlessError(f"{name}: option {stray[0]!r} names no term of it; write TERM[OPTION=VALUE], e.g. "
                              f"{method}+{terms[0]}[...]")
    built = build_method(method, {k: v for k, v in options.items() if "." not in k})
    parts = [TERMS[t](from_dict(TERMS[t].Config, {k[len(t) + 1:]: v for k, v in options.items()
                                                   if k.startswith(f"{t}.")}, f"methods.{name}.{t}")) for t in terms]
    mixes = [t.default_mix for t in parts if t.default_mix is not None]
    cfg = built.cfg if built.cfg.mix is not None or not mixes else dataclasses.replace(built.cfg, mix=max(mixes))
    if cfg.mix == 0 and (reads := [t.name for t in parts if t.reads_retained]):
        raise ForgetlessError(f"{name}: mix=0 leaves {reads[0]} no rows of old data to act on; use mix > 0 or drop it")
    return Composed(cfg, built, parts, name)
