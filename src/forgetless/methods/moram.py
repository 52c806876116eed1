"""MoRAM (docs/DESIGN.md §2.2): rank-1 memory atoms beside the target linears, r new atoms per task.

Only the current task's atoms train; earlier atoms are frozen and keep routing (self-activation
over the union). The default lr is the source's 5e-4; the LoRA-style arms use 1e-3.
Ablations as in the source: `moram[top_k=0;tau=1;delta=none]` is plain self-activated retrieval;
add back top_k=8, tau=0.03 or delta=0.2 one at a time.

Source: Mixture of Rank-1 Memory (MoRAM), the MoRAM poster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from forgetless.methods.bank import BankConfig, GrowingBank
from forgetless.methods.base import register_method
from forgetless.models.gpt import recorded_forward
from forgetless.nn.moram import MoRAMConfig, MoRAMLinear


@dataclass
class MoRAMMethodConfig(BankConfig, MoRAMConfig):
    lr: float | None = field(default=5e-4, metadata={"help": "learning rate (the source's LLM setting)"})


@register_method("moram")
class MoRAM(GrowingBank):
    """Rank-1 memory atoms beside the linears, r new atoms per task, self-activated retrieval."""
    Config = MoRAMMethodConfig
    order = 60
    module_cls = MoRAMLinear
    per_task = ("keys", "values")

    @classmethod
    def figures(cls, results, labels, folder):
        return [folder / "atom_map.png"] if atom_maps(results, labels, folder / "atom_map.png") else []

    def task_report(self, model, windows, max_windows: int = 32):
        """Atom-activation map: mean evaluation mixture weight of every atom (averaged over the
        wrapped layers) on each task's held-out windows; `atom_task` says which task added it."""
        layers = [m for _, m in self.banks(model)]
        if not layers or not layers[0].n_atoms:
            return {}
        weights = []
        for w in windows:
            recorded_forward(model, layers, w[:max_windows])
            weights.append(torch.stack([m.last_weights for m in layers]).mean(0).tolist())  # (R,)
        return {"atom_task": layers[0].atom_task(), "atom_weights": weights}


def atom_maps(results: dict, labels: list[str], path: Path) -> bool:
    """MoRAM-style activation maps: for each arm with atoms (rows) and each stage t (columns), the
    mean mixture weight of every atom (grouped by the task that added it) on each task's inputs."""
    from forgetless.report.figures import plt
    arms = {name: results["methods"][name]["task_reports"] for name in labels
            if results["methods"][name].get("task_reports") and "atom_weights" in results["methods"][name]["task_reports"][-1]}
    if not arms:
        return False
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
    return True
