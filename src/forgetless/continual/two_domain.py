"""The two-domain protocol (docs/DESIGN.md §3): pretrain on A, adapt on B, measure both.

Every method starts from the same cached base of its FFN kind; each (method, seed) arm is
saved under `out/arms/` as it finishes, so an interrupted bench resumes where it stopped.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import itertools
import json
import math
import statistics
from pathlib import Path

from forgetless import __version__
from forgetless.adapted import resolve_device
from forgetless.checkpoint import write_json
from forgetless.config import code_fingerprint, stable_hash
from forgetless.continual.arm import run_arm, score
from forgetless.continual.base_model import base_label, cached_base, load_base, warn_if_other_code
from forgetless.data.domains import load_domains
from forgetless.methods import MethodSpec, build_method
from forgetless.methods.base import as_specs
from forgetless.presets import RunConfig
from forgetless.progress import console, progress_task
from forgetless.train import autocast

METRICS = ["ppl_a_before", "ppl_b_before", "ppl_a_after", "ppl_b_after", "acc_a_before", "acc_b_before",
           "acc_a_after", "acc_b_after", "forgetting", "adaptation_gain", "wall_s"]


def run_two_domain(cfg: RunConfig, methods: list[MethodSpec | str], seeds: list[int], out: Path, preset: str,
                   device: str = "auto", model: str = "byte-gpt") -> dict:
    """Run every (method, seed) arm on `device` and return the results dict of docs/DESIGN.md §6. With
    `model` = byte-gpt the bases are GPTs pretrained on A (cached); otherwise every arm adapts a copy
    of that pretrained model (models.hf.load_model: hf:PATH, a .gguf, smollm2-135m), in its tokens."""
    device = resolve_device(device)
    for train_cfg in (cfg.pretrain, cfg.adapt):  # refuse a precision the device lacks before any work
        autocast(device, train_cfg.precision)
    built = build_arms(cfg, methods)
    if "full" not in built:
        console.print("[dim]adding the 'full' arm: adaptation gain G is measured against full fine-tuning[/dim]")
        built = {"full": build_method("full", cfg.methods.get("full")), **built}
    pretrained = load_pretrained(model, device)
    (a, b), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b],
                                     pretrained[1] if pretrained else cfg.data.tokenizer,
                                     cfg.model.block_size, cfg.data.val_fraction, cfg.data.eval_windows)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    bases, summary = arm_bases(built, cfg, a, tokenizer, device, model, pretrained)

    arms: dict[str, list[dict]] = {name: [] for name in built}
    befores: dict[str, dict] = {}  # base name -> its scores on A and B, shared by the arms on it

    def run(base_name, load, method, seed, arm_dir, run_config):
        model = load()
        if base_name not in befores:
            befores[base_name] = score(model, a, b)
        return run_arm(model, fresh(method), a, b, cfg.adapt, seed, out_dir=arm_dir, run_config=run_config,
                       before=befores[base_name])

    with progress_task("bench arms", total=len(seeds) * len(built)) as advance:
        for seed, (name, method) in itertools.product(seeds, built.items()):
            base_name, load = bases[name]
            run_config = {"config": cfg.to_dict(), "method": method.name, "options": method.options(),
                          "base": base_name, "domains": [a.fingerprint, b.fingerprint]}
            arms[name].append(run_or_reuse_arm(
                out / "arms" / name / f"seed{seed}.json", run_config,
                lambda arm_dir: run(base_name, load, method, seed, arm_dir, run_config)))
            advance(1)

    return {
        "protocol": "two-domain", "preset": preset, "seeds": list(seeds), **provenance(device), "model": model,
        "domains": {"a": cfg.data.domain_a, "b": cfg.data.domain_b},
        "held_out": {"a": a.val_keys, "b": b.val_keys},
        "date": datetime.date.today().isoformat(),
        "config": cfg.to_dict(),
        "bases": summary,
        "methods": {name: summarize(runs, arms["full"], built[name]) for name, runs in arms.items()},
    }


def load_pretrained(model: str, device) -> tuple | None:
    """(model, tokenizer) of a pretrained `model` spec, or None for byte-gpt (forgetless pretrains its own)."""
    if model == "byte-gpt":
        return None
    from forgetless.models.hf import load_model
    return load_model(model, device)


def arm_bases(built: dict, cfg: RunConfig, domain, tokenizer, device, model: str, pretrained) -> tuple[dict, dict]:
    """Arm label -> (base name, loader of a fresh copy on `device`), and the bases' summary: forgetless
    GPTs pretrained on `domain` (cached, one per base kind), or copies of the `pretrained` model."""
    if pretrained:
        return pretrained_bases(built, model, pretrained[0])
    paths, by_base = bases_for(built, cfg, domain, tokenizer, device)
    return ({label: (path.parent.name, lambda path=path: load_base(path)[0].to(device)) for label, path in paths.items()},
            bases_summary(by_base))


def pretrained_bases(built: dict, spec: str, lm) -> tuple[dict, dict]:
    """Every arm adapts its own copy of the loaded model: label -> (base name, loader), and the summary."""
    from forgetless.adapted import architecture_fingerprint
    from forgetless.models.hf import describe
    name = f"{spec}-{architecture_fingerprint(lm)['hash']}"
    return {label: (name, lambda: copy.deepcopy(lm)) for label in built}, {spec: describe(lm)}


def provenance(device) -> dict:
    return {"forgetless_version": __version__, "device": str(device)}


def build_arms(cfg: RunConfig, methods: list[MethodSpec | str]) -> dict:
    """Label -> fresh Method for every spec in `methods` (validates cfg.methods too)."""
    for name, options in cfg.methods.items():  # fail fast on bad names and options
        build_method(name, options)
    return {spec.label: spec.build(cfg.methods.get(spec.name)) for spec in as_specs(methods)}


def bases_for(built: dict, cfg: RunConfig, domain, tokenizer, device=None) -> tuple[dict[str, Path], dict[str, Path]]:
    """(arm label -> its base checkpoint, base label -> checkpoint); each base is pretrained once."""
    by_base: dict[str, Path] = {}
    for method in built.values():
        model_cfg = method.base_config(cfg.model)
        if base_label(model_cfg) not in by_base:
            by_base[base_label(model_cfg)] = cached_base(model_cfg, cfg.pretrain, domain, tokenizer, device)
    return {label: by_base[base_label(m.base_config(cfg.model))] for label, m in built.items()}, by_base


def bases_summary(by_base: dict[str, Path]) -> dict:
    out = {}
    for label, path in by_base.items():
        m = load_base(path)[2]
        out[label] = {"path": str(path), "pretrain_wall_s": m["wall_s"], "ffn": m["model_config"]["ffn"],
                      "ffn_options": m["model_config"]["ffn_options"], "pretrain_steps": m["train_config"]["steps"],
                      "evals": m["history"]["evals"]}
    return out


def fresh(method):
    """A new instance of the same method and options (no state carried between arms)."""
    return build_method(method.name, method.options())


def run_or_reuse_arm(arm_path: Path, run_config: dict, run) -> dict:
    """The arm's saved result if its config matches, else `run(arm_dir)`, saved."""
    key = stable_hash(run_config)
    if arm_path.exists():
        saved = json.loads(arm_path.read_text())
        if saved.get("config_hash") == key:
            warn_if_other_code(saved.get("code"), f"arm {arm_path}", "delete it to run the arm again")
            return saved
    result = run(arm_path.parent)
    result["config_hash"] = key
    result["code"] = code_fingerprint()
    write_json(arm_path, result)
    return result


def adaptation_gain(arm: dict, full: dict) -> float:
    """G = (ln PPL_B before - ln PPL_B after) / (same for full fine-tuning, same seed)."""
    own = math.log(arm["ppl_b_before"]) - math.log(arm["ppl_b_after"])
    ref = math.log(full["ppl_b_before"]) - math.log(full["ppl_b_after"])
    return own / ref if ref != 0 else float("nan")


def mean_std(values: list[float | None]) -> dict:
    """Mean and sample std over seeds; None (a metric that does not exist for this run) stays None."""
    if any(v is None for v in values):
        return {"mean": None, "std": None}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def band(per_step: list[tuple[float, ...]]) -> dict:
    """Mean and std at every step of a curve, from the values of each seed there."""
    return {"mean": [statistics.fmean(v) for v in per_step],
            "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_step]}


def summarize(runs: list[dict], full_runs: list[dict], method) -> dict:
    full_by_seed = {r["seed"]: r for r in full_runs}
    for r in runs:
        r["adaptation_gain"] = adaptation_gain(r, full_by_seed[r["seed"]])
    out = {m: mean_std([r[m] for r in runs]) for m in METRICS}
    out.update(method=method.name, trainable_params=runs[0]["trainable_params"], total_params=runs[0]["total_params"],
               peak_rss_mb=max(r["peak_rss_mb"] for r in runs), options=method.options(),
               curves=mean_curves(runs))
    if "report" in runs[0]:
        out["report"] = {when: mean_nested([r["report"][when] for r in runs]) for when in ("before", "after")}
    return out


def mean_nested(items: list):
    """Elementwise mean over seeds of numbers, lists and dicts of them."""
    first = items[0]
    if isinstance(first, dict):
        return {k: mean_nested([i[k] for i in items]) for k in first}
    if isinstance(first, list):
        return [mean_nested(list(v)) for v in zip(*items)]
    return statistics.fmean(items)


def mean_curves(runs: list[dict]) -> dict:
    """Seed-averaged retention/adaptation curves and training loss."""
    steps = [p["step"] for p in runs[0]["curve"]]
    curves = {"step": steps}
    for key in [k for k in runs[0]["curve"][0] if k != "step"]:  # ppl_a, ppl_b, acc_*, module monitors
        curves[key] = band(list(zip(*[[p[key] for p in r["curve"]] for r in runs])))
    loss = list(zip(*[[l for _, l in r["loss"]] for r in runs]))
    curves["loss"] = {"step": [s for s, _ in runs[0]["loss"]], "mean": [statistics.fmean(v) for v in loss]}
    return curves
