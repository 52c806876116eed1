"""Export an attached method in the form an inference stack loads (docs/DESIGN.md §7.5), from its traits
(`Adapted.export`; `forgetless export` for runs: continual/export_run.py):

    LoRA on a local transformers folder, one  a PEFT adapter folder whose base_model_name_or_path is that
    task                                      folder (AutoPeftModelForCausalLM.from_pretrained loads it alone)
    a method that folds exactly into weights  the merged model (transformers save_pretrained, or a
                                              forgetless base file for the byte GPT)
    anything else                             the forgetless folder (forgetless.from_pretrained) and
                                              a LOADING.md with the three lines that load it
"""
from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from forgetless import distributed
from forgetless.checkpoint import save_checkpoint, writable_dir
from forgetless.errors import ForgetlessError
from forgetless.methods.base import PEFT, quantized
from forgetless.models.gpt import GPT


def export_adapted(adapted, spec: str | None, tokenizer, out: Path) -> tuple[str, Path]:
    """Write `adapted` (an adapted.Adapted: it exports through this module, which so never imports it) on the base
    `spec` names (None: the folder the model was loaded from, if any) to `out` in the most portable form it allows;
    returns (form, folder)."""
    out = writable_dir(out)
    base = local_base(adapted.model, spec)
    form = form_of(adapted, base)
    if form == PEFT:
        return form, save_peft(adapted, out, tokenizer, str(base))
    if form == "merged":
        return form, save_merged(adapted.merge_and_unload(), out, tokenizer)
    adapted.save_pretrained(out)
    if distributed.is_main():
        (out / "LOADING.md").write_text(loading_example(spec or str(base or "hf:PATH"), out))
    return "forgetless", out


def local_base(model: nn.Module, spec: str | None) -> Path | None:
    """The local transformers folder (config.json and weights) the base was loaded from, or None (a GGUF
    file, a named model, our GPT): a PEFT adapter must name a base that transformers loads on its own."""
    if spec is not None:
        path = Path(spec[3:]) if spec.startswith("hf:") else None
    else:
        path = Path(getattr(getattr(model, "config", None), "_name_or_path", "") or ".")
    if path is None or path.suffix == ".gguf" or not (path / "config.json").is_file():
        return None
    return path.resolve()


def check_empty(out: Path):
    if out.is_file() or out.is_dir() and any(out.iterdir()):
        raise ForgetlessError(f"{out} exists and is not an empty folder; choose another one")


def form_of(adapted, base: Path | None) -> str:
    """How `adapted` is exported, from its method's traits: a PEFT adapter where its `export_form` says so, on a
    local transformers `base`, after one task (later tasks: merged); the merged model where it `merges` (not into
    a quantized base's packed weights) or injected nothing; else the forgetless folder."""
    method = adapted.method
    if method.export_form == PEFT and base is not None and adapted.task == 1:
        return PEFT
    merges = method.merges and not quantized(adapted.model)
    if distributed.sharded(list(adapted.model.named_parameters())):  # FSDP: merged weights are not gathered whole
        return "forgetless"
    return "merged" if merges or not adapted.injected() else "forgetless"


def save_peft(adapted, out: Path, tokenizer, spec: str) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, PEFT's key names) that
    `PeftModel.from_pretrained(base, out)` loads onto the base model."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    cfg = adapted.method.cfg
    targets = [n for n, m in adapted.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=short_names(adapted.model, targets), task_type="CAUSAL_LM",
                        base_model_name_or_path=spec,
                        fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in adapted.model.modules()))
    tensors = {f"base_model.model.{k}": v.contiguous().cpu() for k, v in adapted.method_state().items()}
    if distributed.is_main():  # under torchrun: every rank gathered the tensors, rank 0 writes
        config.save_pretrained(out)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        save_tokenizer(tokenizer, out)
    distributed.barrier()
    return out


def short_names(model: nn.Module, targets: list[str]) -> list[str]:
    """The targets' last name parts (q_proj, v_proj) where those select exactly the same modules of `model` (peft
    matches a target by suffix; serving engines such as SGLang take only the short form), else the full names."""
    short = sorted({t.rpartition(".")[2] for t in targets})
    selected = {n for n, _ in model.named_modules() if n.rpartition(".")[2] in short}
    return short if selected == set(targets) else targets


def save_merged(model: nn.Module, out: Path, tokenizer) -> Path:
    """The merged model: a forgetless base file for our GPT, else a transformers folder with its tokenizer."""
    if isinstance(model, GPT):
        save_checkpoint(out / "base.safetensors", {f"model.{k}": v for k, v in model.state_dict().items()},
                        {"kind": "base", "model_config": model.config.to_dict(), "tokenizer": tokenizer.to_dict()})
        return out
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer, out: Path):
    """A transformers tokenizer (or forgetless's TextTokenizer around one) beside the weights; None: none."""
    if tokenizer is not None:
        getattr(tokenizer, "hf", tokenizer).save_pretrained(out)


def loading_example(spec: str, out: Path) -> str:
    load = ("from forgetless.continual.base_model import load_base\n"
            "model = load_base(BASE)[0]  # BASE: the base checkpoint of the run (results.json, bases)"
            if spec == "byte-gpt" else
            f"from forgetless.models.hf import load_model\nmodel, tokenizer = load_model({spec!r})")
    return ("This method does not fold into the base weights; load it on its base with forgetless:\n\n"
            f"```python\nimport forgetless\n{load}\nadapted = forgetless.from_pretrained(model, {str(out)!r})\n```\n")
