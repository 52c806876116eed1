"""Experiment a: memorise a repeating pattern of runs, extrapolate past its end, change one datum.

The data list is `|aaa|ccc|aaa|ccc...` (runs of `run` copies of each letter, between bars) at
indices 0..N-1. Each arm (a training mode, optionally `+fast` memory units or `+fourier` encoding)
memorises it; then
  - train accuracy, and accuracy of the argmax past the end, in bins of distance;
  - generation past the end (predict, sample at temperature 1, one step on the sample, next index);
  - change: gradient steps, one at a time, on a changed datum past the end (the first letter of the
    next run set to another letter): the probability of the new letter on the rest of that run,
    whether the argmax there flips, and the train accuracy after (interference).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

from forgetless.aunn.experiments import pm, save_figure
from forgetless.aunn.model import AUNNConfig, size_overrides
from forgetless.aunn.train import MODES, AUNNTrainConfig, build_learner, fit
from forgetless.aunn.use import generate
from forgetless.stats import mean_std
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.errors import ForgetlessError

EDGES = [0, 16, 64, 256, 512, 1024, 4096, 16384, 65536]
GENERATE = 48  # bytes sampled past the end (predict, sample, one step, next index)


@dataclass
class Config:
    patterns: list[str] = field(default_factory=lambda: ["ac", "acg"], metadata={
        "help": "letters of the runs, one pattern each: ac -> |aaa|ccc (period 8), acg -> period 12"})
    run: int = field(default=3, metadata={"help": "length of every run of a letter"})
    length: int = field(default=1536, metadata={"help": "bytes of data N (1536: the top index bit is seen in training)"})
    arms: list[str] = field(default_factory=lambda: ["batch", "serial", "anneal", "anneal+fast", "batch+fourier"],
                            metadata={"help": "MODE[+fast][+fourier]: training mode, memory units, Fourier encoding"})
    size: str = field(default="tiny", metadata={"help": "AUNN size preset"})
    batch_size: int = field(default=128, metadata={"help": "indices per random batch"})
    batch_steps: int = field(default=1500, metadata={"help": "steps of the batch mode"})
    anneal_steps: int = field(default=3000, metadata={"help": "steps of the anneal mode (about half serial)"})
    serial_epochs: int = field(default=4, metadata={"help": "epochs of the serial mode (batch 1, in order)"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate (AdamW), also for the change steps"})
    fourier_bits: int = field(default=12, metadata={"help": "+fourier arms: longest period 2**bits"})
    fast_units: int = field(default=16, metadata={"help": "+fast arms: memory units per block"})
    change_steps: int = field(default=3, metadata={"help": "steps taken one by one on the changed datum"})
    far: int = field(default=16384, metadata={"help": "extrapolation is read up to this many indices past the end"})

    def __post_init__(self):
        for p in self.patterns:
            if len(p) < 2 or "|" in p or len(set(p)) != len(p) or not p.isascii():
                raise ForgetlessError(f"toy.patterns: {p!r} must be two or more distinct ASCII letters, without '|'")
        for arm in self.arms:
            arm_config(self, arm)
        if min(self.run, self.length, self.change_steps) <= 0:
            raise ForgetlessError("toy.run, toy.length and toy.change_steps must be positive")
        need = max([GENERATE] + [2 * period(p, self.run) for p in self.patterns])
        if self.far < need:
            raise ForgetlessError(f"toy.far must be at least {need} (the {GENERATE} bytes generated and two periods "
                                  f"past the end), got {self.far}; raise it")

    @property
    def edges(self) -> list[int]:
        """Bin edges of the extrapolation accuracy (distance past the end), up to `far`."""
        return [e for e in EDGES if e <= self.far]


def arm_config(cfg: Config, arm: str) -> tuple[AUNNConfig, AUNNTrainConfig]:
    mode, *extras = arm.split("+")
    if mode not in MODES or not set(extras) <= {"fast", "fourier"}:
        raise ForgetlessError(f"toy.arms: {arm!r} is not MODE[+fast][+fourier] with MODE one of {', '.join(MODES)}")
    model = {**size_overrides(cfg.size), "fast_units": cfg.fast_units if "fast" in extras else 0}
    if "fourier" in extras:
        model.update(encoding="fourier", bits=cfg.fourier_bits)
    steps = {"batch": cfg.batch_steps, "anneal": cfg.anneal_steps, "serial": cfg.serial_epochs * cfg.length}[mode]
    return AUNNConfig(**model), AUNNTrainConfig(mode=mode, steps=steps, batch_size=cfg.batch_size, lr=cfg.lr)


def period(letters: str, run: int) -> int:
    return len(letters) * (run + 1)


def pattern_bytes(letters: str, run: int, n: int) -> bytes:
    unit = "".join("|" + c * run for c in letters).encode()
    return (unit * (n // len(unit) + 1))[:n]


def run(cfg: Config, seed: int) -> dict:
    out: dict = {}
    for letters in cfg.patterns:
        truth = ByteTokenizer().encode(pattern_bytes(letters, cfg.run, cfg.length + cfg.far))
        out[letters] = {arm: run_arm(cfg, arm, letters, truth, seed) for arm in cfg.arms}
    return out


def run_arm(cfg: Config, arm: str, letters: str, truth: torch.Tensor, seed: int) -> dict:
    model_cfg, train_cfg = arm_config(cfg, arm)
    train_cfg.seed = seed
    learner = build_learner(model_cfg, train_cfg)
    n = cfg.length
    curve = fit(learner, truth[:n], desc=f"toy {letters} {arm} seed {seed}")
    pred = learner.predict(torch.arange(len(truth))).argmax(-1)  # (N + far,)
    hit = (pred == truth).float()
    p = period(letters, cfg.run)
    tok = ByteTokenizer()
    result = {"train_acc": hit[:n].mean().item(), "final_loss": curve["loss"][-1],
              "extrapolation": [hit[n + a:n + b].mean().item() for a, b in pairwise(cfg.edges)],
              "truth_next": tok.decode(truth[n:n + 2 * p]), "pred_next": tok.decode(pred[n:n + 2 * p])}
    snap = learner.snapshot()
    sampled = generate(learner, GENERATE, temperature=1.0, seed=seed)  # (GENERATE,)
    learner.restore(snap)
    result.update(generated=tok.decode(sampled),
                  generated_acc=(sampled == truth[n:n + GENERATE]).float().mean().item(),
                  change=change_datum(learner, truth, n, letters, cfg))
    return result


def change_datum(learner, truth: torch.Tensor, n: int, letters: str, cfg: Config) -> list[dict]:
    """Steps on (c, new letter), c = the first run start past the end; readings after 0..k steps."""
    c = next(i for i in range(n, len(truth)) if truth[i - 1] == ord("|"))
    new = ord(letters[(letters.index(chr(truth[c])) + 1) % len(letters)])
    readings = []
    for k in range(cfg.change_steps + 1):
        if k:
            learner.step(torch.tensor([c]), torch.tensor([new]))
        probs = learner.predict(torch.arange(c - 1, c - 1 + period(letters, cfg.run))).softmax(-1)  # (period, 256)
        train = learner.predict(torch.arange(n)).argmax(-1)
        readings.append({"steps": k, "p_new_at": probs[1, new].item(), "p_new_rest": probs[2:cfg.run + 1, new].mean().item(),
                         "flipped_rest": (probs[2:cfg.run + 1].argmax(-1) == new).float().mean().item(),
                         "train_acc": (train == truth[:n]).float().mean().item(),
                         "pred": ByteTokenizer().decode(probs.argmax(-1))})
    return readings


def summarize(cfg: Config, runs: list[dict]) -> dict:
    summary: dict = {}
    for letters in cfg.patterns:
        for arm in cfg.arms:
            arms = [r[letters][arm] for r in runs]
            summary.setdefault(letters, {})[arm] = {
                "train_acc": mean_std([a["train_acc"] for a in arms]),
                "generated_acc": mean_std([a["generated_acc"] for a in arms]),
                "extrapolation": [mean_std(list(v)) for v in zip(*[a["extrapolation"] for a in arms])],
                "change": [{key: mean_std([a["change"][k][key] for a in arms])
                            for key in ("p_new_at", "p_new_rest", "flipped_rest", "train_acc")}
                           for k in range(cfg.change_steps + 1)],
                "samples": [{"truth": a["truth_next"], "pred": a["pred_next"], "generated": a["generated"],
                             "after_change": [c["pred"] for c in a["change"]]} for a in arms]}
    return {"edges": cfg.edges, "patterns": summary}


def markdown(results: dict) -> str:
    cfg, edges = results["config"], results["edges"]
    bins = [f"+{a}..{b}" for a, b in pairwise(edges)]
    lines = [f"# AUNN toy: memorise and extrapolate ({results['date']}, seeds {results['seeds']})", ""]
    for letters, arms in results["patterns"].items():
        unit = pattern_bytes(letters, cfg["run"], period(letters, cfg["run"])).decode()
        lines += [f"## pattern `{unit}` (period {len(unit)}), N = {cfg['length']}", "",
                  ("Accuracy % of the argmax: on the training range, then past the end by distance (indices); "
                   "last column: bytes generated past the end equal to the pattern."), "",
                  "| arm | train | " + " | ".join(bins) + f" | generated (first {GENERATE}) |",
                  "|---|---|" + "---|" * (len(bins) + 1)]
        lines += [f"| {arm} | {pm(m['train_acc'])} | " + " | ".join(pm(s) for s in m["extrapolation"]) +
                  f" | {pm(m['generated_acc'])} |" for arm, m in arms.items()]
        lines += ["", ("Change: steps on the first letter of the next run set to another letter. P(new) on the rest "
                       "of that run, share of it whose argmax flips to the new letter, train accuracy (%)."), "",
                  "| arm | steps | P(new) at the changed index | P(new), rest of run | flipped | train acc |",
                  "|---|---|---|---|---|---|"]
        for arm, m in arms.items():
            lines += [f"| {arm} | {k} | {pm(c['p_new_at'])} | {pm(c['p_new_rest'])} | {pm(c['flipped_rest'])} | "
                      f"{pm(c['train_acc'])} |" for k, c in enumerate(m["change"])]
        lines += ["", ("Seed 0: two periods past the end (truth, argmax prediction), the bytes generated past the "
                       "end, and the period around the changed datum after 0, 1, ... steps:"), "", "```"]
        for arm, m in arms.items():
            s = m["samples"][0]
            lines += [f"{arm:>14}  truth {s['truth']}", f"{'':>14}  pred  {s['pred']}",
                      f"{'':>14}  sampled {s['generated']!r}",
                      f"{'':>14}  after change steps: " + " / ".join(s["after_change"])]
        lines += ["```", ""]
    return "\n".join(lines)


def figures(results: dict, out: Path) -> list[Path]:
    from forgetless.report.figures import colors, plt

    patterns = results["patterns"]
    arms = list(next(iter(patterns.values())))
    color = colors(arms)
    n = results["config"]["length"]
    mids = [(a + b + 1) / 2 for a, b in pairwise(results["edges"])]  # bin [a, b) at distance + 1: 1 = index N
    fig, axes = plt.subplots(2, len(patterns), figsize=(5 * len(patterns), 7.5), squeeze=False)
    for col, (letters, by_arm) in enumerate(patterns.items()):
        for arm, m in by_arm.items():
            ex = m["extrapolation"]
            axes[0, col].errorbar(mids, [100 * s["mean"] for s in ex], [100 * s["std"] for s in ex], marker="o",
                                  capsize=3, color=color[arm], label=f"{arm} (train {100 * m['train_acc']['mean']:.0f}%)")
            ch = m["change"]
            ks = range(len(ch))
            axes[1, col].errorbar(ks, [100 * c["p_new_rest"]["mean"] for c in ch], [100 * c["p_new_rest"]["std"] for c in ch],
                                  marker="o", capsize=3, color=color[arm], label=f"{arm}: P(new), rest of run")
            axes[1, col].plot(ks, [100 * c["train_acc"]["mean"] for c in ch], ls="--", color=color[arm])
        new_bit = 1 << (n - 1).bit_length()  # the first index with an unseen top bit
        axes[0, col].axvline(new_bit - n + 1, color="grey", ls=":", label=f"index {new_bit}: a bit never set in training")
        axes[0, col].set(xscale="log", ylim=(-3, 103), xlabel="index − N + 1 (1: the first index past the data)",
                         ylabel="accuracy of the argmax (%)", title=f"pattern {letters!r}: extrapolation")
        axes[1, col].set(ylim=(-3, 103), xlabel="gradient steps on the changed datum", xticks=list(ks),
                         ylabel="P(new), rest of run (solid); train acc. (dashed) %",
                         title=f"pattern {letters!r}: one changed datum")
    return save_figure(fig, out / "toy.png")
