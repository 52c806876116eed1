"""Experiment c: a needle-style recall toy; accuracy against the distance between a fact and its query.

Each sequence is `block_size` random filler bytes (128..255) with `pairs` key -> value facts written into its
first half (a key byte below `keys`, then a value byte in [keys, keys + values)) and every key asked once in its
second half (the key again; the model must predict its value next). Distance = query position - fact
position (2 to block_size - 2). Only the answers are scored in training. Every arm trains for the same CPU
time on fresh random sequences and is scored on a fixed set of unseen ones; the memory arms also with their
test-time writes off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from forgetless.aunn.experiments import pm, save_figure
from forgetless.stats import mean_std
from forgetless.data.splits import Batch
from forgetless.errors import ForgetlessError
from forgetless.hope import SCAN_HELP, arm_model, check_arms, has_memory, train_for
from forgetless.methods.hope import set_writes
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.nn.titans import check_scan
from forgetless.train import PretrainConfig

FILLER = 128  # filler bytes are FILLER..255; keys and values sit below


@dataclass
class Config:
    arms: list[str] = field(default_factory=lambda: ["gpt", "titans", "hope", "hope-noattn"], metadata={
        "help": "gpt, titans, hope, hope-noattn (forgetless.hope)"})
    n_layer: int = field(default=2, metadata={"help": "blocks of every arm"})
    d_model: int = field(default=128, metadata={"help": "width of every arm"})
    block_size: int = field(default=128, metadata={"help": "sequence length (facts in the first half, queries in the second)"})
    pairs: int = field(default=4, metadata={"help": "facts per sequence"})
    keys: int = field(default=32, metadata={"help": "distinct key bytes"})
    values: int = field(default=32, metadata={"help": "distinct value bytes (chance accuracy: 1 / values)"})
    budget_s: float = field(default=120.0, metadata={"help": "training CPU seconds of every arm"})
    batch_size: int = field(default=32, metadata={"help": "sequences per training step"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate (warmup, cosine)"})
    eval_sequences: int = field(default=512, metadata={"help": "unseen sequences scored per arm"})
    bins: list[int] = field(default_factory=lambda: [2, 32, 64, 96, 128], metadata={
        "help": "distance bin edges (left-closed)"})
    scan: str = field(default="parallel", metadata={"help": SCAN_HELP})

    def __post_init__(self):
        check_arms(self.arms)
        if self.keys + self.values > FILLER or self.pairs > self.keys or self.pairs > self.block_size // 4:
            raise ForgetlessError(f"needle: keys + values must be at most {FILLER}, pairs at most keys and at most "
                                  "block_size / 4")
        if min(self.budget_s, self.batch_size, self.eval_sequences, self.n_layer, self.d_model) <= 0:
            raise ForgetlessError("needle: budget_s, batch_size, eval_sequences, n_layer and d_model must be positive")
        check_scan(self.scan, "needle")


def needles(cfg: Config, n: int, generator: torch.Generator) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """(a batch of n sequences with targets at the query positions only, their query positions (n, pairs),
    their distances (n, pairs))."""
    T, half = cfg.block_size, cfg.block_size // 2
    x = torch.randint(FILLER, 256, (n, T), generator=generator)  # (n, T)
    asks, distances = [], []
    for row in x:
        keys = torch.randperm(cfg.keys, generator=generator)[:cfg.pairs]
        values = cfg.keys + torch.randint(cfg.values, (cfg.pairs,), generator=generator)
        put = 2 * torch.randperm(half // 2, generator=generator)[:cfg.pairs]                   # even: pairs never overlap
        ask = half + 2 * torch.randperm((T - half) // 2, generator=generator)[:cfg.pairs]
        row[put], row[put + 1], row[ask], row[ask + 1] = keys, values, keys, values
        asks.append(ask)
        distances.append(ask - put)
    asks = torch.stack(asks)                                                                      # (n, pairs)
    y = torch.full_like(x, -100).scatter_(1, asks, x.gather(1, asks + 1))                         # (n, T)
    return Batch(x, y, torch.zeros(n, dtype=torch.bool)), asks, torch.stack(distances)


class NeedleSampler:
    """Fresh random needle sequences; its generator state is the sampler state (exact resume)."""

    def __init__(self, cfg: Config, seed: int):
        self.cfg, self.generator = cfg, torch.Generator().manual_seed(seed)

    def next(self) -> Batch:
        return needles(self.cfg, self.cfg.batch_size, self.generator)[0]

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor):
        self.generator.set_state(state)


@torch.no_grad()
def recall(model: GPT, batch: Batch, asks: torch.Tensor) -> torch.Tensor:
    """(n, pairs) bool: the value predicted at each query is right (eval mode)."""
    model.eval()
    device = next(model.parameters()).device
    logits = model(batch.x.to(device))                                                            # (n, T, V)
    predicted = logits.argmax(-1).gather(1, asks.to(device)).cpu()                                 # (n, pairs)
    return predicted == batch.y.gather(1, asks)


def by_distance(correct: torch.Tensor, distances: torch.Tensor, bins: list[int]) -> list[float]:
    return [correct[(distances >= lo) & (distances < hi)].float().mean().item() for lo, hi in zip(bins, bins[1:])]


def run(cfg: Config, seed: int) -> dict:
    model_cfg = GPTConfig(n_layer=cfg.n_layer, n_head=4, d_model=cfg.d_model, block_size=cfg.block_size,
                          vocab_size=256, dropout=0.0)
    train_cfg = PretrainConfig(steps=1, batch_size=cfg.batch_size, lr=cfg.lr, warmup=100, seed=seed)
    test, asks, distances = needles(cfg, cfg.eval_sequences, torch.Generator().manual_seed(10_000 + seed))
    out = {}
    for arm in cfg.arms:
        torch.manual_seed(seed)
        model = arm_model(arm, model_cfg, cfg.scan)
        result = {"params": model.num_params(),
                  **train_for(model, NeedleSampler(cfg, seed), train_cfg, cfg.budget_s, desc=f"{arm} seed {seed}")}
        correct = recall(model, test, asks)
        result.update(accuracy=correct.float().mean().item(), by_distance=by_distance(correct, distances, cfg.bins))
        if has_memory(model):
            set_writes(model, False)
            result["accuracy_no_writes"] = recall(model, test, asks).float().mean().item()
            set_writes(model, True)
        out[arm] = result
    return out


def summarize(cfg: Config, runs: list[dict]) -> dict:
    arms = {}
    for arm in cfg.arms:
        seeds = [r[arm] for r in runs]
        arms[arm] = {key: mean_std([s.get(key) for s in seeds])
                     for key in ("params", "steps", "cpu_s", "accuracy", "accuracy_no_writes")}
        arms[arm]["by_distance"] = [mean_std(list(v)) for v in zip(*[s["by_distance"] for s in seeds])]
    return {"arms": arms, "chance": 1 / cfg.values}


def markdown(results: dict) -> str:
    cfg = results["config"]
    bins = [f"{lo}-{hi - 1}" for lo, hi in zip(cfg["bins"], cfg["bins"][1:])]
    lines = [f"Needle recall: {cfg['pairs']} facts per {cfg['block_size']}-byte sequence, {cfg['n_layer']} blocks "
             f"of width {cfg['d_model']}, {cfg['budget_s']:.0f} CPU s per arm, {len(results['seeds'])} seed(s), "
             f"{results['threads']} thread(s); accuracy in % (chance {100 * results['chance']:.1f}), mean ± std.", "",
             "| arm | params | steps | accuracy | writes off | " + " | ".join(f"distance {b}" for b in bins) + " |",
             "|---|---|---|---|---|" + "---|" * len(bins)]
    for arm, s in results["arms"].items():
        off = "—" if s["accuracy_no_writes"]["mean"] is None else pm(s["accuracy_no_writes"])
        lines.append(f"| {arm} | {s['params']['mean']:,.0f} | {s['steps']['mean']:.0f} | {pm(s['accuracy'])} | {off} | "
                     + " | ".join(pm(b) for b in s["by_distance"]) + " |")
    return "\n".join(lines) + "\n"


def figures(results: dict, out: Path) -> list[Path]:
    from forgetless.report.figures import plt

    edges = results["config"]["bins"]
    centers = [(lo + hi - 1) / 2 for lo, hi in zip(edges, edges[1:])]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for arm, s in results["arms"].items():
        mean = [100 * b["mean"] for b in s["by_distance"]]
        std = [100 * b["std"] for b in s["by_distance"]]
        ax.errorbar(centers, mean, yerr=std, marker="o", capsize=3, label=arm)
    ax.axhline(100 * results["chance"], color="grey", linestyle=":", label="chance")
    ax.set(xlabel="distance from fact to query (bytes)", ylabel="recall accuracy (%)", ylim=(0, 100),
           title="needle recall, equal CPU time")
    return save_figure(fig, out / "hope_needle.png")
