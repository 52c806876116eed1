"""The Method contract (docs/DESIGN.md §7), its registry, method specs and PEFT-style target matching.

A Method injects modules into any nn.Module (our GPT or a Hugging Face model), says which parameters
train, may add a loss and loop hooks, and saves only its own tensors. Methods that need another FFN
(APN, CMS) say so in `base_config`: protocols pretrain (and cache) such a base, and `check_base`
refuses a base of another kind. Users reach methods through `forgetless.attach` (adapted.py), which
owns the call order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn

from forgetless.config import as_saved, from_dict
from forgetless.data.splits import Batch
from forgetless.distributed import is_shard
from forgetless.errors import ForgetlessError
from forgetless.hooks import StepHooks
from forgetless.models.gpt import GPT, GPTConfig, ffn_signature
from forgetless.nn.adapter import Beside, FFNSpan, linear_shape
from forgetless.optim import OPTIMIZERS


@dataclass
class MethodConfig:
    target_modules: list[str] = field(default_factory=list, metadata={
        "help": "modules to act on: name suffixes (e.g. mlp,c_fc), one regex on the full name, or all-linear "
                "(empty: the method's default for the architecture)"})
    exclude_modules: list[str] = field(default_factory=list, metadata={
        "help": "modules to leave alone (same syntax as target_modules)"})
    lr: float | None = field(default=None, metadata={"help": "learning rate for this method (default: the protocol's)"})
    mix: float | None = field(default=None, metadata={
        "help": "fraction of every batch from the original domain (default: the protocol's --mix / --adapt-mix)"})
    optimizer: str | None = field(default=None, metadata={
        "help": "optimizer for this method (default: the protocol's --adapt-optimizer), e.g. delta or muon"})
    joint: bool = field(default=False, metadata={
        "help": "task sequences: learn all tasks at once, their training rows mixed, in the steps the sequential "
                "arms take in all (the multi-task ceiling; `mtl` is full[joint=true]); no other protocol takes it"})

    def __post_init__(self):
        if self.mix is not None and not 0.0 <= self.mix <= 1.0:
            raise ForgetlessError(f"mix must be in [0, 1], got {self.mix}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ForgetlessError(f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if post := getattr(super(), "__post_init__", None):  # a mixed-in module config (MoRAMConfig, ...)
            post()


METHODS: dict[str, type["Method"]] = {}
TERMS: dict[str, type["Term"]] = {}  # protecting terms that compose with a method: `lora+ewc[lam=1e3]` (Composed)
ALL_LINEAR = "all-linear"
ALL, WEIGHTS, MODULES = "all", "weights", "modules"  # what a method trains (Method.trains)
PEFT = "peft"  # Method.export_form of a method export writes as a PEFT adapter (LoRA)
FINE_TUNING_LR = 5e-5  # transformers' Trainer default: a method training a pretrained model's own weights starts here


def register_method(name: str, table: dict | None = None):
    """Class decorator: make a Method available by `name` on the CLI and in `build_method` (or a Term in `table`)."""
    def wrap(cls):
        cls.name = name
        (METHODS if table is None else table)[name] = cls
        return cls
    return wrap


def register_term(name: str):
    """Class decorator: make a Term available as `METHOD+name` in method specs."""
    return register_method(name, TERMS)


def method_names(protocol: str | None = None) -> list[str]:
    """Registered methods in table order (each method's `order`, then by name); with `protocol`, those in its
    default set (`--methods all`)."""
    names = [n for n in METHODS if protocol is None or protocol in METHODS[n].default_for]
    return sorted(names, key=lambda n: (METHODS[n].order, n))


def traits_text(cls: type["Method"]) -> str:
    """A method class's traits in a few words (the `forgetless methods` table)."""
    trains = {ALL: "trains every weight", WEIGHTS: "trains model weights", MODULES: "trains its modules"}[cls.trains]
    flags = [(not cls.injects, "injects nothing"), (cls.merges, "merges"), (cls.export_form == PEFT, "exports PEFT"),
             (cls.grows, "grows per task"), (cls.needs_previous, "needs the previous task"),
             (cls.reads_retained, "reads old rows"), (not cls.unshardable, "shards (FSDP)")]
    lr = cls.pretrained_options().get("lr")
    return ", ".join([trains, *(text for on, text in flags if on), *([f"lr {lr:g} on a pretrained model"] if lr else [])])


def memory_text(method) -> str:
    """A method's (class or instance) memory per parameter in fp32 with AdamW: 4 B per weight of the model, and per
    trained parameter 16 B (its gradient 4, AdamW's two moments 8, itself 4 where a module adds it) plus 4 B per
    copy it keeps (`copies`). Activations and logits come on top (benchmarks/bench_memory.py measures them)."""
    per_trained = 12 + 4 * method.copies
    if method.trains == ALL:
        return f"{4 + per_trained} B/param"
    return f"4 B/param + {per_trained + 4 * (method.trains == MODULES)} per trained"


def build_method(name: str, options: dict | None = None) -> "Method":
    """A Method by registered `name`, or a composition `METHOD+TERM+...` (options of a term prefixed 'TERM.')."""
    if "+" in name:
        return compose(name, options or {})
    if name not in METHODS:
        raise ForgetlessError(f"unknown method {name!r}; valid: {', '.join(method_names())}")
    cls = METHODS[name]
    return cls(from_dict(cls.Config, options or {}, f"methods.{name}"))


@dataclass(frozen=True)
class MethodSpec:
    """One arm: a registered method `name` with `options`; `label` names it in tables (the spec's text)."""
    name: str
    options: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        if not self.label:  # a composition's term options go in the term's brackets: lora[lr=1e-3]+ewc[lam=1e3]
            parts = []
            for i, part in enumerate(self.name.split("+")):
                prefix = f"{part}." if i else ""
                text = ";".join(f"{k[len(prefix):]}={v}" for k, v in self.options.items()
                                if (k.startswith(prefix) if i else "." not in k))
                parts.append(f"{part}[{text}]" if text else part)
            object.__setattr__(self, "label", "+".join(parts))

    def build(self, defaults: dict | None = None) -> "Method":
        """A fresh Method: `defaults` (e.g. the config's methods.NAME section), then this spec's options."""
        return build_method(self.name, {**(defaults or {}), **self.options})


PART = r"[^,\[\]+]+(?:\[[^\]]*\])?"  # NAME or NAME[OPTION=VALUE;...]


def parse_method_specs(text: str) -> list[MethodSpec]:
    """'full,lora[r=16;alpha=32],lora[r=16]+ewc[lam=1e3]' -> MethodSpecs: bracketed options make an arm of their
    own (labelled by the spec's text), e.g. for ablations of one method's knobs; `+TERM[...]` adds a protecting
    term to the method (its options prefixed 'TERM.' in the spec's options). Called once, where the text comes in."""
    out = []
    for spec in re.findall(rf"{PART}(?:\+{PART})*", text):
        spec, names, options = spec.strip(), [], {}
        for i, part in enumerate(re.findall(PART, spec)):
            name, _, rest = part.strip().partition("[")
            names.append(name.strip())
            for item in filter(None, rest.rstrip("]").split(";")):
                key, eq, value = item.partition("=")
                if not eq or "=" in value:
                    raise ForgetlessError(f"method spec {spec!r}: write NAME[OPTION=VALUE;...], options separated by "
                                          "';', e.g. lora[r=16;lr=3e-4] or lora[r=16]+ewc[lam=1e3]")
                options[f"{names[-1]}.{key.strip()}" if i else key.strip()] = value.strip()
        out.append(MethodSpec("+".join(names), options, spec))
    return out


def method_class(name: str) -> type["Method"] | None:
    """The registered class of `name`, or of the method a composition `METHOD+TERM` starts from (None: unknown)."""
    return METHODS.get(name.split("+")[0])


def saved_options(name: str, options: dict) -> dict:
    """`options` read from a save of method `name` (a composition's per part), with `as_saved`'s values for
    options added after the save was written."""
    parts = name.split("+")
    classes = [METHODS.get(parts[0]), *(TERMS.get(t) for t in parts[1:])]
    out = dict(options)
    for i, cls in enumerate(classes):
        if cls is not None:
            prefix = f"{parts[i]}." if i else ""
            own = {k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix) and (i or "." not in k)}
            out.update({f"{prefix}{k}": v for k, v in as_saved(cls.Config, own).items()})
    return out


def sweep_specs(specs: list[MethodSpec], sweeps: list[str] | None = None, lrs: str | None = None) -> list[MethodSpec]:
    """`specs` plus one arm per swept value: 'lora.r=4,16' adds lora[r=4] and lora[r=16]; `lrs` '1e-4,1e-3'
    adds NAME[lr=...] for every method in `specs`. Arms already there are not added twice."""
    items = [(name, option, values) for item in sweeps or [] for name, option, values in [parse_sweep(item)]]
    if lrs:
        items += [(name, "lr", [v.strip() for v in lrs.split(",") if v.strip()])
                  for name in dict.fromkeys(s.name for s in specs)]
    out = list(specs)
    for name, option, values in items:
        for value in values:
            spec = MethodSpec(name, {option: value})
            spec.build()  # a bad name, option or value fails here, before any work
            if spec.label not in {s.label for s in out}:
                out.append(spec)
    return out


def parse_sweep(item: str) -> tuple[str, str, list[str]]:
    """'lora.lr=1e-4,1e-3' -> ('lora', 'lr', ['1e-4', '1e-3'])."""
    key, eq, values = item.partition("=")
    name, dot, option = key.strip().partition(".")
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not (eq and dot and name and option and values):
        raise ForgetlessError(f"--sweep {item!r}: write METHOD.OPTION=V1,V2,..., e.g. --sweep lora.lr=1e-4,3e-4,1e-3")
    return name, option, values


def as_specs(methods) -> list[MethodSpec]:
    """MethodSpecs from MethodSpecs, or from spec text ('lora[r=16]') given to the Python API."""
    return [m for item in methods for m in ([item] if isinstance(item, MethodSpec) else parse_method_specs(item))]


class Method(StepHooks):
    """Base class; subclasses override what they need (StepHooks adds optional loop hooks).

    Call order (owned by forgetless.attach / Adapted, docs/DESIGN.md §7): check_base, attach,
    freeze; per task remember + on_task_start, then per step the loss (forward, token_weights,
    modules' aux losses, extra_loss), backward, clip, before_step, optimizer step, after_step;
    on_task_end; report / task_report; state_dict.
    """
    name = "base"
    Config = MethodConfig

    # ---- traits: what the method is, declared on its class (presets, export, the CLI and the tests read them) ----
    order: float = math.inf  # place in tables and in `--methods all` (docs/DESIGN.md §6; a plugin's: after, by name)
    default_for: tuple[str, ...] = ("two-domain", "sequence")  # protocols whose `--methods all` runs it
    trains = MODULES  # ALL: every weight of the model; WEIGHTS: some of the model's own weights (its FFNs, their
    # singular directions); MODULES: its own modules only (those it injects, or the FFNs of a base of its kind)
    injects = True  # adds modules to the model (False: trains the model's weights in place; so, on its own base,
    # does a method with a base of its kind, `base_config`)
    merges = False  # `merge` folds it exactly into the base weights (merge_and_unload; export writes merged weights)
    export_form: str | None = None  # PEFT: export writes a PEFT adapter (a local transformers base, one task);
    # None: merged weights where it merges or injects nothing, else the forgetless folder (export.form_of)
    grows = False  # adds modules for every task (on_task_start; from_pretrained grows them again)
    unshardable = "it was not tested under FSDP2"  # why --fsdp (Adapted.shard) refuses it; "": it shards, tested with
    # 2 gloo processes against one on a task stream (tests/test_fsdp.py)
    needs_previous = False  # start_task needs the data learned last (EWC's Fisher)
    mixes_original = False  # its mixed rows must be original-distribution data, never earlier tasks (Neutral's l1)
    reads_retained = ""  # the term that acts on the batch's retained rows of old data (e.g. a KL term); "": none
    pretrained_lr: float | None = None  # its lr on a pretrained model (presets real, real-full; adapt --data);
    # None: FINE_TUNING_LR where it trains the model's own weights with no lr of its own, else its config's
    start_copies: tuple[str, ...] = ()  # hook_state prefixes holding the weights at the task's start (EWC's anchor):
    # not saved for task 1 when they are the base's, which from_pretrained gets from the base it loads onto
    # token_weights(logits (B, T, V), batch) -> (B, T) weights of each token's LM loss (None: all 1), e.g. to gate
    # updates by entropy; a method that defines it gets every position's logits (None here: only scored ones)
    token_weights = None
    # live_stats(model, windows (W, T+1)) -> {key: JSON-able}: what `forgetless serve`'s dashboard draws of the model
    # from each document it learns (GET /v1/stats; APN: `usage`, its patch usage per layer); None: nothing
    live_stats = None
    copies = 0  # copies of the trained parameters it keeps as state (EWC: Fisher and anchor, 2): memory_text
    takes_terms = True  # `METHOD+TERM` composes protecting terms with it (False: it anchors itself, e.g. ewc)
    attach_rounding = 0.0  # attach and start_task(1) change no logit bit for bit (the protocols reuse the base's
    # scores for the attached model's first point); > 0: by up to this much (tests/test_contract.py checks either)
    prefix_once = False  # its modules act on each token alone and its terms read nothing its training forward left:
    # the unscored prompt every row of a batch starts with may run once for the batch (loss.shared_prompt)

    @classmethod
    def pretrained_options(cls) -> dict:
        """The options it starts from on a pretrained model: its `pretrained_lr`, else FINE_TUNING_LR where it trains
        the model's own weights (`trains` ALL or WEIGHTS) and its config sets no lr (a pretrained model's weights
        take the usual fine-tuning lr; the presets' 5e-4 suits small added modules and wrecks them)."""
        lr = cls.pretrained_lr
        own_lr = next(f.default for f in fields(cls.Config) if f.name == "lr")
        if lr is None and cls.trains != MODULES and own_lr is None:
            lr = FINE_TUNING_LR
        return {} if lr is None else {"lr": lr}

    def __init__(self, cfg: MethodConfig):
        self.cfg = cfg

    def own(self, option: str, default):
        """This method's own `option` (lr, mix or optimizer) where its config sets one, else the protocol's `default`."""
        value = getattr(self.cfg, option)
        return default if value is None else value

    def training_config(self, cfg):
        """`cfg` (an AdaptConfig or TrainConfig) with this method's own lr, mix and optimizer where it sets them."""
        return dataclasses.replace(cfg, **{k: self.own(k, getattr(cfg, k)) for k in ("lr", "mix", "optimizer") if hasattr(cfg, k)})

    def base_config(self, model_cfg: GPTConfig) -> GPTConfig:
        """Model config of the pretrained base this method starts from (default: the dense base)."""
        return model_cfg

    def check_base(self, model: nn.Module):
        """Refuse a model this method cannot run on: a forgetless GPT whose FFN is not the one
        `base_config` asks for, another model when the method needs a forgetless FFN kind, or a quantized
        base (packed 4/8-bit weights) when it trains the model's own weights."""
        self.check_quantized(quantized(model))
        if isinstance(model, GPT):
            need, have = ffn_signature(self.base_config(model.config)), ffn_signature(model.config)
            if need != have:
                diff = ", ".join(f"{k}={need.get(k)} (this base: {have.get(k)})" for k in need if need.get(k) != have.get(k))
                raise ForgetlessError(f"method {self.name} needs a base with {diff}; pretrain one with that model "
                                      "config (bench does), or choose a method for this base")
        elif (kind := self.base_config(GPTConfig()).ffn) != "dense":
            raise ForgetlessError(f"method {self.name} needs a forgetless GPT with {kind} FFNs; on "
                                  f"{type(model).__name__} use a method that attaches beside the MLP "
                                  "(e.g. apn-retrofit, adapter, lora)")

    def check_quantized(self, bits: str | None):
        """Refuse a base quantized to `bits` ('4bit', '8bit'; None: not quantized) where this method trains the
        model's own weights (packed integers there, not trainable)."""
        if bits and bits != "none" and self.trains != MODULES:
            raise ForgetlessError(f"method {self.name} trains the model's own weights, which are {bits}-quantized "
                                  "(packed, not trainable) here; use a method that trains added modules, e.g. lora "
                                  "(QLoRA) or seq-lora, or load the base unquantized")

    def attach(self, model: nn.Module) -> nn.Module:
        """Insert this method's modules into `model` (in place) and return it."""
        return model

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs to train; everything else is frozen."""
        raise NotImplementedError

    def extra_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor | None:
        """A loss added to the LM loss (after the forward pass of `batch`)."""
        return None

    def penalties_first(self, model: nn.Module):
        """A context around a training forward and its loss in which the weight penalties are made first (Composed)."""
        return contextlib.nullcontext()

    def report(self, model: nn.Module, windows_a: torch.Tensor, windows_b: torch.Tensor) -> dict:
        """Method-specific diagnostics of `model` on held-out windows of A and B (JSON-able)."""
        return {}

    def task_report(self, model: nn.Module, windows: list[torch.Tensor]) -> dict:
        """Sequence protocol: diagnostics on every task's held-out windows (JSON-able), after each task."""
        return {}

    def remember(self, model: nn.Module, data):
        """Before a task: `data` is what the model learned last (a Domain, or (N, T+1) token windows);
        methods that protect it (EWC) take what they need from it."""

    def on_task_start(self, model: nn.Module, task: int):
        pass

    def on_task_end(self, model: nn.Module, task: int):
        pass

    def state_dict(self, model: nn.Module, injected: set[str]) -> dict[str, torch.Tensor]:
        """This method's own tensors: every parameter it injected (names in `injected`) or trains."""
        own = injected | {name for name, _ in self.trainable_parameters(model)}
        return {name: p.detach() for name, p in model.named_parameters() if name in own}

    def load_state_dict(self, model: nn.Module, tensors: dict[str, torch.Tensor]):
        own = dict([*model.named_parameters(), *model.named_buffers()])
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise ForgetlessError(f"method state has tensors the model lacks ({unknown[0]}, ...); attach the method first")
        for name, t in tensors.items():
            if t.shape != own[name].shape:
                raise ForgetlessError(f"method state {name} has shape {tuple(t.shape)} but the attached {self.name} has "
                                      f"{tuple(own[name].shape)}; attach it with the options it was saved with "
                                      "(e.g. sizes such as width or retrofit_size)")
        with torch.no_grad():
            for name, t in tensors.items():
                own[name].copy_(t)

    def merge(self, model: nn.Module) -> nn.Module:
        """Fold the injected modules into the base weights and remove them, where that is exact."""
        raise ForgetlessError(f"method {self.name} adds non-linear modules that cannot be folded into the base "
                              "weights; save it with save_pretrained and load it with forgetless.from_pretrained")

    def options(self) -> dict:
        """The config's fields; `joint` only where it differs from the method's default, so arms saved before
        it existed keep their cache keys."""
        return {f.name: getattr(self.cfg, f.name) for f in fields(self.cfg)
                if f.name != "joint" or getattr(self.cfg, f.name) != f.default}


def quantized(model: nn.Module) -> str | None:
    """'4bit' or '8bit' where `model` holds bitsandbytes-quantized layers (Linear4bit, Linear8bitLt), else None."""
    for m in model.modules():
        if type(m).__module__.startswith("bitsandbytes"):
            return "4bit" if "4bit" in type(m).__name__ else "8bit"
    return None


class Term:
    """A protecting term over the parameters a method trains, composed with it as `METHOD+NAME[OPTION=VALUE;...]`
    (Composed): it may take what it needs from the previous task's rows (`remember`, e.g. EWC's Fisher), read
    the weights the trainable parameters had at the task's start (`Composed.start`: EWC's anchor, distillation's
    teacher) and add a loss."""
    name = "term"
    Config: type = object  # a dataclass of its options
    needs_previous = False  # needs the data learned last (Method.needs_previous)
    reads_retained = ""  # acts on the batch's retained rows (Method.reads_retained)
    copies = 0  # copies of the trained parameters it keeps besides the composition's one start copy (EWC: Fisher)
    unshardable = "it was not tested under FSDP2"  # Method.unshardable; a composition shards where all its parts do
    weight_penalty = False  # its loss is a function of the trained weights alone (EWC's penalty): made before the
    # forward (Composed.penalties_first), so that its gradients come last, one parameter at a time
    default_mix: float | None = None  # the composition's mix where the method sets none (rows for the term to read)
    prefix_once = False  # it reads nothing the batch's forward left (Method.prefix_once; a composition's: all parts')

    def __init__(self, cfg):
        self.cfg = cfg

    def remember(self, method: "Method", model: nn.Module, data):
        """At the task's start, after the method's own start: `data` is what the model learned last."""

    def loss(self, method: "Method", model: nn.Module, batch: Batch) -> torch.Tensor | None:
        return None

    def hook_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_hook_state(self, tensors: dict[str, torch.Tensor]):
        pass


# ---- terms composed with a method --------------------------------------------------------------------------------
class Composed(Method):
    """A method plus protecting terms: `lora+ewc`, `lora[r=16]+distill[beta=0.5]`, `neutral+distill`, `moram+ewc`.

    The method chooses what trains (its modules, or the model's own weights); each term (EWC's Fisher penalty,
    distillation's KL to the task's starting model) acts on exactly that set. State lives only over the trainable
    parameters: at every task's start the composition keeps one copy of them (`start`, in the model's dtype), which
    is EWC's anchor and, run through the model's own forward with `torch.func.functional_call`, distillation's
    teacher. For a method that injects modules (LoRA, adapters, atoms) that copy is the modules' few weights, so the
    teacher is the model at the task's start without a copy of the base (at task 1 the base itself: LoRA's B is 0);
    for full fine-tuning it is a copy of every weight, as in `ewc` and `distill`, which are full+ewc and full+distill.

    `base` gives what trains, its modules and hooks; `terms` add to its loss; traits are the base's, plus the
    terms' need for old rows."""

    def __init__(self, cfg, base: Method, terms: list, label: str | None = None):
        super().__init__(cfg)
        self.base, self.terms, self.label = base, terms, label
        self.start: dict[str, torch.Tensor] = {}  # the trainable parameters at the task's start
        self.previous = None  # rows of the task learned last, for the terms at on_task_start
        self.early: dict[int, torch.Tensor] = {}  # weight penalties made before the forward (penalties_first)
        if label:  # `METHOD+TERM`: the method's traits, and the terms' needs (a registered one declares its own)
            for trait in ("name", "order", "trains", "injects", "merges", "export_form", "grows", "mixes_original",
                          "token_weights", "live_stats", "attach_rounding", "pretrained_lr", "default_for"):
                setattr(self, trait, label if trait == "name" else getattr(base, trait))
            self.takes_terms = False
            self.unshardable = base.unshardable or next((f"its term {t.name}: {t.unshardable}" for t in terms
                                                         if t.unshardable), "")
            self.copies = base.copies + 1 + sum(t.copies for t in terms)  # + the start copy
            self.needs_previous = base.needs_previous or any(t.needs_previous for t in terms)
            self.prefix_once = base.prefix_once and all(t.prefix_once for t in terms)
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
        parts = [self.base.extra_loss(model, batch)]  # first: it reads what the batch's forward left (Neutral's)
        parts += [self.early.pop(id(term)) if id(term) in self.early else term.loss(self, model, batch)
                  for term in self.terms]
        parts = [t for t in parts if t is not None]
        return sum(parts) if parts else None

    @contextlib.contextmanager
    def penalties_first(self, model):
        """Within it, the terms that are functions of the trained weights alone (EWC's penalty) are made on entry,
        before the forward, and extra_loss takes them. Autograd runs the backward of later-made nodes first: made
        after the forward, the penalty's gradients (one whole set of the trained parameters) would be made at the
        backward's start and wait through it; made before, each parameter's comes last, one at a time, added to
        what the LM loss left. The same loss; the gradients summed in another order (not under FSDP)."""
        params = self.trainable_parameters(model)
        if torch.is_grad_enabled() and model.training and not any(is_shard(p) for _, p in params):
            made = {id(t): t.loss(self, model, None) for t in self.terms if t.weight_penalty}
            self.early = {k: v for k, v in made.items() if v is not None}  # None: not started yet (extra_loss asks again)
        try:
            yield
        finally:
            self.early = {}

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


def copy_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, on its own device (e.g. the weights a task started from)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def matches(name: str, rules: list[str]) -> bool:
    """PEFT-style rule: one pattern with regex characters is a full match on the full name;
    otherwise each entry is a suffix (the full name equals it or ends with '.' + it)."""
    if not rules:
        return False
    if is_regex(rules):
        return re.fullmatch(rules[0], name) is not None
    return any(name == r or name.endswith("." + r) for r in rules)


def is_regex(rules: list[str]) -> bool:
    """One rule with regex characters is a regex (matched on the full name), as in PEFT."""
    return len(rules) == 1 and re.search(r"[\\^$*+?()\[\]|]", rules[0]) is not None


def find_modules(model: nn.Module, target: list[str], exclude: list[str]) -> list[tuple[str, nn.Module]]:
    """Modules of `model` matching `target` and not `exclude`; `all-linear` = every linear layer
    (nn.Linear or transformers Conv1D) but the output head."""
    if target == [ALL_LINEAR]:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
        found = [(n, m) for n, m in model.named_modules() if linear_shape(m) and m is not head and not matches(n, exclude)]
    else:
        found = [(n, m) for n, m in model.named_modules() if n and matches(n, target) and not matches(n, exclude)]
    if not found:
        raise ForgetlessError(
            f"target_modules {target} match no module of {type(model).__name__}; "
            "pass names that exist (see model.named_modules()), e.g. mlp or c_fc, or all-linear")
    return found


FFN_NAMES = ("mlp", "feed_forward", "ffn", "mlp_block", "block_sparse_moe")  # tried first; the structure decides


def find_ffns(model: nn.Module, target: list[str], exclude: list[str]) -> list[tuple[str, nn.Module]]:
    """The FFN (MLP) blocks a method puts its modules beside or trains: the modules `target` names
    (find_modules), or with an empty `target` every decoder layer's FFN found from the structure (ffn_blocks)."""
    return find_modules(model, target, exclude) if target else ffn_blocks(model, exclude)


def ffn_blocks(model: nn.Module, exclude: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, FFN) of every decoder layer of `model`, found from its structure, not from a per-family list.

    The decoder layers are the children of the model's largest nn.ModuleList (by parameters). In each layer
    the FFN is, in turn: a child named as in FFN_NAMES (mlp, feed_forward, ffn, ...); else a child that looks
    like one (`looks_like_ffn`: one input, linears from width d back to d, not attention); else, where the
    layer holds the FFN's linears itself (OPT: fc1, fc2), an FFNSpan named by the layer: from its first
    direct linear (d -> h) to the last direct linear back to d. Modules matching `exclude` are left out."""
    found = []
    for name, layer in decoder_layers(model):
        if (ffn := ffn_of(layer)) is not None:
            child, module = ffn
            full = f"{name}.{child}" if child else name
            if not matches(full, exclude or []):
                found.append((full, module))
    if not found:
        raise ForgetlessError(
            f"found no MLP block in the decoder layers of {type(model).__name__} (no child named "
            f"{'/'.join(FFN_NAMES)}, no one-input module of linears d -> ... -> d, no fc1/fc2-like linears on the "
            "layer); pass target_modules with the name of each layer's FFN module (see model.named_modules())")
    return found


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of the repeated blocks of `model`: the children of its nn.ModuleList with the most
    parameters (the outermost where lists nest)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, layers = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return [(f"{name}.{i}" if name else str(i), layer) for i, layer in enumerate(layers)]


def ffn_of(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(child name, FFN) of one decoder layer ('' and an FFNSpan where the FFN's linears sit on the layer)."""
    children = dict(layer.named_children())
    for name in FFN_NAMES:
        if name in children and not linear_shape(children[name]) and any(True for _ in children[name].parameters()):
            return name, children[name]
    for name, child in children.items():
        if looks_like_ffn(name, child):
            return name, child
    direct = [(name, child) for name, child in children.items() if linear_shape(child)]
    if len(direct) >= 2:
        d = linear_shape(direct[0][1])[0]
        ends = [i for i, (_, child) in enumerate(direct) if i and linear_shape(child)[1] == d]
        if ends:
            return "", FFNSpan(layer, [name for name, _ in direct[:ends[-1] + 1]])
    return None


def linears(module: nn.Module) -> list[tuple[int, int]]:
    """(d_in, d_out) of every linear in `module`, in registration order."""
    return [shape for m in module.modules() if (shape := linear_shape(m))]


def looks_like_ffn(name: str, module: nn.Module) -> bool:
    """A layer's child that is an FFN by structure: two or more linears, the first taking the width the last
    gives back (d -> ... -> d), a forward of one input (attention takes masks, positions or a cache) and no
    attention in its name."""
    shapes = linears(module)
    if linear_shape(module) or len(shapes) < 2 or shapes[0][0] != shapes[-1][1]:
        return False
    if re.search("attn|attention", f"{name} {type(module).__name__}", re.IGNORECASE):
        return False
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (bool(params) and params[0].kind in positional
            and all(p.default is not inspect.Parameter.empty and p.kind in positional for p in params[1:]))


def put_beside(model: nn.Module, name: str, target: nn.Module, new: nn.Module):
    """Add `new` beside the FFN `target` found at `name` (find_ffns): the FFN's output becomes
    FFN(x) + new(x), x the FFN's input (Beside, or an FFNSpan's wrapped first and last linears)."""
    if isinstance(target, FFNSpan):
        target.put_beside(new)
    else:
        replace_module(model, name, Beside(target, new))


def default_linear_targets(model: nn.Module) -> list[str]:
    """The linears LoRA-style methods wrap when target_modules is empty: on the forgetless GPT every
    linear of the blocks (c_attn, c_proj, c_fc); on a transformers model PEFT's default for its
    architecture (q_proj, v_proj for Llama, Qwen, Mistral; c_attn for GPT-2), else all-linear."""
    if isinstance(model, GPT):
        return ["c_attn", "c_proj", "c_fc"]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS
    return list(PEFT_DEFAULTS.get(getattr(getattr(model, "config", None), "model_type", None)) or [ALL_LINEAR])


def replace_module(model: nn.Module, name: str, new: nn.Module):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
