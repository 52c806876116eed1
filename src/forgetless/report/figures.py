"""Figures of what every method returns: retention vs adaptation, forgetting and loss curves, the
mixing sweep, optimizer pretraining curves and frontier (two-domain), R heatmaps (sequence). The figures
of each method's own diagnostics (APN routing, Neutral gates, CMS levels, MoRAM atoms): report/diagnostics.py."""
from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from forgetless.errors import need
from forgetless.report.results import RunResult

PLOTS_MISSING = "figures skipped: matplotlib is not installed (pip install 'forgetless[plots]', then `forgetless report DIR`)"


def available() -> bool:
    """Whether matplotlib is installed (the `plots` extra): without it a bench writes its tables and no figures."""
    return importlib.util.find_spec("matplotlib") is not None


@functools.cache
def pyplot():
    """matplotlib.pyplot on the Agg backend, imported on first use, or a one-line error naming the extra."""
    need("matplotlib", "plots", "drawing figures").use("Agg")
    import matplotlib.pyplot
    return matplotlib.pyplot


class LazyPyplot:
    """Stands for matplotlib.pyplot and imports it when first used, so that `import forgetless` and every
    non-drawing path run without matplotlib."""

    def __getattr__(self, name: str):
        return getattr(pyplot(), name)


plt = LazyPyplot()


def save(fig, path: Path, dpi: int = 110):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def colors(names: list[str]) -> dict:
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def scatter(results: RunResult, path: Path):
    """One point per method: forgetting on A (x, lower is better) vs PPL on B after (y)."""
    methods = results.methods
    color = colors(list(methods))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, m in methods.items():
        x, y = m.stats["forgetting"], m.stats["ppl_b_after"]
        ax.errorbar(100 * x["mean"], y["mean"], xerr=100 * x["std"], yerr=y["std"], fmt="o", color=color[name],
                    capsize=3, label=f"{name} ({m.trainable_params:,} trainable)")
        ax.annotate(name, (100 * x["mean"], y["mean"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    bases = {(m.stats["ppl_a_before"]["mean"], m.stats["ppl_b_before"]["mean"]) for m in methods.values()}
    base_note = "base: PPL_A {:.3f}, PPL_B {:.3f}".format(*bases.pop()) if len(bases) == 1 else \
        f"{len(bases)} different bases (see PPL before in the table)"
    ax.set_xlabel("forgetting F on A (% rise of PPL_A)  ← better")
    ax.set_ylabel("PPL on B after adaptation  ↓ better")
    ax.set_title(f"Retention vs adaptation ({results.preset}, {len(results.seeds)} seed(s))\n{base_note}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    save(fig, path, dpi=110)


def curves(results: RunResult, key: str, ylabel: str, title: str, path: Path):
    color = colors(list(results.methods))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, m in results.methods.items():
        c = m.stats["curves"]
        band(ax, c["step"], c[key], color[name], name)
    ax.set_xlabel("adaptation step on B")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    save(fig, path, dpi=110)


def band(ax, steps: list, stat: dict, color, label: str):
    """A mean curve with its ± std band (over seeds)."""
    mean, std = stat["mean"], stat["std"]
    ax.plot(steps, mean, marker=".", color=color, label=label)
    ax.fill_between(steps, [u - s for u, s in zip(mean, std)], [u + s for u, s in zip(mean, std)], color=color, alpha=0.15)


def loss_curves(results: RunResult, path: Path):
    color = colors(list(results.methods))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, m in results.methods.items():
        loss = m.stats["curves"]["loss"]
        ax.plot(loss["step"], smooth(loss["mean"]), color=color[name], label=name)
    ax.set_xlabel("adaptation step on B")
    ax.set_ylabel("training loss on B (nats/token, smoothed)")
    ax.set_title("Adaptation loss curves")
    ax.legend(fontsize=8)
    save(fig, path, dpi=110)


def smooth(values: list[float], width: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def reported(results: RunResult, labels: list[str], key: str) -> dict:
    """Arm -> its method report after adaptation, for the arms `labels` whose report has `key`."""
    after = {name: results.methods[name].stats.get("report", {}).get("after", {}) for name in labels}
    return {name: report for name, report in after.items() if report.get(key)}


def mix_sweep(results: RunResult, path: Path) -> bool:
    """Forgetting F and gain G against the mixing ratio p for every method run plain and as
    `NAME[mix=p]` with at least three values of p in all (a plain arm's p: its option, else --mix)."""
    run_mix = results.adapt.get("mix", 0.0)
    lines: dict[str, list] = {}
    for label, m in results.methods.items():
        name = re.fullmatch(r"([\w-]+)(\[mix=[^;\]]+\])?", label)
        if name:
            mix = m.options.get("mix")
            lines.setdefault(name.group(1), []).append((run_mix if mix is None else mix, m.stats))
    lines = {name: sorted(pts, key=lambda t: t[0]) for name, pts in lines.items() if len(pts) >= 3}
    if not lines:
        return False
    color = colors(list(lines))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in lines.items():
        xs = [max(p, 1e-3) for p, _ in pts]
        for ax, key, scale in ((axes[0], "forgetting", 100), (axes[1], "adaptation_gain", 1)):
            ax.errorbar(xs, [scale * m[key]["mean"] for _, m in pts], [scale * m[key]["std"] for _, m in pts],
                        marker="o", capsize=3, color=color[name], label=name)
    for ax, label in zip(axes, ("forgetting F on A (%)", "adaptation gain G")):
        ax.set(xscale="log", xlabel="fraction p of each batch from A (p = 0 drawn at 0.001)", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle("Data mixing sweep", fontsize=10)
    save(fig, path, dpi=110)
    return True


def pretraining_curves(results: RunResult, path: Path) -> bool:
    """Optimizer comparison: pretraining loss (smoothed) and held-out PPL_A per optimizer, mean ± std."""
    runs = results.extra.get("pretraining")
    if not runs:
        return False
    color = colors(list(runs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in runs.items():
        left.plot(r["loss"]["step"], smooth(r["loss"]["mean"], 25), color=color[name], label=name)
        band(right, r["ppl_a"]["step"], r["ppl_a"], color[name], name)
    seeds = len(next(iter(runs.values()))["seeds"])
    left.set(xlabel="pretraining step", ylabel="training loss on A (nats/token, smoothed)",
             title=f"Pretraining loss by optimizer ({seeds} seed(s))")
    right.set(xlabel="pretraining step", ylabel="held-out PPL on A", yscale="log", title="Held-out perplexity")
    for ax in (left, right):
        ax.legend(fontsize=8)
    save(fig, path, dpi=110)
    return True


def optimizer_frontier(results: RunResult, path: Path) -> bool:
    """Optimizer comparison with `--lrs`: forgetting vs PPL_B of every arm, one line per optimizer
    through its learning rates (each point labelled with its lr)."""
    if not results.extra.get("optimizers"):
        return False
    adapt = results.adapt
    lines: dict[str, list] = {}
    for name, m in results.methods.items():
        opts = m.options
        key = f"{name.split('[')[0]}, {opts.get('optimizer') or adapt['optimizer']}"
        lines.setdefault(key, []).append((opts.get("lr") or adapt["lr"], m.stats["forgetting"], m.stats["ppl_b_after"]))
    if all(len(points) < 2 for points in lines.values()):
        return False
    color = colors(list(lines))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key, points in lines.items():
        points.sort()
        xs, ys = [100 * f["mean"] for _, f, _ in points], [b["mean"] for _, _, b in points]
        ax.errorbar(xs, ys, xerr=[100 * f["std"] for _, f, _ in points], yerr=[b["std"] for _, _, b in points],
                    marker="o", color=color[key], capsize=2, label=key)
        for lr, x, y in zip([p[0] for p in points], xs, ys):
            ax.annotate(f"{lr:.0e}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color[key])
    before = next(iter(results.methods.values())).stats["ppl_b_before"]["mean"]
    worse = [f"{key} at {lr:.0e}: {b['mean']:.2f}" for key, points in lines.items() for lr, _, b in points
             if b["mean"] > before]
    if worse:  # an arm that ends worse on B than the base would squash the rest: leave it off the axes
        low = min(b["mean"] - b["std"] for points in lines.values() for _, _, b in points)
        ax.set_ylim(low - 0.05 * (before - low), before)
        ax.text(0.99, 0.98, "above the base's PPL_B (off the axes):\n" + "\n".join(worse), transform=ax.transAxes,
                ha="right", va="top", fontsize=7)
    positive = all(f["mean"] > 0 for points in lines.values() for _, f, _ in points)
    ax.set(xscale="log" if positive else "linear", xlabel="forgetting F on A (% rise of PPL_A)  ← better",
           ylabel="PPL on B after adaptation  ↓ better",
           title=f"Retention vs adaptation by optimizer, across learning rates ({len(results.seeds)} seed(s))")
    ax.legend(fontsize=8)
    save(fig, path)
    return True


def write_figures(results: RunResult, folder: Path) -> list[Path]:
    paths = [folder / "retention_vs_adaptation.png", folder / "forgetting_curves.png",
             folder / "adaptation_curves.png", folder / "loss_curves.png"]
    scatter(results, paths[0])
    curves(results, "ppl_a", "PPL on A (held out)", "Forgetting curves: retention on A during adaptation", paths[1])
    curves(results, "ppl_b", "PPL on B (held out)", "Adaptation curves: PPL on B during adaptation", paths[2])
    loss_curves(results, paths[3])
    for name, draw in (("mix_sweep.png", mix_sweep), ("pretraining_curves.png", pretraining_curves),
                       ("optimizer_frontier.png", optimizer_frontier)):
        if draw(results, folder / name):
            paths.append(folder / name)
    return paths


def r_matrices(results: RunResult) -> dict:
    """Label -> the method's R matrix (seed means), for r_heatmaps."""
    return {label: m.stats["r_matrix"] for label, m in results.methods.items()}


def r_heatmaps(methods: dict[str, list[list[float]]], path: Path, per_row: int = 4, title: str | None = None):
    """One heatmap per method of its R matrix (`methods`: label -> R; rows: after task t; columns: task i),
    `per_row` to a row, under `title`."""
    rows, cols = -(-len(methods) // per_row), min(per_row, len(methods))
    fig, axes = plt.subplots(rows, cols, figsize=(2.9 * cols + 1.2, 2.8 * rows), squeeze=False,
                             constrained_layout=True)
    values = [v for r in methods.values() for row in r for v in row if v is not None]  # None: a cell not scored
    for k, ax in enumerate(axes.ravel()):
        if k >= len(methods):
            ax.axis("off")
            continue
        name, r = list(methods.items())[k]
        image = ax.imshow([[float("nan") if v is None else v for v in row] for row in r], cmap="viridis",  # None: blank
                          vmin=min(values), vmax=max(values))
        for t, row in enumerate(r):
            for i, v in enumerate(row):
                if v is not None:
                    ax.text(i, t, f"{v:.1f}", ha="center", va="center", fontsize=6, color="white")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("task i", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("after task t", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy %")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
