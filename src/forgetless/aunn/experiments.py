"""`forgetless aunn bench EXPERIMENT` (and `forgetless hope bench`): run an experiment over seeds, write results.json, results.md, figures.

An experiment is a module with a `Config` dataclass and `run(cfg, seed) -> dict` (one seed),
`summarize(cfg, runs) -> dict`, `markdown(results) -> str`, `figures(results, out) -> [paths]`.
Each finished seed is kept under `out/seeds/`, so an interrupted bench resumes where it stopped.
"""
from __future__ import annotations

import datetime
import importlib
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from forgetless.checkpoint import write_json
from forgetless.config import from_dict
from forgetless.errors import ForgetlessError

EXPERIMENTS = {
    "toy": ("forgetless.aunn.toy", "memorise a repeating pattern of runs, extrapolate past the end, change one datum"),
    "shakespeare": ("forgetless.aunn.shakespeare",
                    "Tiny Shakespeare: prequential bits/byte after the training range, vs the byte GPT"),
    "digits": ("forgetless.aunn.digits", "permuted 8x8 digits as one online list: learning speed per task, retention"),
}


def pm(stat: dict, scale: float = 100.0, digits: int = 1) -> str:
    """`mean ± std` of a stat of `mean_std`, scaled (default: as %); the mean alone for one seed (no spread)."""
    from forgetless.report.tables import cell

    return cell({"mean": scale * stat["mean"], "std": scale * stat["std"]}, f"{{:.{digits}f}}", with_std="ci95" in stat)


def save_figure(fig, path: Path) -> list[Path]:
    """Legend every labelled panel, then write a small PNG."""
    from forgetless.report.figures import save

    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    save(fig, path, dpi=90)
    return [path]


def experiment(name: str, registry: dict = EXPERIMENTS):
    """The module of experiment `name` in `registry` (name -> (module, about)): the AUNN's by default."""
    if name not in registry:
        raise ForgetlessError(f"unknown experiment {name!r}; valid: {', '.join(registry)}")
    return importlib.import_module(registry[name][0])


def build_config(name: str, overrides: dict, registry: dict = EXPERIMENTS):
    return from_dict(experiment(name, registry).Config, overrides, name)


def run_experiment(name: str, overrides: dict, seeds: list[int], out: Path,
                   registry: dict = EXPERIMENTS) -> tuple[dict, list[Path]]:
    """Run (or reuse) every seed, then summarise; returns (results, files written). CPU times are
    measured with torch's current number of threads (the CLI sets one by default)."""
    from forgetless.continual.plan import run_or_reuse_arm
    from forgetless.continual.protocol import provenance

    if not seeds:
        raise ForgetlessError("give at least one seed")
    mod = experiment(name, registry)
    cfg = build_config(name, overrides, registry)
    runs = [run_or_reuse_arm(out / "seeds" / f"seed{seed}.json", {"config": asdict(cfg), "seed": seed},
                             lambda _dir, seed=seed: mod.run(cfg, seed)) for seed in seeds]
    results = {"experiment": name, "date": datetime.date.today().isoformat(), "seeds": seeds,
               "threads": torch.get_num_threads(), **provenance("cpu"), "machine": platform.machine(),
               "config": asdict(cfg), **mod.summarize(cfg, runs)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    (out / "results.md").write_text(mod.markdown(results))
    return results, [out / "results.json", out / "results.md", *mod.figures(results, out)]
