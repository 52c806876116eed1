"""Figures of the methods' own diagnostics, drawn from what they return as data (`report`, `task_report` and
curve monitors in results.json), keyed by method name: APN routing, Neutral Residues' gates, CMS levels, MoRAM
atoms. A method of one's own registers its figure with `@draws(NAME)` in its file."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from forgetless.report.figures import colors, plt, reported, save
from forgetless.report.results import RunResult

Drawer = Callable[[RunResult, list[str], Path], list[Path]]  # (results, the arms' labels, folder) -> files written
DRAWERS: dict[str, list[Drawer]] = {}  # method name -> the figures of its arms


def draws(*names: str):
    """Decorator: the figure `fn(results, labels, folder)` draws the arms of the methods `names`."""
    def wrap(fn: Drawer) -> Drawer:
        for name in names:
            DRAWERS.setdefault(name, []).append(fn)
        return fn
    return wrap


def method_figures(results: RunResult, folder: Path) -> list[Path]:
    """Every figure once, for all the arms (by label) of the methods it draws."""
    arms: dict[Drawer, list[str]] = {}
    for label, m in results.methods.items():
        for draw in DRAWERS.get(m.method, []):
            arms.setdefault(draw, []).append(label)
    return [path for draw, labels in arms.items() for path in draw(results, labels, folder)]


APN = ("apn", "apn-local", "apn-param-matched", "apn-retrofit")
MONITORS = [("usage_entropy", "patch-usage entropy / log K"), ("confidence", "router confidence (max cos)"),
            ("residual_ratio", "||APN(x)|| / ||x||")]


@draws(*APN)
def monitor_curves(results: RunResult, labels: list[str], folder: Path) -> list[Path]:
    """Routing monitors on B during adaptation (dashed: the base's pretraining, on A)."""
    path = folder / "routing_monitors.png"
    methods = {n: results.methods[n].stats for n in labels if "usage_entropy_b" in results.methods[n].stats.get("curves", {})}
    bases = {n: b for n, b in results.extra.get("bases", {}).items() if b.get("evals") and "usage_entropy" in b["evals"][-1]}
    if not methods and not bases:
        return []
    color = colors(list(results.methods))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for col, (key, label) in enumerate(MONITORS):
        for name, m in methods.items():
            axes[0, col].plot(m["curves"]["step"], m["curves"][f"{key}_b"]["mean"], marker=".", color=color[name], label=name)
        axes[0, col].set_title(f"adaptation: {label} on B", fontsize=9)
        axes[0, col].set_xlabel("adaptation step")
        for name, b in bases.items():
            evals = [e for e in b["evals"] if key in e]
            axes[1, col].plot([e["step"] for e in evals], [e[key] for e in evals], ls="--", marker=".", label=f"base {name}")
        axes[1, col].set_title(f"pretraining: {label} on A", fontsize=9)
        axes[1, col].set_xlabel("pretraining step")
    for ax in axes[:, 0]:
        if ax.get_legend_handles_labels()[0]:  # a retrofit has no APN base whose pretraining to show
            ax.legend(fontsize=7)
    save(fig, path, dpi=100)
    return [path]


@draws(*APN)
def routing_histograms(results: RunResult, labels: list[str], folder: Path) -> list[Path]:
    """Per APN arm: active-set overlap of token pairs (A-A reference, A-B before/after adaptation)
    and the router-confidence distribution on A and B ("before" only where the arm reported it)."""
    path = folder / "routing_overlap.png"
    arms = {n: results.methods[n].stats["report"] for n in labels if reported(results, [n], "overlap_ab")}
    if not arms:
        return []
    fig, axes = plt.subplots(2, len(arms), figsize=(4 * len(arms), 7), squeeze=False)
    for col, (name, report) in enumerate(arms.items()):
        after = report["after"]
        before = report.get("before") or after
        k = len(after["overlap_ab"]) - 1
        x = list(range(k + 1))
        width = 0.27
        ax = axes[0, col]
        ax.bar([i - width for i in x], before["overlap_aa"], width, label="A-A pairs, before")
        ax.bar(x, before["overlap_ab"], width, label="A-B pairs, before")
        ax.bar([i + width for i in x], after["overlap_ab"], width, label="A-B pairs, after")
        ax.set_xticks(x)
        ax.set_xlabel(f"shared active patches (of k={k})")
        ax.set_title(f"{name}: active-set overlap", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[1, col]
        edges = after["confidence_bins"]
        mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        for when, rep, ls in (("before", before, "--"), ("after", after, "-"))[int(before is after):]:
            ax.plot(mids, rep["confidence_a"], ls=ls, color="tab:blue", label=f"A, {when}")
            ax.plot(mids, rep["confidence_b"], ls=ls, color="tab:red", label=f"B, {when}")
        ax.set_xlabel("router confidence (max cosine to a prototype)")
        ax.set_title(f"{name}: confidence distribution", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, path, dpi=100)
    return [path]


def shown_layers(n_layers: int, most: int = 6) -> list[int]:
    """Every layer of a shallow model; of a deep one `most` evenly spaced, the first and last among them."""
    if n_layers <= most:
        return list(range(n_layers))
    return sorted({round(i * (n_layers - 1) / (most - 1)) for i in range(most)})


@draws("neutral")
def gate_histograms(results: RunResult, labels: list[str], folder: Path) -> list[Path]:
    """Neutral-residue gates after adaptation: distribution of g(x) on held-out A vs B, per layer (at most six
    layers of a deep model: results.json keeps them all)."""
    path = folder / "gates.png"
    arms = reported(results, labels, "gate_hist_a")
    if not arms:
        return []
    n_layers = max(len(r["gate_hist_a"]) for r in arms.values())
    shown = shown_layers(n_layers)
    fig, axes = plt.subplots(len(arms), len(shown), figsize=(3.2 * len(shown), 2.6 * len(arms)), squeeze=False)
    for row, (name, r) in zip(axes, arms.items()):
        edges = r["gate_bins"]
        mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        for layer, ax in zip([i for i in shown if i < len(r["gate_hist_a"])], row):
            for side, color in (("a", "tab:blue"), ("b", "tab:red")):
                ax.step(mids, r[f"gate_hist_{side}"][layer], where="mid", color=color,
                        label=f"{side.upper()}: mean {r[f'gate_mean_{side}'][layer]:.3f}, "
                              f"closed {r[f'gate_closed_{side}'][layer]:.0%}")
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_title(f"{name} · layer {layer}", fontsize=8)
            ax.set_xlabel("gate g(x) (last bin: ≥)", fontsize=7)
            ax.legend(fontsize=6)
    save(fig, path, dpi=100)
    return [path]


@draws("cms", "cms-fast")
def level_changes(results: RunResult, labels: list[str], folder: Path) -> list[Path]:
    """CMS arms: how far each level (by update period) moved during adaptation, relative to its size."""
    path = folder / "level_change.png"
    arms = reported(results, labels, "level_change")
    if not arms:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(arms)
    for k, (name, r) in enumerate(arms.items()):
        xs = [i + k * width for i in range(len(r["level_periods"]))]
        ax.bar(xs, r["level_change"], width=width, label=name)
    periods = next(iter(arms.values()))["level_periods"]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(periods))], [f"C = {round(c)}" for c in periods])
    ax.set(xlabel="CMS level (update period)", ylabel="||θ - θ_base|| / ||θ_base|| after adaptation",
           title="How much each CMS level moved (mean over layers and seeds)")
    ax.legend(fontsize=8)
    save(fig, path, dpi=110)
    return [path]


@draws("moram")
def atom_maps(results: RunResult, labels: list[str], folder: Path) -> list[Path]:
    """MoRAM-style activation maps: for each arm with atoms (rows) and each stage t (columns), the
    mean mixture weight of every atom (grouped by the task that added it) on each task's inputs."""
    path = folder / "atom_map.png"
    reports = {name: results.methods[name].stats.get("task_reports") for name in labels}
    arms = {name: r for name, r in reports.items() if r and "atom_weights" in r[-1]}
    if not arms:
        return []
    stages = max(len(reports) for reports in arms.values())
    fig, axes = plt.subplots(len(arms), stages, figsize=(2.4 * stages + 1.5, 3.2 * len(arms)), squeeze=False,
                             constrained_layout=True)
    vmax = max(v for reports in arms.values() for r in reports for row in r["atom_weights"] for v in row)
    for axes_row, (name, reports) in zip(axes, arms.items()):
        for t, (ax, report) in enumerate(zip(axes_row, reports), start=1):
            image = ax.imshow(list(zip(*report["atom_weights"])), aspect="auto", cmap="magma", vmin=0, vmax=vmax,
                              interpolation="nearest")
            owner = [round(a) for a in report["atom_task"]]
            edges = [i for i in range(1, len(owner)) if owner[i] != owner[i - 1]]
            for e in edges:
                ax.axhline(e - 0.5, color="white", lw=0.8)
            starts = [0, *edges]
            ax.set_yticks([(s + e - 1) / 2 for s, e in zip(starts, [*edges, len(owner)])],
                          [f"task {owner[s]}" for s in starts], fontsize=7)
            ax.set_xticks(range(len(report["atom_weights"])), range(len(report["atom_weights"])), fontsize=7)
            ax.set_xlabel("inputs of task", fontsize=8)
            ax.set_title(f"{name}\nafter task {t}" if t == 1 else f"after task {t}", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="mean mixture weight w_i (evaluation)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [path]
