"""`forgetless export RUN --method X --out DIR`: one trained arm of a bench run, in the form an
inference stack loads (docs/DESIGN.md §7.5).

    LoRA on a local transformers folder, one  a PEFT adapter folder whose base_model_name_or_path is that
    task                                      folder (AutoPeftModelForCausalLM.from_pretrained loads it alone)
    a method that folds exactly into weights  the merged model (transformers save_pretrained, or a
                                              forgetless base file for the byte GPT)
    anything else                             the forgetless folder (forgetless.from_pretrained) and
                                              a LOADING.md with the three lines that load it
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.nn as nn

from forgetless.adapted import CONFIG, Adapted, from_pretrained, writable_dir
from forgetless.checkpoint import save_checkpoint
from forgetless.continual.base_model import base_label, load_base
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.methods.base import PEFT
from forgetless.models.gpt import GPT, GPTConfig

def export(run: Path, label: str | None, out: Path, seed: int = 0, model: str | None = None) -> tuple[str, Path]:
    """Export to `out`, returning (form, folder): arm `label` (seed `seed`) of the bench run in `run`, the model
    of a `forgetless adapt --data` output, or a `save_pretrained` folder on the base `model` names."""
    if (run / CONFIG).is_file():
        return export_saved(run, out, model)
    if (run / "report.json").is_file():
        return export_adapt(run, out)
    if label is None:
        raise ForgetlessError(f"{run} is a bench run: name the arm to export with --method (its results table's label)")
    results = read_results(run)
    if label not in results["methods"]:
        raise ForgetlessError(f"{run} has no arm {label!r}; its arms: {', '.join(results['methods'])}")
    saved = run / "arms" / label / f"seed{seed}"
    if not (saved / CONFIG).is_file():
        raise ForgetlessError(f"{saved} holds no saved method (seed {seed} of {label}); run the bench again "
                              "with this version (earlier versions saved seed<k>.safetensors only)")
    check_empty(out)
    model, tokenizer, spec = base_of(results, saved)
    return export_adapted(from_pretrained(model, saved), spec, tokenizer, out)


def export_adapted(adapted: Adapted, spec: str | None, tokenizer, out: Path) -> tuple[str, Path]:
    """Write `adapted` (on the base `spec` names; None: the folder the model was loaded from, if any) to
    `out` in the most portable form it allows; returns (form, folder)."""
    out = writable_dir(out)
    base = local_base(adapted.model, spec)
    form = form_of(adapted, base)
    if form == PEFT:
        return form, save_peft(adapted, out, tokenizer, str(base))
    if form == "merged":
        return form, save_merged(adapted.merge_and_unload(), out, tokenizer)
    adapted.save_pretrained(out)
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


def export_saved(folder: Path, out: Path, model: str | None) -> tuple[str, Path]:
    """A `save_pretrained` folder, loaded onto the base `model` names (a spec of models.hf.load_model)."""
    if model is None:
        raise ForgetlessError(f"{folder} holds a saved method: name the base it was trained on with --model "
                              "(smollm2-135m, hf:PATH or a .gguf file)")
    from forgetless.models.hf import load_model
    check_empty(out)
    base, tokenizer = load_model(model)
    return export_adapted(from_pretrained(base, folder), model, tokenizer, out)


def export_adapt(run: Path, out: Path) -> tuple[str, Path]:
    """The model of an `adapt --data` output: exported already (copied), or its forgetless folder exported again."""
    report = json.loads((run / "report.json").read_text())
    form, folder = report["export"]["form"], run / "model"
    if form == "forgetless":
        return export_saved(folder, out, report["model"])
    check_empty(out)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    return form, out


def check_empty(out: Path):
    if out.is_file() or out.is_dir() and any(out.iterdir()):
        raise ForgetlessError(f"{out} exists and is not an empty folder; choose another one")


def read_results(run: Path) -> dict:
    path = run / "results.json"
    if not path.is_file():
        raise ForgetlessError(f"{path} does not exist; give the --out folder of a `forgetless bench` or `forgetless adapt "
                              "--data` run, or a folder written by save_pretrained")
    results = json.loads(path.read_text())
    if results.get("protocol") not in ("two-domain", "sequence"):
        raise ForgetlessError(f"{path} is not a bench run of a protocol (an optimizer or AUNN run?)")
    return results


def base_of(results: dict, saved: Path) -> tuple[nn.Module, object, str]:
    """(a fresh copy of the base the arm adapted, its tokenizer, the model spec)."""
    spec = results.get("model", "byte-gpt")
    if spec != "byte-gpt":
        from forgetless.models.hf import load_model
        model, tokenizer = load_model(spec)
        return model, tokenizer, spec
    method = json.loads((saved / CONFIG).read_text())
    model_cfg = build_method(method["method"], method["options"]).base_config(GPTConfig(**results["config"]["model"]))
    base = results["bases"].get(base_label(model_cfg))
    if base is None or not Path(base["path"]).is_file():
        raise ForgetlessError(f"the base of this arm ({base_label(model_cfg)}) is not in the cache any more; "
                              "run the bench again to pretrain it")
    model, tokenizer, _ = load_base(Path(base["path"]))
    return model, tokenizer, spec


def form_of(adapted: Adapted, base: Path | None) -> str:
    """How `adapted` is exported, from its method's traits: a PEFT adapter where its `export_form` says so, on a
    local transformers `base`, after one task (later tasks: merged); the merged model where it `merges` or
    injected nothing; else the forgetless folder."""
    method = adapted.method
    if method.export_form == PEFT and base is not None and adapted.task == 1:
        return PEFT
    return "merged" if method.merges or not adapted.injected() else "forgetless"


def save_peft(adapted: Adapted, out: Path, tokenizer, spec: str) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, PEFT's key names) that
    `PeftModel.from_pretrained(base, out)` loads onto the base model."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    cfg = adapted.method.cfg
    targets = [n for n, m in adapted.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, task_type="CAUSAL_LM",
               base_model_name_or_path=spec,
               fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in adapted.model.modules())).save_pretrained(out)
    tensors = {f"base_model.model.{k}": v.contiguous().cpu() for k, v in adapted.method_state().items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tokenizer, out)
    return out


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
