"""Experiment a: byte-level language modelling, HOPE vs the byte GPT vs Titans without self-modification.

Every arm has the preset's model shape (the GPT's FFN widened to HOPE's parameter count), starts from the
same seed and trains on the preset's domain A for the same process CPU time `budget_s`, with the preset's
pretraining settings (batch, peak lr, cosine). Scored on A's held-out windows (works never trained on) and
on its validation windows; for the memory arms also the memory's test-time gain: cross-entropy with the
memory's writes off minus on (positive: writing at test time helps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forgetless.aunn.experiments import pm, save_figure
from forgetless.config import from_dict
from forgetless.continual.evaluate import evaluate
from forgetless.stats import mean_std
from forgetless.data.domains import load_domains
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.hope import SCAN_HELP, arm_model, check_arms, has_memory, train_for
from forgetless.methods.hope import cross_entropy, set_writes
from forgetless.models.gpt import GPTConfig
from forgetless.nn.titans import check_scan
from forgetless.presets import PRESETS, DataConfig
from forgetless.train import PretrainConfig

LN2 = math.log(2)


@dataclass
class Config:
    preset: str = field(default="quick", metadata={"help": "model shape, pretraining settings and data split"})
    domain: str = field(default="shakespeare-modern", metadata={"help": "corpus trained on and scored (held-out works)"})
    arms: list[str] = field(default_factory=lambda: ["gpt", "titans", "hope"], metadata={
        "help": "gpt, titans, hope, hope-noattn (forgetless.hope)"})
    budget_s: float = field(default=300.0, metadata={"help": "training CPU seconds of every arm"})
    memory_windows: int = field(default=32, metadata={"help": "held-out windows scored with the memory's writes off"})
    scan: str = field(default="parallel", metadata={"help": SCAN_HELP})

    def __post_init__(self):
        check_arms(self.arms)
        if self.preset not in PRESETS:
            raise ForgetlessError(f"lm.preset: unknown {self.preset!r}; valid: {', '.join(PRESETS)}")
        if self.budget_s <= 0 or self.memory_windows <= 0:
            raise ForgetlessError("lm.budget_s and lm.memory_windows must be positive")
        check_scan(self.scan, "lm")


def configs(cfg: Config, seed: int) -> tuple[GPTConfig, PretrainConfig, DataConfig]:
    preset = PRESETS[cfg.preset]
    return (from_dict(GPTConfig, {**preset.get("model", {}), "vocab_size": 256}, "model"),
            from_dict(PretrainConfig, {**preset.get("pretrain", {}), "seed": seed}, "pretrain"),
            from_dict(DataConfig, preset.get("data", {}), "data"))


def run(cfg: Config, seed: int) -> dict:
    model_cfg, train_cfg, data = configs(cfg, seed)
    (domain,), _ = load_domains([cfg.domain], "bytes", model_cfg.block_size, data.val_fraction, data.eval_windows,
                                data.dev_fraction)
    out = {}
    for arm in cfg.arms:
        torch.manual_seed(seed)
        model = arm_model(arm, model_cfg, cfg.scan)
        sampler = Sampler(domain.train, train_cfg.batch_size, model_cfg.block_size, seed)
        run_ = train_for(model, sampler, train_cfg, cfg.budget_s, desc=f"{arm} seed {seed}")
        result = {"params": model.num_params(), **run_, "loss": evaluate(model, domain.windows)["loss"],
                  "dev_loss": evaluate(model, domain.dev_windows)["loss"] if domain.dev_windows is not None else None}
        if has_memory(model):
            w = domain.windows[:cfg.memory_windows]
            result["memory_gain"] = cross_entropy(model, w, writes=False) - cross_entropy(model, w, writes=True)
            set_writes(model, True)
        out[arm] = result
    return out


SCALARS = ("params", "steps", "cpu_s", "loss", "dev_loss", "memory_gain")


def summarize(cfg: Config, runs: list[dict]) -> dict:
    arms = {}
    for arm in cfg.arms:
        seeds = [r[arm] for r in runs]
        arms[arm] = {key: mean_std([s.get(key) for s in seeds]) for key in SCALARS}
        arms[arm]["ppl"] = mean_std([math.exp(s["loss"]) for s in seeds])
        arms[arm]["bpb"] = mean_std([s["loss"] / LN2 for s in seeds])
        arms[arm]["loss_curve"] = seeds[0]["loss_curve"]  # seed 0
    return {"arms": arms}


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [f"HOPE language modelling on {cfg['domain']} ({cfg['preset']} preset), {cfg['budget_s']:.0f} CPU s per "
             f"arm, {len(results['seeds'])} seed(s), {results['threads']} thread(s); mean ± std over seeds.", "",
             "| arm | params | steps | CPU s | held-out PPL | bits/byte | validation PPL | memory gain (nats) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, s in results["arms"].items():
        dev = "—" if s["dev_loss"]["mean"] is None else f"{math.exp(s['dev_loss']['mean']):.3f}"
        gain = "—" if s["memory_gain"]["mean"] is None else pm(s["memory_gain"], 1.0, 5)
        lines.append(f"| {arm} | {s['params']['mean']:,.0f} | {s['steps']['mean']:.0f} | {pm(s['cpu_s'], 1.0, 0)} | "
                     f"{pm(s['ppl'], 1.0, 3)} | {pm(s['bpb'], 1.0, 3)} | {dev} | {gain} |")
    lines += ["", "Memory gain: held-out cross-entropy with the memory's test-time writes off minus on "
              "(positive: the writes help)."]
    return "\n".join(lines) + "\n"


def figures(results: dict, out: Path) -> list[Path]:
    from forgetless.report.figures import plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for arm, s in results["arms"].items():
        curve = s["loss_curve"]
        ax.plot(curve["cpu_s"], [v / LN2 for v in curve["loss"]], label=f"{arm} (held-out PPL {s['ppl']['mean']:.2f})")
    n = len(results["seeds"])
    ax.set(xlabel="training CPU seconds", ylabel="training loss (bits/byte)",
           title=f"equal CPU time: curves of seed {results['seeds'][0]}, PPL the mean of {n} seed(s)")
    return save_figure(fig, out / "hope_lm.png")
