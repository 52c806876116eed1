"""OSF, orthogonal subspace fine-tuning, through the real `peft` package (peft.OSFConfig).

Each target linear's weight is split by an SVD, W = U_high S_high V_high^T + U_low S_low V_low^T: the top
`effective_rank` singular directions are frozen, the rest (U_low, S_low, V_low) train, and peft projects
their gradients off the frozen directions. In a task sequence the method does what PEFT's OSF guide says
between tasks: recompute the SVD on the updated weights and grow the preserved subspace, so what the
earlier tasks wrote into the top directions stays. PEFT's guide re-wraps with `model.unload()`; with peft
0.21's layer (the trained delta is added beside an untouched base weight) `unload()` drops the task just
trained (measured on a tiny Llama: the logits go back to the base's), so each task's delta is merged
into the weights first (peft's `merge`), which is what the guide means: the SVD of the updated weights.

Defaults, from PEFT: the preserved share per task is that of PEFT's own continual-learning example
(examples/orthogonal_subspace_learning/osf_continual_learning.py, the Llama-3.1-8B TRACE run its README
quotes): 0.3 of each layer's smaller dimension on task 1, +0.2 per later task (0.3, 0.5, 0.7, 0.9), capped
at MAX_FRACTION so a long stream still trains something. Targets are PEFT's OSF default for the
architecture (q, k, v, o, gate, up and down projections on Llama, Qwen, Mistral, ...); on the forgetless
GPT every linear of the blocks. The lr is the protocol's (OSF trains the weights' own singular vectors, so
the real-model presets give it the fine-tuning lr of full fine-tuning, 5e-5, inside the 1e-5 to 1e-4 PEFT's
guide advises); weight decay is the protocol's too (PEFT's guide suggests a small one on U and V).

Saved (save_pretrained) with peft's frozen factors and the merged weights, not re-derived on loading: an
SVD's singular vectors are unique up to sign, so factors trained against one decomposition need not fit
another machine's. For the same reason export writes the merged model, never a PEFT OSF adapter (which
peft would re-decompose on loading; it would also be about as large as the weights it adapts).

peft's OSF wraps torch.nn.Linear only: transformers' Conv1D (GPT-2) is left untouched, silently, so the
method refuses such targets. It is not bit-exact at attach: peft adds the delta as a product of
[U S, -U_init S_init] and [V; V_init], which cancels up to float rounding (about 1e-7 on the logits).

Source: Nayak et al., Sculpting Subspaces: Constrained Full Fine-Tuning in LLMs for Continual Learning
(arXiv 2504.07097), as implemented by PEFT (OSFConfig, peft >= 0.18).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch.nn as nn

from forgetless.errors import ForgetlessError
from forgetless.methods.base import (ALL_LINEAR, WEIGHTS, Method, MethodConfig, find_modules, register_method,
                                     replace_module)
from forgetless.models.gpt import GPT

MAX_FRACTION = 0.95  # the preserved share never reaches the whole layer: every task trains some directions
MERGED = "forgetless_merged"  # set on a base linear once an earlier task's delta was merged into its weight


@dataclass
class OSFMethodConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "linears OSF decomposes (empty: c_attn, c_proj, c_fc on the forgetless GPT; on a transformers "
                "model PEFT's OSF default for the architecture, e.g. q,k,v,o,gate,up,down_proj for Llama, "
                "else all-linear); torch.nn.Linear only"})
    effective_rank: float = field(default=0.3, metadata={
        "help": "singular directions of each layer frozen on task 1 (PEFT's effective_rank): a fraction < 1 of "
                "the layer's smaller dimension, or a count >= 1; the others train"})
    rank_step: float = field(default=0.2, metadata={
        "help": "added to effective_rank at every later task (same unit: a fraction or a count), so each task "
                f"freezes what the earlier ones wrote; fractions stop at {MAX_FRACTION}"})

    def __post_init__(self):
        super().__post_init__()
        if not self.effective_rank > 0 or self.rank_step < 0:
            raise ForgetlessError(f"osf: effective_rank must be positive and rank_step not negative, got "
                                  f"{self.effective_rank} and {self.rank_step}")
        if self.effective_rank < 1 and self.rank_step >= 1:
            raise ForgetlessError("osf: effective_rank < 1 is a fraction of each layer, so rank_step must be one "
                                  f"too (< 1), got {self.rank_step}")
        if self.effective_rank >= 1 and not (self.effective_rank.is_integer() and float(self.rank_step).is_integer()):
            raise ForgetlessError("osf: effective_rank >= 1 counts directions, so it and rank_step must be whole "
                                  f"numbers, got {self.effective_rank} and {self.rank_step}")


@register_method("osf")
class OSF(Method):
    """PEFT's OSF on the target linears; between tasks the delta is merged and the SVD redone with a larger
    frozen subspace."""
    Config = OSFMethodConfig
    order, trains, merges = 70, WEIGHTS, True  # the weights' own singular directions, through peft's layers
    prefix_once = True
    unshardable = "it splits every whole weight matrix by its SVD at each task's start, and a rank holds a shard"
    default_for = ()  # named only: `--methods all` (and the tables it reproduces) stay as they were
    attach_rounding = 1e-6  # peft's OSF adds U S V - U0 S0 V0 as one product

    def preserved(self, task: int) -> float | int:
        """What task `task` freezes, as PEFT reads effective_rank: a float fraction or an int count."""
        value = self.cfg.effective_rank + (task - 1) * self.cfg.rank_step
        return min(value, MAX_FRACTION) if self.cfg.effective_rank < 1 else int(value)

    def targets(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name, module) of the linears OSF wraps, before it wraps them."""
        if self.cfg.target_modules:
            rules = self.cfg.target_modules
        elif isinstance(model, GPT):
            rules = ["c_attn", "c_proj", "c_fc"]
        else:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            rules = list(peft_osf().TRANSFORMERS_MODELS_TO_OSF_TARGET_MODULES_MAPPING.get(model_type) or [ALL_LINEAR])
        return find_modules(model, rules, self.cfg.exclude_modules)

    def check_base(self, model):
        super().check_base(model)
        other = [(n, type(m).__name__) for n, m in self.targets(model) if not isinstance(m, nn.Linear)]
        if other:
            raise ForgetlessError(
                f"osf: PEFT's OSF wraps torch.nn.Linear layers only and would leave {other[0][0]} (a {other[0][1]}) "
                f"untouched{' with ' + str(len(other) - 1) + ' more' if len(other) > 1 else ''}, training "
                "nothing there; pass target_modules naming nn.Linear layers, or use a method that wraps "
                "Conv1D (e.g. lora) on GPT-2-style models")

    def attach(self, model):
        return self.wrap(model, 1)

    def wrap(self, model: nn.Module, task: int) -> nn.Module:
        """peft's OSF on every target linear, with the SVD of its current weight and task `task`'s frozen share."""
        names = [n for n, _ in self.targets(model)]
        osf = peft_osf()
        return osf.inject_adapter_in_model(osf.OSFConfig(target_modules=names, effective_rank=self.preserved(task)), model)

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in model.named_modules() if isinstance(m, peft_osf().OSFLayer)]

    def on_task_start(self, model, task):
        """Task t > 1: merge the delta learned so far into the weights, then decompose them again, freezing
        task t's larger share (peft makes new U_low, S_low, V_low: a fresh optimizer must take them)."""
        if task > 1:
            self.merge(model, mark=True)
            self.wrap(model, task)

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if ".osf_svd_params." in n]

    def state_dict(self, model, injected):
        """peft's tensors of every OSF layer (the trainable factors and the frozen ones the delta and the
        projection use: the SVD is not redone on loading, as its signs are not unique), and the base weights
        an earlier task was merged into."""
        merged = {f"{name}.base_layer.weight": m.get_base_layer().weight.detach() for name, m in self.layers(model)
                  if getattr(m.get_base_layer(), MERGED, False)}
        own = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if ".osf_svd_params." in n or "._osf_" in n}
        return {**own, **merged}

    def load_state_dict(self, model, tensors):
        super().load_state_dict(model, tensors)
        for name in tensors:  # base weights an earlier task was merged into
            if name.endswith(".base_layer.weight"):
                setattr(model.get_submodule(name.rsplit(".", 1)[0]), MERGED, True)

    def merge(self, model, mark: bool = False):
        """peft's merge of every OSF layer (W + U_low S_low V_low - U_init S_init V_init, the factored delta
        made explicit) into its base linear, which then replaces it."""
        for name, layer in self.layers(model):
            layer.merge()
            base = layer.get_base_layer()
            if mark:
                setattr(base, MERGED, True)
            replace_module(model, name, base)
        model.__dict__.pop("peft_config", None)  # peft's record of the adapter, gone with its layers
        return model


def peft_osf():
    """peft's OSF names (peft >= 0.18), imported when osf is used, so older peft versions serve every other method."""
    try:
        import peft
        from peft.tuners.osf.layer import OSFLayer
        from peft.utils import constants
    except ImportError as e:
        raise ForgetlessError(f"osf needs peft >= 0.18 with OSF ({e}): pip install -U 'peft>=0.18'") from e
    return SimpleNamespace(OSFConfig=peft.OSFConfig, inject_adapter_in_model=peft.inject_adapter_in_model,
                           OSFLayer=OSFLayer, TRANSFORMERS_MODELS_TO_OSF_TARGET_MODULES_MAPPING=(
                               constants.TRANSFORMERS_MODELS_TO_OSF_TARGET_MODULES_MAPPING))
