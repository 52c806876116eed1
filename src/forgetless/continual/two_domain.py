"""The two-domain protocol (docs/DESIGN.md §3): pretrain on A, adapt on B, measure both.

Every method starts from the same cached base of its FFN kind; each (method, seed) arm is
saved under `out/arms/` as it finishes, so an interrupted bench resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from forgetless.continual.arm import run_arm, score
from forgetless.continual.plan import n_evaluations, run_arms
from forgetless.continual.protocol import (PROTOCOLS, Protocol, RunContext, build_arms, fresh, load_pretrained,
                                           opening, register_protocol)
from forgetless.data.domains import load_domains
from forgetless.methods import MethodSpec, build_method
from forgetless.progress import console
from forgetless.report import TWO_DOMAIN
from forgetless.report.results import RunResult
from forgetless.stats import band, mean_nested, mean_std, per_seed

METRICS = ["ppl_a_before", "ppl_b_before", "ppl_a_after", "ppl_b_after", "acc_a_before", "acc_b_before",
           "acc_a_after", "acc_b_after", "forgetting", "adaptation_gain", "wall_s"]
DEV_METRICS = ["ppl_a_dev_before", "ppl_b_dev_before", "ppl_a_dev_after", "ppl_b_dev_after", "forgetting_dev",
               "adaptation_gain_dev"]  # on validation windows (absent from arms run before the split existed)


@register_protocol
class TwoDomain(Protocol):
    """Pretrain on A (or load a pretrained model), adapt on B, measure both."""
    name = "two-domain"
    report = TWO_DOMAIN
    # the first run keeps one base (apn-retrofit, not an APN base) and one method per family
    default_methods = {"first": "full,lora,ewc,neutral,apn-retrofit"}
    result_keys = ("domains", "held_out", "data_fingerprints", "config", "bases")
    method_keys = (*METRICS, "curves")

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        """Every (method, seed) arm; with ctx.model = byte-gpt the bases are GPTs pretrained on A (cached),
        otherwise every arm adapts a copy of that pretrained model (models.hf.load_model), in its tokens;
        its results (docs/DESIGN.md §6.3)."""
        cfg, device = ctx.cfg, ctx.device
        built = build_arms(cfg, methods)
        if "full" not in built:
            console.print("[dim]adding the 'full' arm: adaptation gain G is measured against full fine-tuning[/dim]")
            built = {"full": build_method("full", cfg.methods.get("full")), **built}
        pretrained = load_pretrained(ctx.model, device, ctx.cfg.load)
        (a, b), tokenizer = load_domains([cfg.data.domain_a, cfg.data.domain_b],
                                         pretrained[1] if pretrained else cfg.data.tokenizer,
                                         cfg.model.block_size, cfg.data.val_fraction, cfg.data.eval_windows,
                                         cfg.data.dev_fraction)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
        ctx = dataclasses.replace(ctx, cfg=cfg)
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

        arms, summary = run_arms(ctx, built, a, tokenizer, pretrained, arm_config, run, arm_seconds)
        return RunResult.from_json({
            **opening(ctx, self.name, a, b),
            "config": cfg.to_dict(),
            "bases": summary,
            "methods": {name: summarize(runs, arms["full"], built[name]) for name, runs in arms.items()},
        })


run_two_domain = PROTOCOLS["two-domain"]  # run_two_domain(cfg, methods, seeds, out, preset, device, model, ...)


def adaptation_gain(arm: dict, full: dict, split: str = "") -> float:
    """G = (ln PPL_B before - ln PPL_B after) / (same for full fine-tuning, same seed); split "_dev": on the
    validation windows."""
    own = math.log(arm[f"ppl_b{split}_before"]) - math.log(arm[f"ppl_b{split}_after"])
    ref = math.log(full[f"ppl_b{split}_before"]) - math.log(full[f"ppl_b{split}_after"])
    return own / ref if ref != 0 else float("nan")


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


def mean_curves(runs: list[dict]) -> dict:
    """Seed-averaged retention/adaptation curves and training loss."""
    steps = [p["step"] for p in runs[0]["curve"]]
    curves = {"step": steps}
    for key in [k for k in runs[0]["curve"][0] if k != "step"]:  # ppl_a, ppl_b, acc_*, module monitors
        curves[key] = band(list(zip(*[[p[key] for p in r["curve"]] for r in runs])))
    loss = list(zip(*[[l for _, l in r["loss"]] for r in runs]))
    curves["loss"] = {"step": [s for s, _ in runs[0]["loss"]], "mean": [statistics.fmean(v) for v in loss]}
    return curves
