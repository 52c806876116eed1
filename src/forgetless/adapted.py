"""`forgetless.attach(model, method)`: one object that owns "this method on this model" (docs/DESIGN.md §7).

Like PEFT, attaching injects the method's modules into the model in place and freezes what the
method does not train; the returned `Adapted` is an nn.Module whose forward is the model's. It runs
the method's hooks in the documented order, builds the training loss, saves and loads the method's
own tensors, and keeps every tensor on the model's device and dtype.

    adapted = forgetless.attach(model, "lora", r=16)
    adapted.start_task(1)               # optional for most methods: the first training forward starts task 1
    out = adapted(input_ids=ids, attention_mask=mask, labels=labels, retained=old_rows)
    out.loss.backward()                 # in training mode: the LM loss + the method's terms (any loop, Trainer)
    adapted.save_pretrained("out/")
    again = forgetless.from_pretrained(fresh_model, "out/")
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from forgetless import __version__, distributed
from forgetless.checkpoint import load_checkpoint, save_checkpoint, shared, writable_dir, write_json
from forgetless.loss import loss_terms, training_loss
from forgetless.data.splits import Batch
from forgetless.device import resolve_device
from forgetless.errors import ForgetlessError
from forgetless.export import check_empty, export_adapted
from forgetless.methods import Method, build_method
from forgetless.methods.base import MODULES, MethodSpec, parse_method_specs, saved_options
from forgetless.models.gpt import GPT

WEIGHTS, CONFIG = "adapter_model.safetensors", "forgetless_config.json"


def attach(model: nn.Module, method: str | MethodSpec | Method, **options) -> "Adapted":
    """Inject `method` ("lora", "lora[r=16]", a MethodSpec or a built Method) into `model`, in place."""
    return Adapted(model, as_method(method, options))


def as_method(method, options: dict) -> Method:
    if isinstance(method, Method):
        if options:
            raise ForgetlessError("options go with a method name, not with a built Method")
        return method
    if isinstance(method, str):
        specs = parse_method_specs(method)
        if len(specs) != 1:
            raise ForgetlessError(f"attach takes one method, got {method!r}")
        method = specs[0]
    built = MethodSpec(method.name, {**method.options, **options}).build()
    if built.cfg.joint:
        warn(f"{method.label}: joint (all tasks of a sequence at once) acts only in the task-sequence benchmark; "
             "attached, it is plain fine-tuning: train it on all tasks' rows mixed yourself")
    return built


class Adapted(nn.Module):
    """A model with a method attached. Attribute lookups it does not know go to the model
    (e.g. `adapted.config`, `adapted.generate` on a transformers model)."""

    def __init__(self, model: nn.Module, method: Method):
        super().__init__()
        method.check_base(model)
        self.base_fingerprint = architecture_fingerprint(model)
        self.device, self.dtype = placement(model)
        self._base = {id(t) for t in [*model.parameters(), *model.buffers()]}
        self._base_modules = {id(m) for m in model.modules()}
        with torch.device(self.device):
            model = method.attach(model)
        self.model = model
        self.method = method
        self.task = 1
        self._started = False  # start_task has run (the first training forward runs it when nobody did)
        self._trained = False  # a training forward has run
        self._start_is_base = False  # task 1 started on the attached weights: start copies need not be saved
        self._said: set[str] = set()  # warnings given once
        self._follow_model()
        if method.trains != MODULES and self.dtype in (torch.bfloat16, torch.float16):
            warn(f"{method.name} trains the model's own {str(self.dtype)[6:]} weights in place, with no float32 master "
                 "copy: updates smaller than the weights' rounding step (about 1/256 of a weight in bf16) are lost; load "
                 "the model in fp32 (--dtype fp32) with --precision bf16 for mixed precision, or use an adapter method")

    # ---- the model ------------------------------------------------------------------------
    accepts_loss_kwargs = False  # transformers' Trainer: the loss is a mean per batch; Trainer scales it for accumulation

    @property
    def _hf_peft_config_loaded(self) -> bool:
        """transformers' Trainer refuses to train a quantized model without trainable adapters attached; a method
        that trains only its own modules is such adapters."""
        return self.method.trains == MODULES

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, retained: torch.Tensor | None = None, **kwargs):
        """The model's forward on input_ids (B, T), other arguments passed through. With `labels` (B, T)
        (transformers' convention: aligned with input_ids, -100 = not scored) the output's `.loss` is, in
        training mode, the whole training loss: the LM loss plus the method's terms (EWC's penalty,
        distillation's KL and Neutral's l1 on the `retained` (B,) rows of old data, auxiliary losses,
        token weights), the number `adapted.loss(batch)` gives; in eval mode the LM loss alone."""
        if input_ids is None:
            return self.model(attention_mask=attention_mask, labels=labels, **kwargs)
        self._check_padding(input_ids, attention_mask)
        with self.method.penalties_first(self.model) if labels is not None else contextlib.nullcontext():
            if isinstance(self.model, GPT):  # causal and unmasked: right padding is what it reads correctly
                out = self.model(input_ids, **{k: v for k, v in kwargs.items() if k != "logits_to_keep"})
            else:
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            if labels is None:
                return out
            batch = Batch.of_hf(input_ids, attention_mask, labels, retained)
            if self.model.training:
                self._check_training(retained is not None)
                loss, _ = loss_terms(self.model, logits_of_output(out), batch.y, batch, self.method.extra_loss,
                                     self.method.token_weights)
            else:
                _, loss = loss_terms(self.model, logits_of_output(out), batch.y, batch)
        return with_loss(out, loss)

    def _check_padding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """Refuse padding a model would read wrongly: left padding without a mask (transformers), any
        padding but on the right (our GPT)."""
        if attention_mask is not None:
            if isinstance(self.model, GPT) and (attention_mask.diff(dim=1) > 0).any():
                raise ForgetlessError("the forgetless GPT takes no attention mask: pad batches on the right "
                                      "(forgetless.data.Collator does)")
            return
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        first = input_ids[:, 0] == pad if isinstance(pad, int) and len(input_ids) > 1 else None
        if first is not None and first.any() and not first.all() and self._once("left padding"):
            warn(f"rows of input_ids start with the pad token {pad} but no attention_mask was given: left padding "
                 "without a mask is read as text; pass attention_mask (or pad on the right)")

    def _check_training(self, has_retained: bool):
        """Start task 1 at the first training forward if nobody did; say once what cannot act."""
        if not self._started:
            self.start_task(self.task)  # a method that needs the previous task's data raises here
        uses = self.method.reads_retained or bool(getattr(self.method.cfg, "mix", None))
        if uses and not has_retained and self._once("retained"):
            what = self.method.reads_retained or f"mix={self.method.cfg.mix} (replay)"
            warn(f"{self.method.name}: {what} acts on rows of old data, but the batches carry no `retained` "
                 "marker, so it does nothing; mix old rows in with forgetless.data.mix(new, old) and "
                 "forgetless.data.Collator (or pass retained=(B,) bools)")
        self._trained = True

    def _once(self, what: str) -> bool:
        """True the first time `what` is asked about on this Adapted."""
        first = what not in self._said
        self._said.add(what)
        return first

    def state_dict(self, *args, **kwargs):
        """The module's state_dict with each tied weight once (e.g. lm_head = embed_tokens): safetensors,
        and so transformers' Trainer checkpoints, refuse aliased tensors; load_state_dict restores them."""
        out = super().state_dict(*args, **kwargs)
        for alias in shared(out):
            out.pop(alias)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state_dict = dict(state_dict)
        for alias, name in shared(super().state_dict(keep_vars=True)).items():
            if alias not in state_dict and name in state_dict:
                state_dict[alias] = state_dict[name]
        return super().load_state_dict(state_dict, strict, assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.method.trainable_parameters(self.model)

    def print_trainable(self):
        trainable = sum(p.numel() for _, p in self.trainable_parameters())
        total = sum(p.numel() for p in self.model.parameters())
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")

    def shard(self, precision: str = "fp32", device: torch.device | str | None = None):
        """FSDP over the processes of torchrun (distributed.shard_model), after attaching and before training;
        methods that need whole tensors in their hooks or state refuse. On ranks other than 0 the model may be on the
        meta device (`distributed.meta_unless_main`): it gets its shards of rank 0's weights on `device` (default:
        this rank's GPU, else the CPU). `precision` bf16: FSDP's bf16 mixed precision (gradients reduced in fp32)."""
        check_fsdp(self.model, self.method)
        if self.device.type == "meta":
            self.device = resolve_device(device or "auto")
        base = {name for name, t in self._named_tensors() if id(t) in self._base}
        distributed.shard_model(self.model, self.device, precision)  # replaces the parameters by shards (same names)
        self._base = {id(t) for name, t in self._named_tensors() if name in base}

    def _named_tensors(self):
        return [*self.model.named_parameters(), *self.model.named_buffers()]

    def injected(self) -> set[str]:
        """Names of the parameters the method added to the model."""
        return {name for name, p in self.model.named_parameters() if id(p) not in self._base}

    def _follow_model(self):
        """New tensors on the model's device and floating dtype, new modules (and this one) in its training mode
        (an eval model stays one: e.g. MoRAM's evaluation threshold acts); freeze all but what the method trains."""
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in self._base and (t.device != self.device or t.is_floating_point() and t.dtype != self.dtype):
                t.data = t.data.to(self.device, self.dtype if t.is_floating_point() else t.dtype)
        for m in self.model.modules():
            if id(m) not in self._base_modules:
                m.training = self.model.training
        self.training = self.model.training
        for p in self.model.parameters():
            p.requires_grad_(False)
        for _, p in self.trainable_parameters():
            p.requires_grad_(True)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        """transformers' gradient checkpointing of the model (what Trainer calls with gradient_checkpointing=True);
        the reentrant variant (transformers 4's default) with the embedding's output requiring grad, so the method's
        modules inside checkpointed layers get gradients (models.hf.gradient_checkpointing)."""
        from forgetless.models.hf import gradient_checkpointing
        import transformers
        default = int(transformers.__version__.split(".")[0]) < 5  # 4.x checkpoints reentrantly by default
        gradient_checkpointing(self.model, (gradient_checkpointing_kwargs or {}).get("use_reentrant", default))

    # ---- tasks and the loss ---------------------------------------------------------------
    def start_task(self, task: int, previous=None):
        """Before training task `task` (1, 2, ...): `previous` is what the model learned last, which
        methods that protect it need (EWC's Fisher): rows of old data (a dataset or list of examples with
        input_ids and labels, e.g. from forgetless.data.load), (N, T+1) token windows, or a Domain."""
        if previous is None and self.method.needs_previous:
            raise ForgetlessError(f"method {self.method.name} protects what the model knew before: call "
                                  "adapted.start_task(1, previous=old_rows) before training (rows of old data, e.g. "
                                  "forgetless.data.load(old_file, tokenizer)), or pass them to "
                                  "forgetless.ForgetlessCallback(adapted, previous=old_rows) in Trainer")
        if previous is not None:
            self.method.remember(self.model, previous)
        with torch.device(self.device):
            self.method.on_task_start(self.model, task)
        self.task, self._started = task, True
        self._start_is_base = task == 1 and not self._trained
        self._follow_model()

    def end_task(self, task: int):
        self.method.on_task_end(self.model, task)

    def losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(training loss, LM loss alone) of `batch` ((B, T+1) token windows, a Batch, or a dict of
        input_ids, attention_mask, labels and retained as `forward` takes them): LM loss (token-weighted
        if the method says so) + the modules' auxiliary losses + the method's extra loss."""
        if self.model.training:
            self._check_training(isinstance(batch, Batch) or isinstance(batch, dict) and
                                 ("retained" in batch or "from_other" in batch))
        batch = Batch.of(batch).to(self.device)
        with self.method.penalties_first(self.model):
            return training_loss(self.model, batch, self.method.extra_loss, self.method.token_weights,
                                 self.method.prefix_once)

    def loss(self, batch) -> torch.Tensor:
        return self.losses(batch)[0]

    # ---- diagnostics ----------------------------------------------------------------------
    def report(self, windows_a: torch.Tensor | None = None, windows_b: torch.Tensor | None = None) -> dict:
        """What is attached, and the method's diagnostics on held-out windows (W, T+1) of the original
        (A) and new (B) data when given."""
        out = {"method": self.method.name, "options": self.method.options(), "task": self.task,
               "trainable_params": sum(p.numel() for _, p in self.trainable_parameters()),
               "total_params": sum(p.numel() for p in self.model.parameters())}
        if windows_a is not None:
            out.update(self.method.report(self.model, windows_a, windows_a if windows_b is None else windows_b))
        return out

    def figures(self, out_dir: str | Path, windows_a: torch.Tensor | None = None,
                windows_b: torch.Tensor | None = None) -> list[Path]:
        """The figures of the method's diagnostics on held-out windows of A and B (report/diagnostics.py;
        methods whose diagnostics need no data draw without them); returns the files written."""
        from forgetless.report.diagnostics import method_figures
        from forgetless.report.results import MethodEntry, RunResult
        arm = MethodEntry(self.method.name, self.method.options(), sum(p.numel() for _, p in self.trainable_parameters()),
                          sum(p.numel() for p in self.model.parameters()),
                          stats={"report": {"after": self.report(windows_a, windows_b)}})
        return method_figures(RunResult("attach", {self.method.name: arm}), writable_dir(out_dir))

    # ---- saving ---------------------------------------------------------------------------
    def method_state(self) -> dict[str, torch.Tensor]:
        """The method's tensors, whole (gathered from every rank under FSDP)."""
        return distributed.full(self.method.state_dict(self.model, self.injected()))

    def save_pretrained(self, out_dir: str | Path):
        """Write the method's tensors (and loop state, e.g. EWC's Fisher) as safetensors plus a JSON
        config: method, options, task, forgetless version and the base architecture's fingerprint. Copies
        of the weights at the start of task 1 (EWC's anchor, distillation's teacher) are the base's and are
        not written: from_pretrained takes them from the base it loads onto."""
        out_dir = writable_dir(out_dir)
        hooks = self.method.hook_state()
        from_base = [p for p in self.method.start_copies if self.task == 1 and self._start_is_base
                     and any(k.startswith(p) for k in hooks)]
        hooks = {k: v for k, v in hooks.items() if not k.startswith(tuple(from_base))}
        tensors = {**self.method_state(), **{f"hooks.{k}": v for k, v in hooks.items()}}
        save_checkpoint(out_dir / WEIGHTS, tensors, {"kind": "method", "method": self.method.name})
        write_json(out_dir / CONFIG, {"method": self.method.name, "options": self.method.options(), "task": self.task,
                                      "forgetless_version": __version__, "base": self.base_fingerprint,
                                      **({"from_base": from_base} if from_base else {})})

    def export(self, out_dir: str | Path, tokenizer=None) -> tuple[str, Path]:
        """Write the adapted model in the most portable form (forgetless.export): a PEFT adapter naming
        the local base folder (LoRA), a merged transformers folder (methods that fold into the weights),
        else the forgetless folder with LOADING.md; with the tokenizer when given. Returns (form, folder)."""
        check_empty(Path(out_dir))
        distributed.barrier()  # every rank has looked before rank 0 writes
        return export_adapted(self, None, tokenizer, Path(out_dir))

    def merge_and_unload(self) -> nn.Module:
        """The plain model with the method folded into its weights (LoRA); methods that inject nothing
        give the model back; other methods raise a clear error."""
        return self.method.merge(self.model) if self.injected() else self.model


def from_pretrained(model: nn.Module, folder: str | Path) -> Adapted:
    """Attach the method saved by `Adapted.save_pretrained` in `folder` to `model` and load its tensors;
    refuses a base of another architecture."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ForgetlessError(f"{folder} holds no saved method ({CONFIG} and {WEIGHTS}); "
                              "give a folder written by Adapted.save_pretrained")
    config = json.loads((folder / CONFIG).read_text())
    have = architecture_fingerprint(model)
    if have != config["base"]:
        raise ForgetlessError(f"{folder} was saved on a {config['base']['class']} base of another architecture "
                              f"(fingerprint {config['base']['hash']}, this {have['class']}: {have['hash']}); "
                              "load it onto the model it was trained on")
    adapted = attach(model, build_method(config["method"], saved_options(config["method"], config["options"])))
    for task in range(2, config["task"] + 1):  # grow what grows per task (MoRAM atoms, MoE-LoRA experts)
        with torch.device(adapted.device):
            adapted.method.on_task_start(adapted.model, task)
    adapted.task = config["task"]
    start = {f"{prefix}{n}": p.detach().clone() for prefix in config.get("from_base", [])
             for n, p in adapted.model.named_parameters()}  # the base's weights, before the method's are loaded
    adapted._start_is_base, adapted._started = bool(start), True
    tensors, _ = load_checkpoint(folder / WEIGHTS)
    adapted.method.load_state_dict(adapted.model, {k: v for k, v in tensors.items() if not k.startswith("hooks.")})
    adapted.method.load_hook_state({**start, **{k[len("hooks."):]: v for k, v in tensors.items() if k.startswith("hooks.")}})
    adapted._follow_model()
    return adapted


class ForgetlessWarning(UserWarning):
    """A method's term that cannot act where it is used (e.g. replay with no rows of old data)."""


def warn(message: str):
    warnings.warn(message, ForgetlessWarning, stacklevel=3)


def logits_of_output(out) -> torch.Tensor:
    """(B, T, V) logits of a transformers output or of our GPT (a tensor)."""
    return out.logits if hasattr(out, "logits") else out


def with_loss(out, loss: torch.Tensor):
    """The forward's output with `.loss`: a transformers ModelOutput (loss first, as theirs), or for our
    GPT's logits a CausalLMOutput of loss and logits."""
    if torch.is_tensor(out):
        from transformers.modeling_outputs import CausalLMOutput
        return CausalLMOutput(loss=loss, logits=out)
    return type(out)(**{**out, "loss": loss})


def check_fsdp(model: nn.Module | None, method: Method):
    """Refuse FSDP (Adapted.shard) for a method, model or launch it does not run on (None: the model is not
    loaded yet)."""
    if method.unshardable:
        raise ForgetlessError(f"method {method.name} does not shard under --fsdp: {method.unshardable}; use "
                              f"{sharding_peer(method)}, or drop --fsdp to run it with data parallelism")
    distributed.check_shardable(model)


def sharding_peer(method: Method) -> str:
    """A registered method that shards under FSDP and trains what `method` trains (its modules, model weights or
    every weight), in table order: what to use instead."""
    from forgetless.methods.base import METHODS, method_names
    peers = [n for n in method_names() if not METHODS[n].unshardable and METHODS[n].trains == method.trains]
    return (peers or ["lora"])[0]


def architecture_fingerprint(model: nn.Module) -> dict:
    """The model class and a hash of its parameter names and shapes (not values, not dtype)."""
    shapes = sorted((name, list(p.shape)) for name, p in model.state_dict().items())
    digest = hashlib.sha256(json.dumps([type(model).__name__, shapes]).encode()).hexdigest()[:16]
    return {"class": type(model).__name__, "hash": digest}


def placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the model's parameters."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    if not floats:
        raise ForgetlessError(f"{type(model).__name__} has no floating-point parameters to adapt")
    return floats[0].device, floats[0].dtype


