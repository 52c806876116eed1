"""`forgetless export RUN --method X --out DIR`: one trained arm of a bench run, the model of an `adapt --data`
output or a `save_pretrained` folder, in the form an inference stack loads (forgetless.export, docs/DESIGN.md §7.5)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.nn as nn

from forgetless.adapted import CONFIG, from_pretrained
from forgetless.continual.base_model import base_label, load_base
from forgetless.errors import ForgetlessError
from forgetless.export import check_empty, export_adapted
from forgetless.methods import build_method
from forgetless.models.gpt import GPTConfig
from forgetless.report.results import RunResult


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
    if label not in results.methods:
        raise ForgetlessError(f"{run} has no arm {label!r}; its arms: {', '.join(results.methods)}")
    saved = run / "arms" / label / f"seed{seed}"
    if not (saved / CONFIG).is_file():
        raise ForgetlessError(f"{saved} holds no saved method (seed {seed} of {label}); run the bench again "
                              "with this version (earlier versions saved seed<k>.safetensors only)")
    check_empty(out)
    model, tokenizer, spec = base_of(results, saved)
    return export_adapted(from_pretrained(model, saved), spec, tokenizer, out)


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


def read_results(run: Path) -> RunResult:
    path = run / "results.json"
    if not path.is_file():
        raise ForgetlessError(f"{path} does not exist; give the --out folder of a `forgetless bench` or `forgetless adapt "
                              "--data` run, or a folder written by save_pretrained")
    results = RunResult.load(path)
    if results.protocol not in ("two-domain", "sequence"):
        raise ForgetlessError(f"{path} is not a bench run of a protocol (an optimizer or AUNN run?)")
    return results


def base_of(results: RunResult, saved: Path) -> tuple[nn.Module, object, str]:
    """(a fresh copy of the base the arm adapted, its tokenizer, the model spec)."""
    spec = results.model
    if spec != "byte-gpt":
        from forgetless.models.hf import load_model
        model, tokenizer = load_model(spec)
        return model, tokenizer, spec
    method = json.loads((saved / CONFIG).read_text())
    model_cfg = build_method(method["method"], method["options"]).base_config(GPTConfig(**results.extra["config"]["model"]))
    base = results.extra["bases"].get(base_label(model_cfg))
    if base is None or not Path(base["path"]).is_file():
        raise ForgetlessError(f"the base of this arm ({base_label(model_cfg)}) is not in the cache any more; "
                              "run the bench again to pretrain it")
    model, tokenizer, _ = load_base(Path(base["path"]))
    return model, tokenizer, spec
