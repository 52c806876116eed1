"""The two-domain protocol (DESIGN.md section 3): pretrain on A, adapt on B, measure both.

Every method starts from the same cached base of its FFN kind; each (method, seed) arm is
saved under `out/arms/` as it finishes, so an interrupted bench resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import statistics
from pathlib import Path

from forgetless.checkpoint import write_json
from forgetless.config import stable_hash
from forgetless.continual.arm import run_arm
from forgetless.continual.base_model import base_label, cached_base, load_base
from forgetless.data.domains import load_domains
from forgetless.methods import build_method
from forgetless.methods.base import parse_method_specs
from forgetless.presets import RunConfig
from forgetless.progress import console, progress_task

METRICS = ["ppl_a_before", "ppl_b_before", "ppl_a_after", "ppl_b_after", "acc_a_before", "acc_b_before",
           "acc_a_after", "acc_b_after", "forgetting", "adaptation_gain", "wall_s"]


def run_two_domain(cfg: RunConfig, methods: list[str], seeds: list[int], out: Path, preset: str) -> dict:
    """Run every (method, seed) arm and return the results dict of DESIGN.md section 6."""
    for name, options in cfg.methods.items():  # fail fast on bad names and options
        build_method(name, options)
    built = {label: build_method(name, {**cfg.methods.get(name, {}), **options})
             for label, name, options in parse_method_specs(",".join(methods))}
    if "full" not in built:
        console.print("[dim]adding the 'full' arm: adaptation gain G is measured against full fine-tuning[/dim]")
        built = {"full": build_method("full", cfg.methods.get("full")), **built}
    (a, b), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b], cfg.data.tokenizer,
                                     cfg.model.block_size, cfg.data.val_fraction, cfg.data.eval_windows)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    base_of = {name: base_label(m.base_config(cfg.model)) for name, m in built.items()}
    bases = {}
    for name, method in built.items():
        if base_of[name] not in bases:
            bases[base_of[name]] = cached_base(method.base_config(cfg.model), cfg.pretrain, a, tokenizer)

    arms: dict[str, list[dict]] = {name: [] for name in built}
    with progress_task("bench arms", total=len(seeds) * len(built)) as advance:
        for seed, (name, method) in itertools.product(seeds, built.items()):
            run_config = {"config": cfg.to_dict(), "method": method.name, "options": method.options(),
                          "base": bases[base_of[name]].parent.name, "domains": [a.fingerprint, b.fingerprint]}
            arms[name].append(run_or_reuse_arm(name, method, bases[base_of[name]], a, b, seed, out, run_config, cfg))
            advance(1)

    base_meta = {label: load_base(path)[2] for label, path in bases.items()}
    return {
        "protocol": "two-domain", "preset": preset, "seeds": list(seeds),
        "domains": {"a": cfg.data.domain_a, "b": cfg.data.domain_b},
        "held_out": {"a": a.val_keys, "b": b.val_keys},
        "date": datetime.date.today().isoformat(),
        "config": cfg.to_dict(),
        "bases": {label: {"path": str(bases[label]), "pretrain_wall_s": m["wall_s"], "ffn": m["model_config"]["ffn"],
                          "ffn_options": m["model_config"]["ffn_options"], "pretrain_steps": m["train_config"]["steps"],
                          "evals": m["history"]["evals"]} for label, m in base_meta.items()},
        "methods": {name: summarize(runs, arms["full"], built[name]) for name, runs in arms.items()},
    }


def run_or_reuse_arm(label: str, method, base: Path, a, b, seed: int, out: Path, run_config: dict, cfg) -> dict:
    """The arm's saved result if its config matches, else run it (a fresh method) and save it."""
    arm_path = out / "arms" / label / f"seed{seed}.json"
    key = stable_hash(run_config)
    if arm_path.exists():
        saved = json.loads(arm_path.read_text())
        if saved.get("config_hash") == key:
            return saved
    model, _, _ = load_base(base)
    method = build_method(method.name, method.options())  # fresh state for every arm
    result = run_arm(model, method, a, b, cfg.adapt, seed, out_dir=arm_path.parent, run_config=run_config)
    result["config_hash"] = key
    write_json(arm_path, result)
    return result


def adaptation_gain(arm: dict, full: dict) -> float:
    """G = (ln PPL_B before - ln PPL_B after) / (same for full fine-tuning, same seed)."""
    own = math.log(arm["ppl_b_before"]) - math.log(arm["ppl_b_after"])
    ref = math.log(full["ppl_b_before"]) - math.log(full["ppl_b_after"])
    return own / ref if ref != 0 else float("nan")


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(runs: list[dict], full_runs: list[dict], method) -> dict:
    full_by_seed = {r["seed"]: r for r in full_runs}
    for r in runs:
        r["adaptation_gain"] = adaptation_gain(r, full_by_seed[r["seed"]])
    out = {m: mean_std([r[m] for r in runs]) for m in METRICS}
    out.update(trainable_params=runs[0]["trainable_params"], total_params=runs[0]["total_params"],
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
        per_step = list(zip(*[[p[key] for p in r["curve"]] for r in runs]))
        curves[key] = {"mean": [statistics.fmean(v) for v in per_step],
                       "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_step]}
    loss = list(zip(*[[l for _, l in r["loss"]] for r in runs]))
    curves["loss"] = {"step": [s for s, _ in runs[0]["loss"]], "mean": [statistics.fmean(v) for v in loss]}
    return curves
