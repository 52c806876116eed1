"""An instruction stream as the field reports it (`forgetless study`, docs/DESIGN.md §3.4): each method's lr
chosen on validation rows from a grid on order 1, then every order at that lr, more seeds on order 1, and
OP / BWT / general-PPL change with intervals over test rows and seeds, beside the published rows.

1. Grid (`grid/`): every method at each grid lr on the stream's order 1, one seed, scoring validation rows
   only (each task's last `data.dev_rows` training rows, never trained on; no test row is scored).
2. Choice: `LR_RULE`, declared before any arm runs.
3. Orders (`order<k>/`): the chosen arms on each order, `seeds` seeds each, `order1_seeds` on order 1,
   scoring the test rows (every one with the study's default `data.test_rows` 0).
4. Results: order 1's R and metrics per method (the sequence schema), and beside them the lr grid and choice,
   every order's metrics and their mean, bootstrap intervals (continual/bootstrap.py) and paired differences.

Every arm is saved as it finishes under its phase's folder and reused when its config matches (continual/plan.py),
so a study resumes; `plan_study` estimates its minutes from steps and scoring timed here.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import gc
import os
import re
import statistics
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from forgetless.continual import bootstrap
from forgetless.continual.instruct import (arm_jobs, base_config, joined, learn_task, load_stream, run_arms_on,
                                           scored_on, sequence_results)
from forgetless.continual.plan import saved_arm
from forgetless.continual.protocol import Protocol, Request, RunContext, build_arms, fresh, provenance, register_protocol
from forgetless.continual.sequence import Sequence
from forgetless.data.streams import DEFAULT_GRID, EDGE_STEPS, HELD_OUT, LR_RULE, pick_orders, stream_orders
from forgetless.errors import ForgetlessError
from forgetless.hooks import StepHooks
from forgetless.methods import MethodSpec
from forgetless.methods.base import as_specs
from forgetless.presets import RunConfig, resolve_run
from forgetless.progress import console, duration
from forgetless.report.results import RunResult
from forgetless.report.study import STUDY, plan_markdown
from forgetless.stats import mean_nested

TIE = 1e-9  # validation OPs this close are a tie (LR_RULE)
# every test row; 50 validation rows per task carved from training; between tasks only the cells the metrics use
STUDY_DATA = {"test_rows": 0, "dev_rows": 50, "r_cells": "metrics"}


@dataclass(frozen=True)
class Settings:
    """A study's own settings (`forgetless study`'s flags; `bench --protocol study`: the defaults, over --tasks)."""
    stream: str = ""                  # a named stream or task specs, orders by ';' ("": data.tasks as one order)
    orders: str | None = None         # the orders run at the chosen lrs (default: all of the stream's)
    lr_grid: tuple[str, ...] = ()     # --lr-grid entries (default DEFAULT_GRID; ("none",): each method's own lr)
    order1_seeds: int = 0             # seeds on order 1 (0: as many as every order)
    paired_with: str | None = None    # the arm the others are paired with (default: mtl if run, else the first)
    resamples: int = bootstrap.RESAMPLES
    budget_s: float | None = None     # a wall-clock budget: order 1's extra seeds as the estimate fits


@register_protocol
@dataclass
class Study(Protocol):
    """An instruction stream as the field reports it: each method's lr chosen on order 1's validation rows, then every
    order at that lr, with intervals over test rows and seeds (`forgetless study`, `bench --protocol study`)."""
    settings: Settings = dataclasses.field(default_factory=Settings)
    name = "study"
    pretrains = False
    report = STUDY
    instruction_rows = True
    method_set = Sequence.name
    # the floor (sequential LoRA), the ceiling (joint training), replay (20 % of each batch from the earlier tasks),
    # the toy goal's recipe, and the field's baselines; on every preset
    default_methods = {"*": "seq-lora,mtl,seq-lora[mix=0.2],ewc-distill,osf,o-lora,moram"}
    result_keys = ("kind", "tasks", "score", "study", "config", "bases")
    method_keys = ("op_tasks", "bwt_tasks", "la", "general_ppl_change", "r_matrix", "lr", "arm", "orders", "intervals")

    def check(self, request: Request):
        if request.model == "byte-gpt":
            raise ForgetlessError("a study runs instruction tasks on a pretrained model: give --model smollm2-135m, "
                                  "hf:PATH or a .gguf file")
        super().check(request)

    def stream(self, cfg: RunConfig) -> str:
        return self.settings.stream or ",".join(cfg.data.tasks)

    def config_defaults(self, tasks: list[str]) -> dict:
        return study_defaults(self.settings.stream or ",".join(tasks))

    def seeds(self, seeds: list[int]) -> list[int]:
        """Order 1's seeds: every order's, then more up to `order1_seeds`."""
        return list(range(seeds[0], seeds[0] + max(self.settings.order1_seeds, len(seeds))))

    def configuration(self, request: Request, arms: list) -> dict:
        stream = self.stream(request.cfg)
        return {"study": stream, "orders": list(pick_orders(stream, self.settings.orders)), "preset": request.preset,
                "model": request.model, "methods": [s.label for s in arms],
                "lr_grid": list(self.settings.lr_grid) or None, "config": request.cfg.to_dict()}

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        """The grid, then every order, on the pretrained `ctx.model` (`run_study`), with the run's provenance."""
        from forgetless.models.hf import describe, load_model
        stream, settings, seeds = self.stream(ctx.cfg), self.settings, list(ctx.seeds)
        orders, grid_order, order1 = pick_orders(stream, settings.orders), stream_orders(stream)["1"], self.seeds(seeds)
        specs, grid = as_specs(methods), parse_grid(list(settings.lr_grid) or None)
        lm, tokenizer = load_model(ctx.model, ctx.device, ctx.cfg.load)
        if settings.budget_s is not None:
            os.nice(19 - os.nice(0))  # the lowest priority: a study shares the machine for hours
            estimate = plan_study(lm, tokenizer, ctx.cfg, specs, orders, grid_order, seeds, order1, grid, ctx.out,
                                  ctx.model)
            order1, line = fit_budget(estimate, settings.budget_s, seeds, order1)
            console.print(plan_markdown(estimate) + "\n" + line, markup=False, highlight=False, soft_wrap=True)
        results = run_study(lm, tokenizer, ctx.cfg, specs, stream, orders, grid_order, seeds, order1, grid, ctx.out,
                            ctx.preset, ctx.model, settings.resamples, settings.paired_with)
        return results.with_keys(**provenance(ctx.device), model=ctx.model, bases={ctx.model: describe(lm)},
                                 precision=ctx.precision, load=dataclasses.asdict(ctx.cfg.load))


def study_defaults(stream: str) -> dict:
    """Config the study sets over the preset's (a config file and flags still win): every test row, validation
    rows, and the stream's held-out task (none for a stream written out)."""
    return {"data": {**STUDY_DATA, "held_out_tasks": HELD_OUT.get(stream, [])}}


def loaded(model: str, device: str, cfg: RunConfig):
    """(the pretrained model on its device, its tokenizer, `cfg` with its precision settled there, the provenance
    of a results file)."""
    from forgetless.models.hf import describe, load_model
    device, cfg, precision = resolve_run(cfg, device)  # auto resolved; a device or precision it lacks refused
    lm, tokenizer = load_model(model, device, cfg.load)
    return lm, tokenizer, cfg, {**provenance(device), "model": model, "bases": {model: describe(lm)},
                                "precision": precision, "load": dataclasses.asdict(cfg.load)}


# ---- the lr grid ----------------------------------------------------------------------------------
def parse_grid(entries: list[str] | None) -> dict[str, list[tuple[str, float]]] | None:
    """--lr-grid entries -> {label or "": [("x", factor) | ("=", lr)]}; None for "none". An entry is
    `[LABEL=]V1,V2,...`: `x1/3` multiplies the method's lr, `3e-4` is an lr; "" is every other arm's (default
    `DEFAULT_GRID`)."""
    entries = entries or []
    if [e.strip() for e in entries] == ["none"]:
        return None
    grid = {}
    for entry in [DEFAULT_GRID, *entries]:
        label, _, values = entry.rpartition("=") if "=" in entry.split("[")[-1].split("]")[-1] else ("", "", entry)
        try:
            points = [("x", float(Fraction(v.strip()[1:]))) if v.strip().startswith("x") else ("=", float(v))
                      for v in values.split(",") if v.strip()]
        except (ValueError, ZeroDivisionError):
            points = []
        if not points or any(v <= 0 for _, v in points):
            raise ForgetlessError(f"--lr-grid {entry!r}: write factors of each method's lr (x1/3,x1,x3), learning "
                                  "rates (1e-4,3e-4,1e-3), LABEL=VALUES for one method, or none")
        grid[label.strip()] = points
    return grid


def grid_lrs(grid: dict, spec: MethodSpec, cfg: RunConfig) -> list[float]:
    """The lrs `spec` runs at in the grid, ascending: its entry's (else the default's) around its own lr."""
    base = spec.build(cfg.methods.get(spec.name)).own("lr", cfg.adapt.lr)
    points = grid.get(spec.label, grid.get(spec.name, grid[""]))
    return sorted({float(lr_text(base * v if kind == "x" else v)) for kind, v in points})


def lr_text(lr: float) -> str:
    return f"{lr:.3g}"


def at_lr(spec: MethodSpec, lr: float) -> MethodSpec:
    """The arm of `spec` at `lr` (its label shows the lr: seq-lora[mix=0.2;lr=0.0003])."""
    return MethodSpec(spec.name, {**{k: v for k, v in spec.options.items() if k != "lr"}, "lr": lr_text(lr)})


def choose(points: list[tuple[float, float]]) -> float:
    """`LR_RULE` over (lr, validation OP) points: the lr of the highest OP; ties go to the lower lr."""
    best = max(op for _, op in points)
    return min(lr for lr, op in points if op >= best - TIE)


def next_point(points: list[tuple[float, float]], start: list[float]) -> float | None:
    """The lr `LR_RULE` runs next, None once the choice is made: while the best of (lr, validation OP) `points` is at
    an end of the grid, one grid step (the ratio of that end's two points) beyond it, up to `EDGE_STEPS` points
    beyond `start` (the grid it began with) per end."""
    lrs, pick = sorted(lr for lr, _ in points), choose(points)
    if len(lrs) < 2:
        return None
    if pick == lrs[-1] and sum(lr > max(start) for lr in lrs) < EDGE_STEPS:
        return float(lr_text(lrs[-1] ** 2 / lrs[-2]))
    if pick == lrs[0] and sum(lr < min(start) for lr in lrs) < EDGE_STEPS:
        return float(lr_text(lrs[0] ** 2 / lrs[1]))
    return None


def grid_entries(points: list[tuple[float, MethodSpec]], start: list[float], arms: dict, tasks: list[str],
                 draws: bootstrap.Draws) -> list[dict]:
    """One method's grid points as results.json keeps them: lr, arm, chosen, `added` (beyond the starting grid by
    the edge rule), `edge` (chosen at an end of the final grid: the best lr may lie beyond it), validation metrics,
    and `op_vs_chosen`: the validation OP difference from the chosen point, paired over the validation rows."""
    pick = choose([(lr, arms[p.label][0]["op_tasks"]) for lr, p in points])
    lrs = sorted(lr for lr, _ in points)
    chosen = bootstrap.Runs.of(arms[dict(points)[pick].label], tasks)
    return [{"lr": lr, "arm": p.label, "chosen": lr == pick, "added": lr not in start,
             "edge": lr == pick and lr in (lrs[0], lrs[-1]),
             **{f"{m}_dev": arms[p.label][0][m] for m in bootstrap.METRICS},
             "wall_s": arms[p.label][0]["wall_s"], "code": arms[p.label][0].get("code", "not recorded"),
             "op_vs_chosen": bootstrap.paired({"1": bootstrap.Runs.of(arms[p.label], tasks)}, {"1": chosen},
                                              draws)["op_tasks"]} for lr, p in points]


# ---- the study --------------------------------------------------------------------------------------
def with_tasks(cfg: RunConfig, tasks: list[str]) -> RunConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=list(tasks)))


def order_seeds(orders: dict, seeds: list[int], order1_seeds: list[int]) -> dict[str, list[int]]:
    """Seeds per order: `order1_seeds` on order 1, `seeds` on the others."""
    return {k: order1_seeds if k == "1" else seeds for k in orders}


def run_order(orders: dict, seeds: list[int], order1_seeds: list[int]) -> list[tuple[str, list[int]]]:
    """(order, its seeds) in the order a study runs them: every order at `seeds` first, then order 1 again at all of
    `order1_seeds` (its arms at `seeds` reused), so a stopped study has the three orders before order 1's extra seeds."""
    first = [(k, seeds) for k in orders]
    return first + [(k, s) for k, s in order_seeds(orders, seeds, order1_seeds).items() if s != seeds]


def check_study(cfg: RunConfig, specs: list[MethodSpec], grid, seeds: list[int], order1_seeds: list[int],
                paired_with: str | None = None):
    """One-line errors before any work."""
    if grid is not None and not cfg.data.dev_rows:
        raise ForgetlessError("the lr grid chooses on validation rows, and data.dev_rows is 0: give --data-dev-rows N "
                              "(e.g. 50), or --lr-grid none to run each method at its own lr")
    if not seeds or not set(seeds) <= set(order1_seeds):
        raise ForgetlessError(f"order 1 runs at least the seeds every order runs: --order1-seeds "
                              f"{len(order1_seeds)} < --seeds {len(seeds)}")
    labels = [s.label for s in specs]
    if len(set(labels)) < len(labels):
        raise ForgetlessError("a method is listed twice in --methods; list each arm once")
    if paired_with is not None and paired_with not in labels:
        raise ForgetlessError(f"--paired-with {paired_with}: not among --methods ({', '.join(labels)})")


def run_study(lm, tokenizer, cfg: RunConfig, specs: list[MethodSpec], stream: str, orders: dict[str, list[str]],
              grid_order: list[str], seeds: list[int], order1_seeds: list[int], grid, out: Path, preset: str,
              model: str, resamples: int = bootstrap.RESAMPLES, paired_with: str | None = None) -> RunResult:
    """The whole study on a loaded model: the grid on `grid_order` (the stream's order 1), then `orders`.
    Returns the study's results (the sequence schema for the main order, plus `study` and per-method
    `lr`, `arm`, `lr_grid`, `orders`, `intervals`, `over_orders`, `paired`)."""
    from forgetless.report import write_report
    check_study(cfg, specs, grid, seeds, order1_seeds, paired_with)
    labels = [s.label for s in specs]
    paired_with = paired_with or next((s.label for s in specs if s.name == "mtl"), labels[0])
    build_arms(cfg, specs, sequence=True)  # bad names, options or joint arms fail before the grid runs
    chosen, grids = {s.label: s for s in specs}, {}
    if grid is not None:
        start = {s.label: grid_lrs(grid, s, cfg) for s in specs}
        points = {s.label: [(lr, at_lr(s, lr)) for lr in start[s.label]] for s in specs}
        grid_cfg = with_tasks(cfg, grid_order)
        while True:  # the grid, then a point beyond an end where the best sits (LR_RULE), until none is needed
            built, arms = run_arms_on(lm, tokenizer, grid_cfg, [p for ps in points.values() for _, p in ps],
                                      seeds[:1], out / "grid", model, "validation")
            more = {s.label: lr for s in specs if (lr := next_point(
                [(lr, arms[p.label][0]["op_tasks"]) for lr, p in points[s.label]], start[s.label])) is not None}
            for s in specs:
                if s.label in more:
                    points[s.label] = sorted([*points[s.label], (more[s.label], at_lr(s, more[s.label]))])
                    console.print(f"{s.label}: the best validation OP is at an end of its lr grid: lr "
                                  f"{lr_text(more[s.label])} beyond it joins the grid", markup=False, highlight=False)
            if not more:
                break
        write_report(sequence_results(grid_cfg, built, arms, seeds[:1], preset, "validation"), out / "grid", False)
        draws = bootstrap.Draws(resamples)
        for label, ps in points.items():
            grids[label] = grid_entries(ps, start[label], arms, grid_order, draws)
            chosen[label] = next(p for (_, p), g in zip(ps, grids[label]) if g["chosen"])
    per_order = {}
    for k, seeds_k in run_order(orders, seeds, order1_seeds):
        cfg_k = with_tasks(cfg, orders[k])
        built, arms = run_arms_on(lm, tokenizer, cfg_k, list(chosen.values()), seeds_k, out / f"order{k}", model, "test")
        write_report(sequence_results(cfg_k, built, arms, seeds_k, preset, "test"), out / f"order{k}", False)
        per_order[k] = (cfg_k, built, {label: arms[chosen[label].label] for label in labels})
    return study_results(cfg, specs, chosen, grids, per_order, stream, orders, grid, seeds, order1_seeds, preset,
                         model, resamples, paired_with)


def study_results(cfg, specs, chosen, grids, per_order, stream, orders, grid, seeds, order1_seeds, preset, model,
                  resamples, paired_with) -> RunResult:
    main = "1" if "1" in per_order else next(iter(per_order))
    cfg_main, built_main, arms_main = per_order[main]
    results = sequence_results(cfg_main, {s.label: built_main[chosen[s.label].label] for s in specs}, arms_main,
                               order_seeds(orders, seeds, order1_seeds)[main], preset, "test").with_keys(model=model)
    draws = bootstrap.Draws(resamples)
    runs = {label: {k: bootstrap.Runs.of(arms[label], cfg_k.data.tasks) for k, (cfg_k, _, arms) in per_order.items()}
            for label in results.methods}
    for spec in specs:
        label, m = spec.label, results.methods[spec.label].stats
        method = chosen[label].build(cfg.methods.get(spec.name))
        m.update(lr=method.own("lr", cfg.adapt.lr), arm=chosen[label].label, joint=method.cfg.joint,
                 reads_previous=method.needs_previous,
                 orders={k: order_entry(arms[label], cfg_k.data.tasks) for k, (cfg_k, _, arms) in per_order.items()},
                 intervals=bootstrap.intervals({main: runs[label][main]}, draws))
        if grids:
            m["lr_grid"] = grids[label]
        if len(per_order) > 1:
            m["over_orders"] = bootstrap.intervals(runs[label], draws)
        if label != paired_with:
            m["paired"] = {"vs": paired_with, "order": main,
                           **bootstrap.paired({main: runs[label][main]}, {main: runs[paired_with][main]}, draws)}
            if len(per_order) > 1:
                m["paired_over_orders"] = {"vs": paired_with, **bootstrap.paired(runs[label], runs[paired_with], draws)}
    every = "over_orders" if len(per_order) > 1 else "intervals"
    base = {k: r.before() for k, r in runs[paired_with].items()}  # every arm of an order holds the same base scores
    scope = (lambda label: runs[label]) if len(per_order) > 1 else (lambda label: {main: runs[label][main]})
    op_vs = {a: {b: bootstrap.paired(scope(a), scope(b), draws)["op_tasks"] for b in runs if b != a} for a in runs}
    from forgetless.report.references import references
    results.extra["study"] = {
        "stream": stream, "orders": {k: list(v) for k, v in orders.items()}, "main_order": main,
        "seeds_per_order": len(seeds), "order1_seeds": list(order1_seeds),
        "lr_grid": grid and {label or "*": [[kind, v] for kind, v in points] for label, points in grid.items()},
        "lr_rule": LR_RULE if grid else "none: each method at its own lr", "grid_order": "1", "grid_seed": seeds[0],
        "bootstrap": {"resamples": resamples, "level": bootstrap.LEVEL, "how": BOOTSTRAP_HOW},
        "paired_with": paired_with, "references": references(stream),
        "base": {"intervals": bootstrap.intervals({main: base[main]}, draws), every: bootstrap.intervals(base, draws),
                 "orders": {k: bootstrap.observed({k: r})["op_tasks"] for k, r in base.items()}},
        "op_differences": {"over": every, "pairs": op_vs},  # OP of each arm minus each other's, paired
        "compute": compute_spent(results),
        "machines": sorted({a.get("machine", "not recorded") for _, _, arms in per_order.values()
                            for seed_arms in arms.values() for a in seed_arms})}  # where the orders' arms ran
    return results


def compute_spent(results: RunResult) -> dict:
    """The study's arms (grid points and every order's seeds), their summed wall time (each arm's training and
    scoring, not loading the model) and the code fingerprints that ran them."""
    entries = [e for m in results.methods.values() for e in [*m.stats.get("lr_grid", []), *m.stats["orders"].values()]]
    return {"arms": sum(len(e.get("seeds", [0])) for e in entries), "wall_s": sum(e["wall_s"] for e in entries),
            "codes": sorted({c for e in entries for c in e.get("codes", [e.get("code")])})}


BOOTSTRAP_HOW = ("percentile intervals; each replicate draws every task's test rows and the general text's windows "
                 "with replacement (the same draw for every seed, order and method), then each order's seeds")


def order_entry(arms: list[dict], tasks: list[str]) -> dict:
    """One order's seed means of the field's metrics, its seeds and R."""
    return {"tasks": list(tasks), "seeds": [a["seed"] for a in arms], "wall_s": sum(a["wall_s"] for a in arms),
            "codes": sorted({a.get("code", "not recorded") for a in arms}),
            **{m: statistics.fmean(a[m] for a in arms) for m in bootstrap.METRICS},
            "r_matrix": mean_nested([a["r_matrix"] for a in arms])}


# ---- the compute plan ---------------------------------------------------------------------------------
class StepTimes(StepHooks):
    """Records when each optimizer step ends."""

    def __init__(self):
        self.ends = []

    def after_step(self, model, optimizer, step, last):
        self.ends.append(time.perf_counter())


def plan_study(lm, tokenizer, cfg: RunConfig, specs: list[MethodSpec], orders: dict[str, list[str]],
               grid_order: list[str], seeds: list[int], order1_seeds: list[int], grid, out: Path, model: str,
               timed_steps: int = 3) -> dict:
    """Arms x estimated minutes of the study, from this machine: per method, `timed_steps` training steps (after
    one more) on rows of every task, the rest of a task's time (start and end of a task: EWC's Fisher, OSF's
    split), attaching, and scoring timed on a few rows of each task on the bare model. Arms saved in `out`
    count 0 (an order's arms as well once the grid has chosen their lr)."""
    check_study(cfg, specs, grid, seeds, order1_seeds)
    streams = functools.cache(lambda tasks, scored: scored_on(load_stream(with_tasks(cfg, tasks), tokenizer), scored))

    def saved(tasks: list[str], arms: list[MethodSpec], seeds_: list[int], folder: str, scored: str) -> list:
        c = with_tasks(cfg, tasks)
        jobs = arm_jobs(lm, c, build_arms(c, arms, sequence=True), streams(tuple(tasks), scored), seeds_, out / folder,
                        model, scored)
        return [saved_arm(path, config) for _, _, _, path, config in jobs]

    def scored_before(tasks: list[str], scored: str, folder: str) -> bool:  # the base's scores saved (before.json)
        c = with_tasks(cfg, tasks)
        config = base_config(lm, c, streams(tuple(tasks), scored), model, scored)
        return saved_arm(out / folder / "before.json", config) is not None

    scoring = scoring_seconds(lm, tokenizer, streams(tuple(grid_order), "both"), cfg)
    T, steps, rows, busy = len(grid_order), cfg.adapt.steps, [], set()  # busy: runs with an arm left to train
    for spec in specs:
        method = spec.build(cfg.methods.get(spec.name))
        step_s, task_s, attach_s = method_seconds(lm, streams(tuple(grid_order), "both"), cfg, method, timed_steps)
        joint = method.cfg.joint
        train_s = attach_s + (task_s + T * steps * step_s if joint else T * (task_s + steps * step_s))
        lean = cfg.data.r_cells == "metrics"  # between tasks: the task just learned alone
        arm_s = {kind: train_s + scoring[kind] + (0 if joint else (T - 1) * scoring[f"{kind}_task" if lean else kind])
                 for kind in ("test", "validation")}
        lrs, found, final = grid_known(spec, grid_lrs(grid, spec, cfg) if grid is not None else [],
                                       lambda more: saved(grid_order, more, seeds[:1], "grid", "validation"))
        counts = {"grid": [len(lrs), sum(f is None for f in found)], "orders": [0, 0], "extra seeds": [0, 0]}
        for k, seeds_k in order_seeds(orders, seeds, order1_seeds).items():
            for kind, these in (("orders", [s for s in seeds_k if s in seeds]),
                                ("extra seeds", [s for s in seeds_k if s not in seeds])):
                todo = len(these) if final is None or not these else \
                    sum(f is None for f in saved(orders[k], [final], these, f"order{k}", "test"))
                counts[kind] = [counts[kind][0] + len(these), counts[kind][1] + todo]
                busy |= {f"order{k}"} if todo else set()
        busy |= {"grid"} if counts["grid"][1] else set()
        minutes = (counts["grid"][1] * arm_s["validation"]
                   + (counts["orders"][1] + counts["extra seeds"][1]) * arm_s["test"]) / 60
        rows.append({"method": spec.label, "lrs": [lr_text(v) for v in lrs], "step_s": step_s, "task_s": task_s,
                     "attach_s": attach_s, "arm_min": {k: v / 60 for k, v in arm_s.items()}, **counts,
                     "minutes": minutes})
    runs = {"grid": (grid_order, "validation"), **{f"order{k}": (tasks, "test") for k, tasks in orders.items()}}
    before_min = sum(scoring[runs[run][1]] for run in busy if not scored_before(*runs[run], run)) / 60  # once per run
    return {"rows": rows, "tasks": T, "steps_per_task": steps, "batch_size": cfg.adapt.batch_size,
            "precision": cfg.adapt.precision, "scoring_s": scoring, "before_min": before_min,
            "total_min": sum(r["minutes"] for r in rows) + before_min, "orders": {k: list(v) for k, v in orders.items()},
            "seeds": list(seeds), "order1_seeds": list(order1_seeds), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat()}


def grid_known(spec: MethodSpec, start: list[float], saved) -> tuple[list[float], list, MethodSpec | None]:
    """(the grid lrs known so far, their saved arms or None, the chosen arm or None while the grid is not finished):
    the starting grid, then the points the edge rule adds (`next_point`) while the saved arms say which;
    `saved(arms)` looks arms up. No grid: `spec` at its own lr."""
    if not start:
        return [], [], spec
    lrs, found = list(start), saved([at_lr(spec, lr) for lr in start])
    while all(found):
        lr = next_point([(lr, f["op_tasks"]) for lr, f in zip(lrs, found)], start)
        if lr is None:
            return lrs, found, at_lr(spec, choose([(lr, f["op_tasks"]) for lr, f in zip(lrs, found)]))
        lrs, found = [*lrs, lr], [*found, *saved([at_lr(spec, lr)])]
    return lrs, found, None


def method_seconds(lm, stream, cfg: RunConfig, method, timed_steps: int) -> tuple[float, float, float]:
    """(seconds per training step, the rest of a task's learning, attaching): one task of `timed_steps` + 1 steps on
    every task's rows joined, on a copy of the model."""
    from forgetless.adapted import attach
    model = copy.deepcopy(lm)
    t0 = time.perf_counter()
    adapted = attach(model, fresh(method))
    attach_s = time.perf_counter() - t0
    timer = StepTimes()
    short = dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, steps=timed_steps + 1, warmup=0))
    # the start of the task on a few windows of old data (a method's start, e.g. EWC's Fisher, timed, not run in full)
    few = dataclasses.replace(stream, general=dataclasses.replace(
        stream.general, train=stream.general.train[:START_WINDOWS * (cfg.model.block_size + 1)]))
    t0 = time.perf_counter()
    learn_task(adapted, 1, joined(stream.train), few, short, 0, timer)
    wall = time.perf_counter() - t0
    step_s = (timer.ends[-1] - timer.ends[0]) / timed_steps
    del adapted, model
    gc.collect()  # the copy and the method's tensors (reference cycles through hooks) go before the next method's
    return step_s, max(0.0, wall - (timed_steps + 1) * step_s), attach_s


START_WINDOWS = 16  # windows of old data the compute plan starts a task on


# ---- a wall-clock budget ------------------------------------------------------------------------------
def parse_budget(text: str) -> float:
    """'6h', '90m', '1h30m', '45s' -> seconds."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", text or "")
    if not parts or not any(parts.groups()) or not (seconds := sum(float(v or 0) * unit for v, unit in
                                                                  zip(parts.groups(), (3600, 60, 1)))) > 0:
        raise ForgetlessError(f"--budget {text!r}: give a wall-clock time such as 6h, 90m or 1h30m")
    return seconds


def fit_budget(plan: dict, seconds: float, seeds: list[int], order1_seeds: list[int]) -> tuple[list[int], str]:
    """(order 1's seeds that fit `seconds`, a line saying what runs and its estimate). The minimum always runs: the
    lr grid on order 1 and every order at `seeds`; order 1's extra seeds (each priced at every method's test arm,
    saved arms free) are added while the estimate stays within the budget."""
    extra = [s for s in order1_seeds if s not in seeds]
    per_seed = [r["extra seeds"][1] / max(1, r["extra seeds"][0]) * r["arm_min"]["test"] for r in plan["rows"]]
    seed_min = sum(per_seed)  # minutes of one extra seed on order 1, all methods (the part of it still to run)
    minimum = plan["total_min"] - seed_min * len(extra)
    fits = [s for i, s in enumerate(extra) if minimum + (i + 1) * seed_min <= seconds / 60]
    total = minimum + seed_min * len(fits)
    line = (f"budget {duration(seconds)}: the lr grid on order 1 and orders {', '.join(plan['orders'])} at seed(s) "
            f"{seeds} (about {duration(60 * minimum)} left)" +
            (f" and order 1 at seed(s) {fits} too (about {duration(60 * seed_min)} each)" if fits else "") +
            f": about {duration(60 * total)} left in all" +
            (f"; {len(extra) - len(fits)} more seed(s) on order 1 would not fit" if len(fits) < len(extra) else "") +
            (f". The minimum alone is over the budget: it runs anyway, arm by arm; stop it at any time and run the "
             "same command to resume" if minimum > seconds / 60 else ""))
    return sorted(seeds + fits), line


def scoring_seconds(lm, tokenizer, stream, cfg: RunConfig, rows: int = 8) -> dict[str, float]:
    """Seconds of one scoring pass after a task, on test rows and on validation rows, and of one task's rows
    alone (`test_task`, `validation_task`: the mean over tasks; data.r_cells "metrics" between tasks): a few rows
    of each task and windows of the general text timed on the bare model, scaled to the rows each pass scores."""
    from forgetless.continual.evaluate import evaluate
    from forgetless.continual.instruct import score
    per_row = {}
    for task in [*stream.tasks, *stream.held_out]:
        few = dataclasses.replace(task, test=task.test[:rows])
        t0 = time.perf_counter()
        score(lm, tokenizer, few, cfg)
        per_row[task.name] = (time.perf_counter() - t0) / len(few.test)
    t0 = time.perf_counter()
    evaluate(lm, stream.general.windows[:rows])
    window_s = (time.perf_counter() - t0) / len(stream.general.windows[:rows])
    limit = cfg.data.test_rows or None
    test = sum(per_row[t.name] * len(t.test[:limit]) for t in [*stream.tasks, *stream.held_out])
    dev = sum(per_row[t.name] * len(d.test[:limit]) for t, d in zip(stream.tasks, stream.dev))
    T = len(stream.tasks)
    return {"test": test + window_s * len(stream.general.windows),
            "validation": dev + window_s * len(stream.general.dev_windows),
            "test_task": sum(per_row[t.name] * len(t.test[:limit]) for t in stream.tasks) / T,
            "validation_task": dev / T}
