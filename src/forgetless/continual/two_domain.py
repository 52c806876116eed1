"""The two-domain protocol (docs/DESIGN.md §3): pretrain on A, adapt on B, measure both.

Every method starts from the same cached base of its FFN kind; each (method, seed) arm is
saved under `out/arms/` as it finishes, so an interrupted bench resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import platform
import statistics
from pathlib import Path

import torch

from forgetless import __version__
from forgetless.adapted import resolve_device
from forgetless.config import code_fingerprint, git_commit
from forgetless.continual.arm import run_arm, score
from forgetless.continual.plan import n_evaluations, run_arms
from forgetless.continual.workers import check_workers
from forgetless.data.domains import load_domains
from forgetless.errors import ForgetlessError
from forgetless.methods import MethodSpec, build_method
from forgetless.methods.base import as_specs
from forgetless.presets import RunConfig, settle_precision
from forgetless.progress import console

METRICS = ["ppl_a_before", "ppl_b_before", "ppl_a_after", "ppl_b_after", "acc_a_before", "acc_b_before",
           "acc_a_after", "acc_b_after", "forgetting", "adaptation_gain", "wall_s"]
DEV_METRICS = ["ppl_a_dev_before", "ppl_b_dev_before", "ppl_a_dev_after", "ppl_b_dev_after", "forgetting_dev",
               "adaptation_gain_dev"]  # on validation windows (absent from arms run before the split existed)


def run_two_domain(cfg: RunConfig, methods: list[MethodSpec | str], seeds: list[int], out: Path, preset: str,
                   device: str = "auto", model: str = "byte-gpt", base_seeds: int = 1,
                   workers: int = 1) -> dict:
    """Run every (method, seed) arm on `device` and return the results dict of docs/DESIGN.md §6. With
    `model` = byte-gpt the bases are GPTs pretrained on A (cached); otherwise every arm adapts a copy
    of that pretrained model (models.hf.load_model: hf:PATH, a .gguf, smollm2-135m), in its tokens."""
    device = resolve_device(device)
    check_workers(workers, device)
    cfg, precision = settle_precision(cfg, device)
    built = build_arms(cfg, methods)
    if "full" not in built:
        console.print("[dim]adding the 'full' arm: adaptation gain G is measured against full fine-tuning[/dim]")
        built = {"full": build_method("full", cfg.methods.get("full")), **built}
    pretrained = load_pretrained(model, device)
    (a, b), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b],
                                     pretrained[1] if pretrained else cfg.data.tokenizer,
                                     cfg.model.block_size, cfg.data.val_fraction, cfg.data.eval_windows,
                                     cfg.data.dev_fraction)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    befores: dict[str, dict] = {}  # base name -> its scores on A and B, shared by the arms on it

    def run(label, method, seed, base_name, load, arm_dir):
        model = load()
        if base_name not in befores:
            befores[base_name] = score(model, a, b, dev=True, precision=cfg.adapt.precision)
        return run_arm(model, fresh(method), a, b, cfg.adapt, seed, out_dir=arm_dir,
                       run_config=arm_config(label, method, base_name), before=befores[base_name])

    def arm_config(label, method, base_name):
        return {"config": cfg.to_dict(), "method": method.name, "options": method.options(), "base": base_name,
                "domains": [a.fingerprint, b.fingerprint]}

    def arm_seconds(calibration, method, base_cfg):
        return (cfg.adapt.steps * calibration.step(base_cfg, method, cfg.adapt.batch_size)
                + n_evaluations(cfg.adapt) * (a.windows.shape[0] + b.windows.shape[0]) * calibration.window(base_cfg))

    arms, summary = run_arms(built, seeds, cfg, a, tokenizer, device, model, pretrained, out, arm_config, run,
                             arm_seconds, base_seeds, workers)
    return {
        "protocol": "two-domain", "preset": preset, "seeds": list(seeds), "base_seeds": base_seeds,
        **provenance(device), "model": model, "precision": precision,
        "domains": {"a": cfg.data.domain_a, "b": cfg.data.domain_b},
        "held_out": {"a": a.val_keys, "b": b.val_keys},
        "data_fingerprints": {"a": a.fingerprint, "b": b.fingerprint},
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


def provenance(device) -> dict:
    """What made a results file: the package version, its code fingerprint and git commit (None outside a
    checkout), the Python and torch versions, the device."""
    return {"forgetless_version": __version__, "code": code_fingerprint(), "git_commit": git_commit(),
            "python": platform.python_version(), "torch": torch.__version__, "device": str(device)}


def build_arms(cfg: RunConfig, methods: list[MethodSpec | str], sequence: bool = False) -> dict:
    """Label -> fresh Method for every spec in `methods` (validates cfg.methods too); joint arms (mtl,
    METHOD[joint=true]) only in a task sequence (`sequence`)."""
    for name, options in cfg.methods.items():  # fail fast on bad names and options
        build_method(name, options)
    built = {spec.label: spec.build(cfg.methods.get(spec.name)) for spec in as_specs(methods)}
    if not sequence:
        for label, method in built.items():
            refuse_joint(label, method, "run it with --protocol sequence, or drop it here")
    return built


def refuse_joint(label: str, method, fix: str):
    """A joint arm (mtl, METHOD[joint=true]) learns all tasks of a sequence at once: elsewhere it cannot act."""
    if method.cfg.joint:
        raise ForgetlessError(f"{label} learns all tasks of a sequence at once (joint), which acts only in the "
                              f"task-sequence protocol; {fix} (here it would be plain fine-tuning)")


def fresh(method):
    """A new instance of the same method and options (no state carried between arms)."""
    return build_method(method.name, method.options())


def adaptation_gain(arm: dict, full: dict, split: str = "") -> float:
    """G = (ln PPL_B before - ln PPL_B after) / (same for full fine-tuning, same seed); split "_dev": on the
    validation windows."""
    own = math.log(arm[f"ppl_b{split}_before"]) - math.log(arm[f"ppl_b{split}_after"])
    ref = math.log(full[f"ppl_b{split}_before"]) - math.log(full[f"ppl_b{split}_after"])
    return own / ref if ref != 0 else float("nan")


T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
# Student t quantile 97.5 % for df 1..30 (beyond: the normal's 1.96)


def mean_std(values: list[float | None]) -> dict:
    """Mean and sample std over seeds, and with >= 2 seeds `ci95`, the half-width of the 95 % interval of
    the mean (Student t); None (a metric that does not exist for this run) stays None."""
    if any(v is None for v in values):
        return {"mean": None, "std": None}
    n = len(values)
    if n < 2:
        return {"mean": statistics.fmean(values), "std": 0.0}
    std = statistics.stdev(values)
    t = T_975[n - 2] if n - 1 <= len(T_975) else statistics.NormalDist().inv_cdf(0.975)
    return {"mean": statistics.fmean(values), "std": std, "ci95": t * std / math.sqrt(n)}


def per_seed(runs: list[dict], metrics: list[str]) -> dict[str, dict]:
    """{seed: {metric: value}} for the `metrics` a run has: the values behind `mean_std`, kept in results.json so
    methods can be compared seed by seed (paired), e.g. along their trade-off curves (report/frontier.py)."""
    return {str(r["seed"]): {m: r[m] for m in metrics if m in r} for r in runs}


def band(per_step: list[tuple[float, ...]]) -> dict:
    """Mean and std at every step of a curve, from the values of each seed there."""
    return {"mean": [statistics.fmean(v) for v in per_step],
            "std": [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_step]}


def summarize(runs: list[dict], full_runs: list[dict], method) -> dict:
    full_by_seed = {r["seed"]: r for r in full_runs}
    for r in runs:
        r["adaptation_gain"] = adaptation_gain(r, full_by_seed[r["seed"]])
        if "ppl_b_dev_after" in r and "ppl_b_dev_after" in full_by_seed[r["seed"]]:
            r["adaptation_gain_dev"] = adaptation_gain(r, full_by_seed[r["seed"]], "_dev")
    out = {m: mean_std([r[m] for r in runs]) for m in METRICS}
    out.update({m: mean_std([r[m] for r in runs]) for m in DEV_METRICS if all(m in r for r in runs)})
    out.update(method=method.name, trainable_params=runs[0]["trainable_params"], total_params=runs[0]["total_params"],
               peak_rss_mb=max(r["peak_rss_mb"] for r in runs), options=method.options(),
               curves=mean_curves(runs), per_seed=per_seed(runs, METRICS + DEV_METRICS))
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
