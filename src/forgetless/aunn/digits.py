"""Experiment c: continual learning on permuted 8x8 digits (scikit-learn's bundled set, offline).

Task t is a fixed pixel permutation (task 0: the identity). The AUNN sees one long list: each
example is its 64 permuted pixel values (0..16) followed by its label byte ('0'..'9'). Online, per
example: condition on the pixels at the next indices (`pixel_steps` steps on the block), predict the
label at the index after them (argmax over the ten label bytes), then one step on the label.
Held-out accuracy = the same on unseen examples, each from one snapshot that is restored after it.
Baseline: an MLP classifier on the pixels, one AdamW step per example, on the same stream.
Read: held-out accuracy on each task after n of its examples (does it rise with tasks seen? the
source's meta-learning hypothesis), and R[t][i] = accuracy on task i after task t (retention).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.aunn.experiments import pm, save_figure
from forgetless.aunn.model import AUNNConfig, size_overrides
from forgetless.aunn.train import AUNNTrainConfig, build_learner
from forgetless.aunn.use import condition
from forgetless.continual.metrics import sequence_metrics
from forgetless.stats import mean_std
from forgetless.errors import ForgetlessError
from forgetless.progress import progress_task

LABEL0 = ord("0")  # label c is stored as the byte '0' + c
LEARNERS = ("aunn", "aunn+fast", "mlp")


@dataclass
class Config:
    tasks: int = field(default=10, metadata={"help": "number of permutations (task 0: the identity)"})
    train_per_task: int = field(default=200, metadata={"help": "examples streamed per task"})
    test_per_task: int = field(default=50, metadata={"help": "held-out examples scored per task"})
    curve_at: list[int] = field(default_factory=lambda: [0, 10, 25, 50, 100, 200], metadata={
        "help": "numbers of examples into a task at which its held-out accuracy is read"})
    early: int = field(default=25, metadata={"help": "n for the meta-learning test: accuracy after n examples vs task index"})
    size: str = field(default="small", metadata={"help": "AUNN size preset"})
    lr: float = field(default=1e-3, metadata={"help": "AUNN learning rate (AdamW)"})
    pixel_steps: int = field(default=1, metadata={"help": "AUNN steps on an example's 64 pixels before predicting its label"})
    fast_units: int = field(default=16, metadata={"help": "memory units per block of the aunn+fast learner"})
    learners: list[str] = field(default_factory=lambda: list(LEARNERS), metadata={
        "help": "aunn, aunn+fast (memory units at a higher lr), mlp (the baseline classifier)"})
    baseline_hidden: int = field(default=256, metadata={"help": "MLP baseline hidden width (two hidden layers)"})
    baseline_lr: float = field(default=1e-3, metadata={"help": "MLP baseline learning rate (AdamW)"})

    def __post_init__(self):
        if min(self.tasks, self.train_per_task, self.test_per_task) <= 0:
            raise ForgetlessError("digits.tasks, train_per_task and test_per_task must be positive")
        if any(not 0 <= n <= self.train_per_task for n in self.curve_at) or self.early not in self.curve_at:
            raise ForgetlessError(f"digits.curve_at must lie in [0, train_per_task={self.train_per_task}] "
                                  f"and contain digits.early ({self.early})")
        size_overrides(self.size)
        if not self.learners or not set(self.learners) <= set(LEARNERS):
            raise ForgetlessError(f"digits.learners must be some of {', '.join(LEARNERS)}, got {self.learners}")
        if self.pixel_steps < 0:
            raise ForgetlessError(f"digits.pixel_steps must not be negative, got {self.pixel_steps}")
        if self.baseline_hidden <= 0 or not self.baseline_lr > 0:
            raise ForgetlessError("digits.baseline_hidden and digits.baseline_lr must be positive")


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(1797, 64) pixel values 0..16 and (1797,) labels, from scikit-learn's bundled copy."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise ForgetlessError("the digits experiment needs scikit-learn: pip install 'forgetless[aunn]'") from None
    d = sk_digits()
    return torch.tensor(d.data, dtype=torch.long), torch.tensor(d.target, dtype=torch.long)


class AUNNClassifier:
    """Pixels then label, appended to one list; the label is read at the index after the pixels."""

    def __init__(self, cfg: Config, seed: int, fast: bool = False):
        model_cfg = AUNNConfig(**size_overrides(cfg.size), fast_units=cfg.fast_units if fast else 0)
        self.learner = build_learner(model_cfg, AUNNTrainConfig(lr=cfg.lr, warmup=10, seed=seed))
        self.pixel_steps = cfg.pixel_steps
        self.label_index: list[int] = []

    def guess(self, x: torch.Tensor) -> int:  # x (64,): conditions on it (changes the learner)
        condition(self.learner, x, self.pixel_steps)
        logits = self.learner.predict(torch.tensor([self.learner.position]))[0, LABEL0:LABEL0 + 10]
        return int(logits.argmax())

    def learn(self, x: torch.Tensor, y: int) -> bool:
        correct = self.guess(x) == y
        self.label_index.append(self.learner.position)
        condition(self.learner, torch.tensor([LABEL0 + y]), steps=1)
        return correct

    def accuracy(self, X: torch.Tensor, y: torch.Tensor) -> float:
        snap = self.learner.snapshot()
        hits = 0
        for x, label in zip(X, y.tolist()):
            hits += self.guess(x) == label
            self.learner.restore(snap)
        return hits / len(y)

    def recall(self, indices: list[int], y: torch.Tensor) -> float:
        """Labels read back at their own indices: what the list memorised."""
        logits = self.learner.predict(torch.tensor(indices))[:, LABEL0:LABEL0 + 10]
        return (logits.argmax(-1) == y).float().mean().item()


class MLPClassifier:
    def __init__(self, cfg: Config, seed: int):
        torch.manual_seed(seed)
        h = cfg.baseline_hidden
        self.net = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.baseline_lr, weight_decay=0.0)

    def learn(self, x: torch.Tensor, y: int) -> bool:
        logits = self.net(x[None].float() / 16)  # (1, 10)
        loss = F.cross_entropy(logits, torch.tensor([y]))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return int(logits.argmax()) == y

    @torch.no_grad()
    def accuracy(self, X: torch.Tensor, y: torch.Tensor) -> float:
        return (self.net(X.float() / 16).argmax(-1) == y).float().mean().item()


def make_tasks(cfg: Config, seed: int) -> list[dict]:
    """Per task: its permutation applied to a seeded stream of training examples and the held-out set."""
    X, y = load_digits()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    test, pool = order[:cfg.test_per_task], order[cfg.test_per_task:]
    if cfg.train_per_task > len(pool):
        raise ForgetlessError(f"digits.train_per_task must be at most {len(pool)} (the training pool)")
    tasks = []
    for t in range(cfg.tasks):
        perm = torch.arange(64) if t == 0 else torch.randperm(64, generator=g)
        train = pool[torch.randperm(len(pool), generator=g)[:cfg.train_per_task]]
        tasks.append({"X": X[train][:, perm], "y": y[train], "X_test": X[test][:, perm], "y_test": y[test]})
    return tasks


def run(cfg: Config, seed: int) -> dict:
    tasks = make_tasks(cfg, seed)
    made = {"aunn": lambda: AUNNClassifier(cfg, seed), "aunn+fast": lambda: AUNNClassifier(cfg, seed, fast=True),
            "mlp": lambda: MLPClassifier(cfg, seed)}
    return {name: run_learner(made[name](), tasks, cfg, f"digits {name} seed {seed}") for name in cfg.learners}


def run_learner(clf, tasks: list[dict], cfg: Config, desc: str) -> dict:
    """Stream every task in order; held-out curves within each task, R after each task."""
    def held_out(i: int) -> float:
        return 100 * clf.accuracy(tasks[i]["X_test"], tasks[i]["y_test"])

    R = [[held_out(i) for i in range(len(tasks))]]  # row 0: before any task
    curves, online = [], []
    with progress_task(desc, total=len(tasks) * cfg.train_per_task) as advance:
        for t, task in enumerate(tasks):
            curve, hits = {}, []
            for n in range(cfg.train_per_task + 1):
                if n in cfg.curve_at:
                    curve[n] = held_out(t)
                if n < cfg.train_per_task:
                    hits.append(clf.learn(task["X"][n], int(task["y"][n])))
                    advance(1)
            curves.append([curve[n] for n in cfg.curve_at])
            online.append(100 * sum(hits) / len(hits))
            R.append([held_out(i) for i in range(len(tasks))])
    out = {"R": R, "curves": curves, "online_acc": online}
    if isinstance(clf, AUNNClassifier):
        per_task = cfg.train_per_task
        out["recall"] = [100 * clf.recall(clf.label_index[t * per_task:(t + 1) * per_task], task["y"])
                         for t, task in enumerate(tasks)]
    return out


def slope(values: list[float]) -> float:
    """Least-squares slope of values against their index (points per task)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def summarize(cfg: Config, runs: list[dict]) -> dict:
    j = cfg.curve_at.index(cfg.early)
    out: dict = {"methods": {}}
    for name in cfg.learners:
        arms = [r[name] for r in runs]
        R_mean = [[sum(v) / len(v) for v in zip(*rows)] for rows in zip(*[a["R"] for a in arms])]
        metrics = [sequence_metrics(a["R"][1:]) if cfg.tasks > 1 else {} for a in arms]
        m = {"r_matrix": R_mean[1:], "r_before": R_mean[0],
             "curves": [[sum(v) / len(v) for v in zip(*c)] for c in zip(*[a["curves"] for a in arms])],
             "early_by_task": [mean_std([a["curves"][t][j] for a in arms]) for t in range(cfg.tasks)],
             "early_slope": mean_std([slope([c[j] for c in a["curves"]]) for a in arms]),
             "online_acc": mean_std([sum(a["online_acc"]) / len(a["online_acc"]) for a in arms]),
             "diagonal": mean_std([sum(a["R"][t + 1][t] for t in range(cfg.tasks)) / cfg.tasks for a in arms])}
        for key in ("op", "bwt", "forgetting"):
            if metrics[0]:
                m[key] = mean_std([x[key] for x in metrics])
        if "recall" in arms[0]:
            m["recall"] = mean_std([sum(a["recall"]) / len(a["recall"]) for a in arms])
        out["methods"][name] = m
    return out


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [f"# AUNN on permuted digits ({results['date']}, seeds {results['seeds']})", "",
             (f"{cfg['tasks']} tasks x {cfg['train_per_task']} examples streamed once; held-out {cfg['test_per_task']} "
              "per task. Accuracy %, chance 10; mean ± std over seeds."), "",
             ("| learner | online (prequential) | each task right after it | after the last task (OP) | BWT | forgetting | "
              f"after {cfg['early']} examples, slope per task | memorised labels |"), "|---|---|---|---|---|---|---|---|"]
    keys = ("online_acc", "diagonal", "op", "bwt", "forgetting", "early_slope", "recall")
    for name, m in results["methods"].items():
        cells = [pm(m[k], 1) if k in m else "–" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Held-out accuracy on task t after n of its examples (mean over seeds; n = {cfg['curve_at']}):", ""]
    for name, m in results["methods"].items():
        lines += [f"{name}:", "", "| task | " + " | ".join(f"n={n}" for n in cfg["curve_at"]) + " |",
                  "|---|" + "---|" * len(cfg["curve_at"])]
        lines += [f"| {t} | " + " | ".join(f"{v:.1f}" for v in row) + " |" for t, row in enumerate(m["curves"])]
        lines.append("")
    return "\n".join(lines)


def figures(results: dict, out: Path) -> list[Path]:
    from forgetless.report.figures import plt, r_heatmaps

    cfg = results["config"]
    methods = results["methods"]
    fig, axes = plt.subplots(1, len(methods) + 1, figsize=(4.5 * (len(methods) + 1), 3.8))
    cmap = plt.get_cmap("viridis")
    for ax, (name, m) in zip(axes, methods.items()):
        for t, row in enumerate(m["curves"]):
            ax.plot([max(n, 0.5) for n in cfg["curve_at"]], row, marker=".", color=cmap(t / max(1, cfg["tasks"] - 1)),
                    label=f"task {t}" if t in (0, cfg["tasks"] - 1) else None)
        ax.set(xscale="log", ylim=(0, 100), xlabel="examples of the task seen (0 drawn at 0.5)",
               ylabel="held-out accuracy (%)", title=f"{name}: learning curve of each task")
    for name, m in methods.items():
        e = m["early_by_task"]
        axes[-1].errorbar(range(len(e)), [s["mean"] for s in e], [s["std"] for s in e], marker="o", capsize=3,
                          label=f"{name} (slope {m['early_slope']['mean']:+.2f} ± {m['early_slope']['std']:.2f})")
    axes[-1].axhline(10, color="grey", lw=0.8, ls=":")
    axes[-1].set(ylim=(0, 100), xlabel="task index (permutations seen before it)",
                 ylabel=f"accuracy after {cfg['early']} examples (%)", title="does learning a new task get faster?")
    heat = out / "digits_r_matrix.png"
    r_heatmaps({name: m["r_matrix"] for name, m in methods.items()}, heat)
    return [*save_figure(fig, out / "digits_curves.png"), heat]
