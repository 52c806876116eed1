"""Peak training memory of a method on a model, estimated before anything loads: `forgetless adapt --plan`,
`forgetless methods --memory MODEL`, and adapt's check that a run fits its device.

The model is built on the meta device from its config (no weights) and the method attaches to it, so the counts
of trainable, frozen and injected parameters come from the method's own code; `copies` on the method and term
classes says how many copies of the trained parameters it keeps (Fisher, anchor, start copy). The peak is

    weights (frozen ones in the base's dtype or packed 4/8-bit) + autocast's half copies of the linear weights
    + per trained parameter: AdamW's two moments (in the parameters' dtype) and the method's copies
    + activations: bytes per token per decoder layer that autograd saves (TRAINED, FROZEN below)
    + the larger of: the LM loss's and the KL's backward over chunks of logits (forgetless.loss.chunked_sum: the
      output head and the loss over a chunk of the scored positions at a time, recomputed in the backward; the
      logits of every position when the model's own forward makes them, `every_position`), or the trained
      parameters' gradients, which arrive after it, as activations go

Not counted: transient peaks of start_task (EWC's Fisher pass, OSF's SVD) and allocator slack.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from forgetless.device import EAGER_BYTES, eager_attention_bytes, eager_training
from forgetless.errors import ForgetlessError

# Bytes autograd saves per token per decoder layer, as coefficients of (width d, FFN width, key/value width, query
# heads, 1): counted with torch.autograd.graph.saved_tensors_hooks on transformers' Llama decoder layer (SDPA
# attention, which saves no (T, T) matrix; eager attention's is a part of its own), exact for every width tried
# (tests/test_memory.py counts them again).
# fp32: fp32 weights and compute; amp: fp32 weights under bf16/fp16 autocast (the residual stream stays fp32, each
# linear saves its own half-precision copy of its input); half: bf16/fp16 weights. TRAINED: every weight trains;
# FROZEN: no weight of the layer trains (a frozen linear keeps no input: its backward needs only its weight), and a
# method's trained linears then keep their inputs (in_features bytes at the compute precision per token).
TRAINED = {"fp32": (32, 16, 8, 4, 8), "amp": (30, 8, 4, 4, 8), "half": (20, 8, 4, 4, 8)}
FROZEN = {"fp32": (16, 12, 8, 4, 8), "amp": (12, 6, 4, 4, 8), "half": (12, 6, 4, 4, 8)}
CHECKPOINTED = {"fp32": 4, "amp": 4, "half": 2}  # with gradient checkpointing: each layer's input, bytes per d
QUANTIZED = {"4bit": 0.5 + 4 / 64, "8bit": 1.0}  # bytes per packed weight: NF4 plus one fp32 absmax per 64; int8
LM_CHUNKS, KL_CHUNKS = 3, 5  # fp32 chunks of logits (loss.CHUNK_BYTES) alive at once in a chunk's backward: the
# loss's log-softmax, its gradient in and out; the KL's two log-softmaxes, the teacher's probabilities, gradients
ENV = "FORGETLESS_DEVICE_MEMORY"  # e.g. 8GiB: the device memory adapt checks against (default: the device's)


@dataclass
class Setting:
    """What a run is, for the estimate: batch rows x tokens per row, the share of old rows mixed in (the KL's
    second forward), the fraction of positions scored, the weights' and autocast's precision, checkpointing, the
    packed base."""
    batch: int
    tokens: int
    mix: float = 0.0
    scored: float = 1.0
    dtype: torch.dtype = torch.float32
    precision: str = "fp32"  # autocast: fp32 (none), bf16, fp16
    checkpointing: bool = False
    quantize: str = "none"
    eager: bool = False  # bf16 on a CPU: attention runs eagerly within device.EAGER_BYTES (training_attention)
    every_position: bool = False  # the model's own forward (Adapted's, Trainer's) makes logits at every position and
    # its output holds them (counted as held through the backward, as by a loop that keeps `out`); forgetless's own
    # loop runs the head only at scored positions (loss.training_loss) and drops them after the loss

    def __str__(self):
        precision = "no autocast" if self.precision == "fp32" else f"{self.precision} autocast"
        return (f"{str(self.dtype).removeprefix('torch.')} weights{', 4-bit base' * (self.quantize == '4bit')}"
                f"{', 8-bit base' * (self.quantize == '8bit')}, {precision}, batch {self.batch} x {self.tokens} tokens"
                f"{', gradient checkpointing' * self.checkpointing}")

    @property
    def retained(self) -> int:
        return math.ceil(self.mix * self.batch)

    @property
    def mode(self) -> str:
        if self.dtype != torch.float32:
            return "half"
        return "fp32" if self.precision == "fp32" else "amp"


@dataclass
class Estimate:
    parts: dict[str, float] = field(default_factory=dict)  # bytes by kind
    trainable: int = 0
    params: int = 0

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def estimate(model: nn.Module, method, s: Setting) -> Estimate:
    """The peak of training `method` (a built Method) on `model` (a transformers causal LM, best on the meta
    device: it is attached to, in place) in setting `s`."""
    from forgetless.adapted import attach
    head = model.get_output_embeddings()
    base_linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not head}
    adapted = attach(model, method)
    w = torch.finfo(s.dtype).bits // 8
    params = list({id(p): p for p in adapted.parameters()}.values())
    trained = sum(p.numel() for p in params if p.requires_grad)
    packed = sum(p.numel() for p in params if id(p) in base_linear and not p.requires_grad) \
        if s.quantize != "none" else 0
    total = sum(p.numel() for p in params)
    linear = sum(m.weight.numel() for m in adapted.modules() if isinstance(m, nn.Linear))
    if head is not None and not isinstance(head, nn.Linear):
        linear += head.weight.numel()
    parts = {"weights": (total - packed) * w + packed * QUANTIZED.get(s.quantize, w),
             "autocast copies": 2 * linear if s.mode == "amp" else 0,
             "AdamW": 2 * trained * w, "method state": method.copies * trained * w}
    e = 4 if s.mode == "fp32" else 2  # bytes of an activation
    d, ffn, kv, heads, layers, vocab = text_config(model)
    every = trained == sum(p.numel() for p in params)  # every weight trains (full fine-tuning)
    per_layer = sum(c * x for c, x in zip((TRAINED if every else FROZEN)[s.mode], (d, ffn, kv, heads, 1)))
    own = 0 if every else e * sum(m.in_features for m in adapted.modules()  # the method's trained linears' inputs
                                  if isinstance(m, nn.Linear) and m.weight.requires_grad)
    kl = "KL" in method.reads_retained  # distillation: a second forward of the retained rows
    rows = s.batch + (s.retained if kl else 0)
    if s.checkpointing:  # each layer's input, one layer recomputed at a time
        saved = layers * CHECKPOINTED[s.mode] * d + per_layer + own / layers
    else:
        saved = layers * per_layer + own
    parts["activations"] = rows * s.tokens * (saved + d * (8 + e))  # + the final norm and the head's input
    if s.eager and not s.checkpointing and eager_attention_bytes(rows, s.tokens, heads, layers) <= EAGER_BYTES:
        parts["eager attention"] = eager_attention_bytes(rows, s.tokens, heads, layers)
    from forgetless.loss import CHUNK_BYTES
    if s.every_position:  # the output's logits of every position, alive through the backward, and the loss over them
        logits = s.batch * s.tokens * vocab
        held = logits * e
        # one chunk: the fp32 log-softmax, its gradient in and out; in chunks: each chunk's gradient and their
        # concatenation (fp32), beside a chunk's working set
        loss = logits * 12 if 4 * logits <= CHUNK_BYTES else logits * 8 + LM_CHUNKS * CHUNK_BYTES
    else:  # forgetless's loop: the head runs over chunks of the scored positions, each recomputed in the backward
        held, loss = 0, LM_CHUNKS * min(CHUNK_BYTES, 4 * s.batch * math.ceil(s.tokens * s.scored) * vocab)
    if kl:  # in chunks of the retained rows' scored positions, head included; before the LM loss's backward
        loss = max(loss, KL_CHUNKS * min(CHUNK_BYTES, 4 * s.retained * math.ceil(s.tokens * s.scored) * vocab))
    # the loss's backward ends before the layers' gradients pile up, which arrive as activations go; a penalty on
    # the weights (EWC's) is made before the forward, so its gradients come last, one parameter at a time
    parts["logits or gradients"] = held + max(loss, trained * w)
    return Estimate(parts, trained, total)


def fit(spec: str, label: str, make, cfg, device: torch.device, tokens: int, plan: bool = False):
    """adapt's memory check of `make()` (the Method `label` names) on the model `spec` in `cfg` (after
    resolve_run) with rows of `tokens` on `device`, before the model loads: (cfg, lines to print).
    With `plan`, the lines are the estimates of the run and its alternatives. Else a run whose estimate is above
    the device's memory (1.0x) turns gradient checkpointing on where that fits, or stops with a one-line error
    naming the options that fit; a model or method the estimate cannot read is not checked."""
    budget, what = device_memory(device)
    try:
        config, s = setting(spec, make(), cfg, device, tokens)
        rows = alternatives(config, label, make, s)
    except Exception as e:  # noqa: BLE001 (an estimate that cannot be made never blocks a run; the load says why)
        if plan:
            raise ForgetlessError(f"no memory estimate for {label} on {spec}: {e}") from None
        return cfg, []
    if plan:
        head = f"memory plan: {spec}, {s}; {device}: {gib(budget)} ({what}); a run stops above 1.0x of that"
        return cfg, [head, *(f"  {'fits' if e.total <= budget else 'over':4s} {gib(e.total):>11s}  {flags}  ("
                             + ", ".join(f"{k} {gib(v)}" for k, v in e.parts.items() if v) + ")"
                             for flags, e in rows)]
    (_, first), rest = rows[0], rows[1:]
    if first.total <= budget:
        return cfg, []
    if not s.checkpointing and rest[0][1].total <= budget:
        load = dataclasses.replace(cfg.load, gradient_checkpointing="on")
        return dataclasses.replace(cfg, load=load), [
            f"gradient checkpointing on: {label} needs about {gib(first.total)} without it, {gib(rest[0][1].total)} "
            f"with it, and {device} has {gib(budget)} ({what})"]
    fits = [f"{flags} ({gib(e.total)})" for flags, e in rest if e.total <= budget]
    raise ForgetlessError(
        f"{label} needs about {gib(first.total)} to train here, above the {gib(budget)} of {device} ({what}); "
        + (f"options that fit: {'; '.join(fits)}" if fits else "none of --gradient-checkpointing, a smaller "
           "batch, lora or a 4-bit base fits: use a smaller model or a larger device")
        + f" (all estimates: adapt --plan; ${ENV} sets the memory checked against)")


def setting(spec: str, method, cfg, device: torch.device, tokens: int):
    """(the transformers config of `spec`, the Setting of training `method` on it as `cfg` says)."""
    from forgetless.models.hf import model_config, resolve_dtype
    config = model_config(spec)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return config, Setting(cfg.adapt.batch_size, tokens, mix=method.training_config(cfg.adapt).mix,
                           dtype=resolve_dtype(cfg.load.dtype, saved, device), precision=cfg.adapt.precision,
                           checkpointing=cfg.load.gradient_checkpointing != "off", quantize=cfg.load.quantize,
                           eager=eager_training(device, cfg.adapt.precision))


def per_method(spec: str, cfg, device: torch.device, tokens: int) -> list[tuple[str, Estimate | str]]:
    """(name, estimate, or why there is none) of every registered method trained on `spec` as `cfg` says."""
    from forgetless.methods.base import build_method, method_names
    out = []
    for name in method_names():
        method = build_method(name, cfg.methods.get(name))
        config, s = setting(spec, method, cfg, device, tokens)
        try:
            out.append((name, estimate(meta_model(config, s.dtype), method, s)))
        except ForgetlessError as e:
            out.append((name, str(e)))
    return out


def alternatives(config, label: str, make, s: Setting) -> list[tuple[str, Estimate]]:
    """(flags, estimate) of the run as set (first, flags = `label`), then with gradient checkpointing, half the
    batch, LoRA, LoRA on a 4-bit base, and all of these at once."""
    from forgetless.methods.base import build_method
    def lora():
        return build_method("lora")
    runs = [(label, make, s)]
    if not s.checkpointing and getattr(meta_model(config), "supports_gradient_checkpointing", False):
        runs.append((f"{label} --gradient-checkpointing", make, dataclasses.replace(s, checkpointing=True)))
    if s.batch > 1:
        runs.append((f"{label} --adapt-batch-size {s.batch // 2}", make, dataclasses.replace(s, batch=s.batch // 2)))
    if label != "lora":
        runs.append(("--method lora", lora, s))
    small = dataclasses.replace(s, quantize="4bit", checkpointing=True, batch=max(1, s.batch // 2))
    runs += [("--method lora --quantize 4bit", lora, dataclasses.replace(s, quantize="4bit")),
             (f"--method lora --quantize 4bit --gradient-checkpointing --adapt-batch-size {small.batch}", lora, small)]
    return [(flags, estimate(meta_model(config, setting.dtype), build(), setting)) for flags, build, setting in runs]


def text_config(model: nn.Module) -> tuple[int, int, int, int, int, int]:
    """(d, FFN width, key/value width, query heads, decoder layers, vocabulary) of a transformers model."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
    if not (d and heads and layers and getattr(c, "vocab_size", None)):
        raise ForgetlessError(f"{type(model).__name__}: its config names no hidden size, heads or layers; the memory "
                              "estimate knows transformers decoder LMs (Llama, Qwen, GPT-2, ...)")
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    head_dim = getattr(c, "head_dim", None) or d // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
    return d, ffn, kv, heads, layers, c.vocab_size


def meta_model(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of a transformers `config` on the meta device: shapes, no memory."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).to(dtype)


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) a run on `device` may use: $FORGETLESS_DEVICE_MEMORY where set, else a GPU's total
    memory, else the RAM available now."""
    if text := os.environ.get(ENV):
        return parse_bytes(text), f"${ENV}"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)} total"
    import psutil
    return psutil.virtual_memory().available, "RAM available"


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '2GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ForgetlessError(f"${ENV}={text!r}: give a size such as 8GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "B").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(match.group(1)) * scale[unit])


def gib(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class LivePeak(TorchDispatchMode):
    """Peak bytes of the tensor storages made inside it that are alive at once (any device; what autograd keeps
    included): `with LivePeak() as live: ...; live.peak`. Storages alive before it are not counted."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))  # a view or an in-place result
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}  # of an input: no new storage
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.nbytes() and id(storage) not in self.seen and id(storage) not in inputs:
                    self.seen.add(id(storage))
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self.free, id(storage), storage.nbytes())
        return out

    def free(self, key: int, nbytes: int):
        self.seen.discard(key)
        self.now -= nbytes
