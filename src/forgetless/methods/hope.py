"""HOPE arm (docs/DESIGN.md §2.4): a base whose FFN slots are HOPE modules (Titans memory + CMS chain),
pretrained with the CMS periods, then adapted with the slots training (levels on their periods) and the memory
written at test time inside every forward.

    hope                 memory and CMS levels train; attention, embeddings and norms stay frozen
    hope[writes=false]   the memory is only read (its learned initial weights): the test-time memory off

On a transformers model (no HOPE base to pretrain) a HOPE slot is attached beside every MLP, its outputs at zero.
Not in `--methods all` (`default_for = ()`): name it, e.g. `forgetless bench --methods hope,full`.

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, find_ffns, put_beside, register_method
from forgetless.methods.cms import ALIGN, aligned
from forgetless.models.gpt import GPT, GPTConfig, logits_of
from forgetless.nn.adapter import input_width, n_params, width_for
from forgetless.nn.hope import HOPE, HopeConfig
from forgetless.nn.titans import NeuralMemory, check_scan


@dataclass
class HopeMethodConfig(MethodConfig, HopeConfig):
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "on models other than the forgetless GPT: the MLPs that get a HOPE slot beside them (empty: every "
                "decoder layer's MLP, found from the model's structure)"})
    writes: bool = field(default=True, metadata={
        "help": "write the memory inside the forward (test-time memory); false: reads of its initial weights only"})
    retrofit_size: float = field(default=0.05, metadata={
        "help": "on transformers models: the slots' parameters as a fraction of the model's, about half to the "
                "memory (its width, unless width is given) and the rest to the CMS levels (unless level_hidden "
                "is given)"})
    checkpoint: bool = field(default=True, metadata={
        "help": "recompute each memory's forward in backward instead of keeping its per-chunk weights: one "
                "layer's at a time (batch 8 x 200 beside SmolLM2's 30 MLPs with model-wide memories, width=576: "
                "tens of GB otherwise; little at a retrofit's default width); same values"})
    scan: str = field(default="parallel", metadata={
        "help": "how each memory runs its chunks: parallel (each chunk's surprise and write in one pass without a "
                "graph, its adjoint written out for backward; the gates' coefficients and the reads batched over "
                "the chunks) or sequential (one chunk at a time in the graph: the reference, and the form of "
                "results before 2026-11-26); the same math, equal to float rounding. backprop_writes always runs "
                "sequential"})

    def __post_init__(self):
        super().__post_init__()
        if not self.retrofit_size > 0:
            raise ForgetlessError(f"hope retrofit_size must be positive, got {self.retrofit_size}")
        check_scan(self.scan, "hope")


def slots(model) -> list[tuple[str, HOPE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, HOPE)]


@register_method("hope")
class HopeMethod(Method):
    """HOPE base (FFN = Titans memory + CMS levels); the slots adapt, the memory writes at test time."""
    Config = HopeMethodConfig
    order = 102
    unshardable = "its memory writes weights inside every forward, which FSDP's gathered copies of a layer would drop"
    default_for = ()

    def hope_options(self) -> HopeConfig:
        return HopeConfig(**{f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(HopeConfig)})

    def base_config(self, model_cfg: GPTConfig) -> GPTConfig:
        return dataclasses.replace(model_cfg, ffn="hope", ffn_options=dataclasses.asdict(self.hope_options()))

    def check_base(self, model):
        if isinstance(model, GPT):  # other models (transformers) get a HOPE slot beside their MLPs
            super().check_base(model)

    def attach(self, model):
        if not isinstance(model, GPT):
            self.retrofit(model)
        if not slots(model):
            raise ForgetlessError(f"method {self.name} found no HOPE slot: it needs a HOPE base (model.ffn = hope)")
        set_writes(model, self.cfg.writes)
        for m in model.modules():
            if isinstance(m, NeuralMemory):
                m.checkpoint, m.scan = self.cfg.checkpoint, self.cfg.scan
        return model

    def retrofit(self, model):
        """A HOPE slot beside every target MLP, its memory and levels' output projections at zero. Each slot gets
        `retrofit_size` of the model's parameters over the number of slots: about half to the memory (its width,
        a multiple of heads; the block's width d with self_modify), the rest to the CMS levels; widths `aligned`."""
        opts = self.hope_options()
        if not opts.attention:
            raise ForgetlessError(f"hope attention=false needs a forgetless GPT; {type(model).__name__} keeps its "
                                  "attention, so drop attention=false")
        targets = find_ffns(model, self.cfg.target_modules, self.cfg.exclude_modules)
        budget = self.cfg.retrofit_size * n_params(model) / max(1, len(targets))
        for name, mlp in targets:
            d = input_width(mlp)
            slot = opts if opts.width or opts.self_modify else dataclasses.replace(
                opts, width=memory_width(d, opts, budget / 2))
            width = opts.level_hidden or aligned(width_for(lambda w: n_params(HOPE(d, w, slot)), budget))
            put_beside(model, name, mlp, HOPE(d, width, slot, zero_out=True))

    def trainable_parameters(self, model):
        return [(f"{name}.{n}", p) for name, slot in slots(model) for n, p in slot.named_parameters()]

    def report(self, model, windows_a, windows_b, max_windows: int = 32):
        """What the test-time writes do: mean token cross-entropy (nats) on held-out windows with the memory's
        writes off minus with them on (positive: the writes help), on A and on B."""
        out = {}
        for tag, windows in (("a", windows_a), ("b", windows_b)):
            if windows is not None:
                w = windows[:max_windows]
                out[f"memory_gain_{tag}"] = cross_entropy(model, w, writes=False) - cross_entropy(model, w, writes=True)
        set_writes(model, self.cfg.writes)
        return out


def memory_width(d: int, opts: HopeConfig, budget: float) -> int:
    """The memory width (a multiple of heads, `aligned` to a multiple of 16 too, at most d) whose memory has about
    `budget` parameters."""
    heads = opts.heads
    n = width_for(lambda n: n_params(NeuralMemory(d, dataclasses.replace(opts, width=n * heads))), budget)
    return min(aligned(heads * n, math.lcm(ALIGN, heads)), heads * (d // heads))


def set_writes(model, writes: bool):
    for m in model.modules():
        if isinstance(m, NeuralMemory):
            m.writes = writes


@torch.no_grad()
def cross_entropy(model, windows, writes: bool) -> float:
    """Mean next-token cross-entropy of windows (W, T+1) in eval mode, the memories writing or not."""
    was_training = model.training
    model.eval()
    set_writes(model, writes)
    w = windows.to(next(model.parameters()).device)
    logits = logits_of(model, w[:, :-1])  # (W, T, V)
    model.train(was_training)
    return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten()).item()
