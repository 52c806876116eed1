"""Experiment b: Tiny Shakespeare, AUNN against the byte GPT at equal parameters and CPU time.

Both train on the first `train_bytes` bytes, then score the `eval_bytes` that follow, in bits per
byte, twice: frozen (static), and prequentially with one gradient step after each prediction
(AUNN: predict index i, step on (i, byte); GPT: predict each byte of a segment from the text
before it, then one step on that segment = dynamic evaluation). The AUNN's width is chosen to
match the GPT's parameter count; the GPT trains for the CPU time the AUNN took (measured in the
same process, one thread).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from forgetless.aunn.experiments import pm, save_figure
from forgetless.aunn.model import AUNNConfig, match_width
from forgetless.aunn.train import MODES, AUNNTrainConfig, build_learner, fit
from forgetless.aunn.use import prequential
from forgetless.config import from_dict
from forgetless.continual.evaluate import evaluate
from forgetless.loss import training_loss
from forgetless.stats import mean_std
from forgetless.data.corpora import load_corpus
from forgetless.data.splits import Sampler, eval_windows, join
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.presets import PRESETS
from forgetless.progress import progress_task
from forgetless.train import PretrainConfig, steps_for_seconds, train

LN2 = math.log(2)


@dataclass
class Config:
    corpus: str = field(default="tinyshakespeare", metadata={"help": "corpus spec (bytes, in order)"})
    train_bytes: int = field(default=1_000_000, metadata={"help": "training range: the first N bytes"})
    eval_bytes: int = field(default=4096, metadata={"help": "held-out stretch: the bytes right after the training range"})
    gpt_preset: str = field(default="quick", metadata={"help": "the GPT's model and training settings (forgetless presets)"})
    gpt_eval_lr: float = field(default=1e-4, metadata={"help": "GPT dynamic evaluation: AdamW lr of the step after each segment"})
    gpt_segment: int = field(default=8, metadata={"help": "GPT dynamic evaluation: bytes scored per gradient step"})
    aunn_layers: int = field(default=4, metadata={"help": "AUNN blocks (the width is matched to the GPT's parameters)"})
    aunn_mode: str = field(default="anneal", metadata={"help": "AUNN training mode: batch, serial or anneal"})
    aunn_steps: int = field(default=6000, metadata={"help": "AUNN training steps (their CPU time is the GPT's budget)"})
    aunn_batch: int = field(default=256, metadata={"help": "AUNN random batch size"})
    aunn_lr: float = field(default=1e-3, metadata={"help": "AUNN learning rate (training and prequential steps)"})
    aunn_warmup: int = field(default=100, metadata={"help": "AUNN warmup steps"})

    def __post_init__(self):
        if self.gpt_preset not in PRESETS:
            raise ForgetlessError(f"shakespeare.gpt_preset: unknown {self.gpt_preset!r}; valid: {', '.join(PRESETS)}")
        if self.aunn_mode not in MODES:
            raise ForgetlessError(f"shakespeare.aunn_mode: unknown {self.aunn_mode!r}; valid: {', '.join(MODES)}")
        if min(self.train_bytes, self.eval_bytes, self.gpt_segment, self.aunn_steps) <= 0:
            raise ForgetlessError("shakespeare.train_bytes, eval_bytes, gpt_segment and aunn_steps must be positive")


def load_text(cfg: Config) -> torch.Tensor:
    tokens = ByteTokenizer().encode(join(load_corpus(cfg.corpus).docs))
    if len(tokens) < cfg.train_bytes + cfg.eval_bytes:
        raise ForgetlessError(f"corpus {cfg.corpus!r} has {len(tokens):,} bytes, fewer than train_bytes + eval_bytes "
                              f"= {cfg.train_bytes + cfg.eval_bytes:,}; lower them")
    return tokens


def gpt_configs(cfg: Config, seed: int) -> tuple[GPTConfig, PretrainConfig]:
    preset = PRESETS[cfg.gpt_preset]
    return (from_dict(GPTConfig, preset["model"], "model"),
            from_dict(PretrainConfig, {**preset["pretrain"], "seed": seed}, "pretrain"))


def running_bits(losses: torch.Tensor, points: int = 64) -> list[float]:
    """Cumulative mean bits/byte at `points` evenly spaced positions of the stretch."""
    cum = losses.cumsum(0) / torch.arange(1, len(losses) + 1) / LN2
    return cum[torch.linspace(0, len(losses) - 1, points).long()].tolist()


def scores(static: torch.Tensor, dynamic: torch.Tensor) -> dict:
    return {"bpb_static": static.mean().item() / LN2, "bpb_dynamic": dynamic.mean().item() / LN2,
            "curve_static": running_bits(static), "curve_dynamic": running_bits(dynamic)}


def run(cfg: Config, seed: int) -> dict:
    tokens = load_text(cfg)
    n, held = cfg.train_bytes, tokens[cfg.train_bytes:cfg.train_bytes + cfg.eval_bytes]
    aunn = run_aunn(cfg, tokens[:n], held, GPT(gpt_configs(cfg, seed)[0]).num_params(), seed)
    gpt = run_gpt(cfg, tokens, held, aunn["cpu_s"], seed)
    counts = torch.bincount(tokens[:n], minlength=256).double() + 1
    unigram = -(counts / counts.sum()).log()[held].mean().item() / LN2
    return {"aunn": aunn, "gpt": gpt, "unigram_bpb": unigram, "eval_range": [n, n + cfg.eval_bytes]}


def run_aunn(cfg: Config, data: torch.Tensor, held: torch.Tensor, target_params: int, seed: int) -> dict:
    model_cfg = match_width(AUNNConfig(n_layer=cfg.aunn_layers), target_params)
    train_cfg = AUNNTrainConfig(mode=cfg.aunn_mode, steps=cfg.aunn_steps, batch_size=cfg.aunn_batch, lr=cfg.aunn_lr,
                            warmup=cfg.aunn_warmup, seed=seed)
    learner = build_learner(model_cfg, train_cfg)
    curve = fit(learner, data, desc=f"AUNN ({cfg.aunn_mode}) seed {seed}")
    sample = torch.randint(len(data), (8192,), generator=torch.Generator().manual_seed(seed))
    bpb_train = learner.losses(sample, data[sample]).mean().item() / LN2
    static = prequential(learner, held, learn=False)
    dynamic = prequential(learner, held, desc=f"AUNN prequential seed {seed}")
    return {"params": learner.model.num_params(), "d_model": model_cfg.d_model, "steps": cfg.aunn_steps,
            "cpu_s": curve["cpu_s"][-1], "bpb_train": bpb_train, **scores(static, dynamic),
            "loss_curve": {"cpu_s": curve["cpu_s"], "bits": [v / LN2 for v in curve["loss"]]}}


def run_gpt(cfg: Config, tokens: torch.Tensor, held: torch.Tensor, seconds: float, seed: int) -> dict:
    n = cfg.train_bytes
    model_cfg, train_cfg = gpt_configs(cfg, seed)
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    sampler = Sampler(tokens[:n], train_cfg.batch_size, model_cfg.block_size, seed)
    train_cfg = replace(train_cfg, steps=steps_for_seconds(seconds, model, sampler, train_cfg, training_loss))
    t0 = time.process_time()
    history = train(model, list(model.named_parameters()), sampler, train_cfg, training_loss,
                    desc=f"GPT (equal CPU time) seed {seed}")
    cpu_s = time.process_time() - t0
    bpb_train = evaluate(model, eval_windows(tokens[:n], model_cfg.block_size, 64))["loss"] / LN2
    static = gpt_prequential(model, tokens, n, len(held), cfg.gpt_segment, lr=0.0)
    dynamic = gpt_prequential(model, tokens, n, len(held), cfg.gpt_segment, lr=cfg.gpt_eval_lr)
    every = max(1, len(history.loss) // 200)
    return {"params": model.num_params(), "steps": train_cfg.steps, "cpu_s": cpu_s, "bpb_train": bpb_train,
            **scores(static, dynamic),
            "loss_curve": {"cpu_s": [cpu_s * s / train_cfg.steps for s, _ in history.loss[::every]],
                           "bits": [v / LN2 for _, v in history.loss[::every]]}}


def last_losses(model: GPT, window: torch.Tensor, s: int) -> torch.Tensor:
    """Loss (nats) of each of the last `s` bytes of `window` (T+1,), predicted from the bytes before it: (s,)."""
    return F.cross_entropy(model(window[None, :-1])[0, -s:], window[-s:], reduction="none")


def gpt_prequential(model: GPT, tokens: torch.Tensor, start: int, length: int, segment: int, lr: float) -> torch.Tensor:
    """Loss (nats) of each byte in tokens[start:start+length], predicted from the `block_size` bytes
    before it (eval mode); with lr > 0, one AdamW step (train mode) on each segment after scoring it
    (dynamic evaluation)."""
    T = model.config.block_size
    if start + min(segment, length) < T + 1:
        raise ForgetlessError(f"the training range must hold at least the GPT's context ({T} bytes)")
    model = copy.deepcopy(model) if lr else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0) if lr else None
    losses = []
    with progress_task(f"GPT {'dynamic' if lr else 'static'} evaluation", total=length) as advance:
        for q in range(start, start + length, segment):
            s = min(segment, start + length - q)
            window = tokens[q + s - T - 1:q + s]  # (T+1,): the segment's bytes and the context before them
            model.eval()
            with torch.no_grad():
                losses.append(last_losses(model, window, s))
            if opt is not None:
                model.train()
                opt.zero_grad(set_to_none=True)
                last_losses(model, window, s).mean().backward()
                opt.step()
            advance(s)
    return torch.cat(losses)


SCALARS = ("params", "steps", "cpu_s", "bpb_train", "bpb_static", "bpb_dynamic")


def summarize(cfg: Config, runs: list[dict]) -> dict:
    out: dict = {"unigram_bpb": mean_std([r["unigram_bpb"] for r in runs]), "eval_range": runs[0]["eval_range"]}
    for name in ("aunn", "gpt"):
        models = [r[name] for r in runs]
        out[name] = {key: mean_std([m[key] for m in models]) for key in SCALARS}
        for key in ("curve_static", "curve_dynamic"):
            out[name][key] = [sum(v) / len(v) for v in zip(*[m[key] for m in models])]
        out[name]["loss_curve"] = models[0]["loss_curve"]  # seed 0
    out["aunn"]["d_model"] = runs[0]["aunn"]["d_model"]
    return out


def markdown(results: dict) -> str:
    cfg = results["config"]
    a, b = results["eval_range"]
    rows = [("AUNN", results["aunn"]), ("GPT", results["gpt"])]
    lines = [f"# AUNN vs byte GPT on {cfg['corpus']} ({results['date']}, seeds {results['seeds']})", "",
             (f"Training range: bytes 0..{a - 1:,}; held-out stretch: bytes {a:,}..{b - 1:,} (right after it). "
              f"Bits per byte (lower is better), mean ± std over seeds; CPU seconds on {results['threads']} thread(s)."), "",
             ("| model | params | training steps | training CPU s | train range | held-out, frozen | "
              "held-out, prequential (a step after each prediction) |"), "|---|---|---|---|---|---|---|"]
    for name, m in rows:
        lines.append(f"| {name} | {m['params']['mean']:,.0f} | {m['steps']['mean']:,.0f} | {pm(m['cpu_s'], 1, 1)} | "
                     f"{pm(m['bpb_train'], 1, 3)} | {pm(m['bpb_static'], 1, 3)} | {pm(m['bpb_dynamic'], 1, 3)} |")
    lines.append(f"| unigram of the training range | 256 | | | | {pm(results['unigram_bpb'], 1, 3)} | |")
    best = min(rows, key=lambda r: r[1]["bpb_dynamic"]["mean"])[0]
    lines += ["", (f"AUNN: {cfg['aunn_layers']} blocks, width {results['aunn']['d_model']}, mode {cfg['aunn_mode']}, "
                   f"{cfg['aunn_steps']} steps; GPT: the `{cfg['gpt_preset']}` preset, dynamic evaluation with one AdamW "
                   f"step (lr {cfg['gpt_eval_lr']}) per {cfg['gpt_segment']} bytes. "
                   f"Lower held-out prequential bits/byte: **{best}**."), ""]
    return "\n".join(lines)


def figures(results: dict, out: Path) -> list[Path]:
    from forgetless.report.figures import plt

    a, b = results["eval_range"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("aunn", "tab:red"), ("gpt", "tab:blue")):
        m = results[name]
        xs = torch.linspace(0, b - a - 1, len(m["curve_static"])).add(1).tolist()
        axes[0].plot(xs, m["curve_static"], ls="--", color=color, label=f"{name.upper()} frozen")
        axes[0].plot(xs, m["curve_dynamic"], color=color, label=f"{name.upper()} prequential")
        axes[1].plot(m["loss_curve"]["cpu_s"], m["loss_curve"]["bits"], color=color, label=f"{name.upper()} (seed 0)")
    axes[0].axhline(results["unigram_bpb"]["mean"], color="grey", lw=0.8, label="unigram of the training range")
    axes[0].set(xlabel="bytes into the held-out stretch", ylabel="running bits/byte",
                title="held-out text after the training range")
    axes[1].set(xlabel="training CPU seconds", ylabel="training loss (bits/byte)", title="training (equal CPU time)")
    return save_figure(fig, out / "shakespeare.png")
