"""Figures of a two-domain run: retention vs adaptation, forgetting curves, loss curves."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def colors(names: list[str]) -> dict:
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def scatter(results: dict, path: Path):
    """One point per method: forgetting on A (x, lower is better) vs PPL on B after (y)."""
    methods = results["methods"]
    color = colors(list(methods))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, m in methods.items():
        x, y = m["forgetting"], m["ppl_b_after"]
        ax.errorbar(100 * x["mean"], y["mean"], xerr=100 * x["std"], yerr=y["std"], fmt="o", color=color[name],
                    capsize=3, label=f"{name} ({m['trainable_params']:,} trainable)")
        ax.annotate(name, (100 * x["mean"], y["mean"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    first = next(iter(methods.values()))
    ax.set_xlabel("forgetting F on A (% rise of PPL_A)  ← better")
    ax.set_ylabel("PPL on B after adaptation  ↓ better")
    ax.set_title(f"Retention vs adaptation ({results['preset']}, {len(results['seeds'])} seed(s))\n"
                 f"base: PPL_A {first['ppl_a_before']['mean']:.3f}, PPL_B {first['ppl_b_before']['mean']:.3f}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(results: dict, key: str, ylabel: str, title: str, path: Path):
    color = colors(list(results["methods"]))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, m in results["methods"].items():
        c = m["curves"]
        mean, std = c[key]["mean"], c[key]["std"]
        ax.plot(c["step"], mean, marker=".", color=color[name], label=name)
        ax.fill_between(c["step"], [u - s for u, s in zip(mean, std)], [u + s for u, s in zip(mean, std)],
                        color=color[name], alpha=0.15)
    ax.set_xlabel("adaptation step on B")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_curves(results: dict, path: Path):
    color = colors(list(results["methods"]))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, m in results["methods"].items():
        loss = m["curves"]["loss"]
        ax.plot(loss["step"], smooth(loss["mean"]), color=color[name], label=name)
    ax.set_xlabel("adaptation step on B")
    ax.set_ylabel("training loss on B (nats/token, smoothed)")
    ax.set_title("Adaptation loss curves")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smooth(values: list[float], width: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def write_figures(results: dict, folder: Path) -> list[Path]:
    paths = [folder / "retention_vs_adaptation.png", folder / "forgetting_curves.png",
             folder / "adaptation_curves.png", folder / "loss_curves.png"]
    scatter(results, paths[0])
    curves(results, "ppl_a", "PPL on A (held out)", "Forgetting curves: retention on A during adaptation", paths[1])
    curves(results, "ppl_b", "PPL on B (held out)", "Adaptation curves: PPL on B during adaptation", paths[2])
    loss_curves(results, paths[3])
    return paths
