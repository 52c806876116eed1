"""The task-sequence protocol (docs/DESIGN.md §3): a base on task 0, then tasks 1..T in order.

R[t][i] = next-token accuracy (%) on task i's held-out windows after training through task t;
row 0 is the base (with the method attached, before any new task). OP, BWT, forgetting and FWT
come from R; the PPL matrix is kept beside it. The same matrix on the tasks' validation windows
(`r_matrix_dev`, metrics `*_dev`) is where choices (lr, knobs, frontier operating points) are made.
A method's `task_report` after each task t (e.g. MoRAM's atom-activation map) is kept as
`task_reports[t - 1]`.
"""
from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.nn as nn

from forgetless.adapted import attach
from forgetless.continual.arm import adapt_task
from forgetless.continual.evaluate import evaluate
from forgetless.continual.metrics import DEV_METRICS, dev_metrics, sequence_metrics
from forgetless.continual.plan import run_arms
from forgetless.continual.protocol import (PROTOCOLS, Protocol, RunContext, build_arms, fresh, load_pretrained,
                                           provenance, register_protocol)
from forgetless.data.domains import Domain, load_domains
from forgetless.errors import ForgetlessError
from forgetless.methods import Method, MethodSpec
from forgetless.monitor import PeakRSS
from forgetless.presets import AdaptConfig, RunConfig
from forgetless.report import SEQUENCE
from forgetless.report.results import RunResult
from forgetless.stats import mean_nested, mean_std, per_seed

METRICS = ["op", "op_tasks", "bwt", "bwt_drop", "bwt_tasks", "bwt_drop_clipped", "forgetting", "forgetting_tasks",
           "fwt", "la"]


def replay_source(tasks: list[Domain], t: int, mix_from: str, method: Method) -> Domain:
    """Where task t's mixed-in rows come from: `earlier` (tasks 0..t-1, their training text joined), or
    the task named `mix_from`; a method whose mixed rows must be original data (Neutral) gets task 0."""
    if method.mixes_original:
        return tasks[0]
    if mix_from == "earlier":
        return dataclasses.replace(tasks[0], train=torch.cat([d.train for d in tasks[:t]]))
    return next(d for d in tasks if d.spec == mix_from)


def replay_tag(cfg: RunConfig, method: Method) -> dict:
    """What an arm that replays every earlier task adds to its config (and so its cache key): arms saved
    before a4102dc replayed task 0 under the same `mix_from: earlier` and must not be reused for it."""
    mix = method.own("mix", cfg.adapt.mix)
    replays_earlier = cfg.data.mix_from == "earlier" and mix > 0 and not method.mixes_original
    return {"replay": "tasks 0..t-1"} if replays_earlier else {}


def check_mix_from(specs: list[str], mix_from: str):
    if mix_from != "earlier" and mix_from not in specs:
        raise ForgetlessError(f"data.mix_from {mix_from!r} is not a task of this sequence ({', '.join(specs)}); "
                              "give --data-mix-from earlier or one of them")


def run_sequence_arm(model: nn.Module, method: Method, tasks: list[Domain], cfg: AdaptConfig, seed: int,
                     mix_from: str = "earlier", before: tuple | None = None) -> dict:
    """Train `method` on tasks[1:] in order (mixed-in rows, if any, from `replay_source`); score every
    task after each. A joint arm (`method.cfg.joint`, e.g. mtl) learns them at once instead: `joint_phase`.
    `before`: `base_scores` of `model` (arms on one base share it), taken as row 0 where attach changes no
    output (`Method.attach_rounding` 0), else row 0 is scored here."""
    torch.manual_seed(seed)
    adapted = attach(model, method)
    model = adapted.model
    windows = [d.windows for d in tasks]
    rows, dev_rows = [[r] for r in (before if before and method.attach_rounding == 0 else
                                      base_scores(model, tasks, cfg.precision))]
    reports, wall, loss = [], 0.0, []
    T = len(tasks) - 1
    phases = [joint_phase(tasks, cfg, replay_source(tasks, 1, mix_from, method))] if method.cfg.joint else \
        [(t, task, cfg, replay_source(tasks, t, mix_from, method), tasks[t - 1]) for t, task in enumerate(tasks[1:], 1)]
    with PeakRSS() as memory:
        for t, task, task_cfg, replay_from, learned in phases:
            t0 = time.perf_counter()
            history, params = adapt_task(adapted, task, replay_from, task_cfg, t, 1000 * seed + t, learned=learned,
                                         desc=f"{method.name} seed {seed} " + ("all tasks" if method.cfg.joint else f"task {t}"))
            wall += time.perf_counter() - t0
            loss += [[t, s, v] for s, v in history.loss]
            row, dev_row = base_scores(model, tasks, cfg.precision)
            rows.append(row)
            dev_rows.append(dev_row)
            reports.append(method.task_report(model, windows))
    if method.cfg.joint:  # one state after all tasks: it is every row's "after task t" (metrics.sequence_metrics)
        rows, dev_rows, reports = rows[:1] + rows[1:] * T, dev_rows[:1] + dev_rows[1:] * T, reports * T
    R = [[100 * e["acc"] for e in row] for row in rows]
    joint = {"joint": True} if method.cfg.joint else {}
    dev = {"r_matrix_dev": dev_rows, **dev_metrics(dev_rows)} if dev_rows[0] else {}
    return {"method": method.name, "seed": seed, **joint, "r_matrix": R,
            "ppl_matrix": [[e["ppl"] for e in row] for row in rows],
            **sequence_metrics(R, bool(joint)), **dev, "trainable_params": sum(p.numel() for _, p in params),
            "total_params": sum(p.numel() for p in model.parameters()), "wall_s": wall,
            "peak_rss_mb": memory.peak_mb, "loss": loss, **({"task_reports": reports} if any(reports) else {})}


def base_scores(model: nn.Module, tasks: list[Domain], precision: str) -> tuple[list[dict], list[float]]:
    """(evaluate on each task's held-out windows, accuracy (%) on each task's validation windows: [] unless every
    task has them): one row of R and of R on validation windows."""
    dev = all(d.dev_windows is not None and len(d.dev_windows) for d in tasks)
    return ([evaluate(model, d.windows, precision=precision) for d in tasks],
            [100 * evaluate(model, d.dev_windows, precision=precision)["acc"] for d in tasks] if dev else [])


def joint_phase(tasks: list[Domain], cfg: AdaptConfig, replay_from: Domain) -> tuple:
    """The one training phase of a joint arm, as task 1 after the base: the training text of tasks 1..T
    joined (each task weighs as its training text; a window across two tasks' seam is rare, as rare as
    across two works of one corpus), for the steps the sequential arms take in all (T x cfg.steps, one
    schedule); its mixed-in rows, if any, come from `replay_from`, task 1's replay source."""
    joint = dataclasses.replace(tasks[1], spec="joint:" + ",".join(d.spec for d in tasks[1:]),
                                train=torch.cat([d.train for d in tasks[1:]]))
    return 1, joint, dataclasses.replace(cfg, steps=cfg.steps * (len(tasks) - 1)), replay_from, tasks[0]


@register_protocol
class Sequence(Protocol):
    """A base on the first corpus, then the tasks in order, every task scored after each."""
    name = "sequence"
    report = SEQUENCE
    default_methods = {"first": "full,lora,ewc,moram,seq-lora"}
    result_keys = ("tasks", "score", "config", "bases")
    method_keys = (*METRICS, "r_matrix", "ppl_matrix")

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        """Every (method, seed) arm over the corpus sequence (bases as in the two-domain protocol); its results
        (docs/DESIGN.md §6.3)."""
        cfg, device = ctx.cfg, ctx.device
        specs = [cfg.data.domain_a, *cfg.data.tasks]
        if len(specs) < 2:
            raise ForgetlessError("the sequence protocol needs tasks after the base: --tasks CORPUS1,CORPUS2,...")
        check_mix_from(specs, cfg.data.mix_from)
        built = build_arms(cfg, methods, sequence=True)
        pretrained = load_pretrained(ctx.model, device, ctx.cfg.load)
        tasks, tokenizer = load_domains(specs, pretrained[1] if pretrained else cfg.data.tokenizer, cfg.model.block_size,
                                        cfg.data.val_fraction, cfg.data.eval_windows,
                                         cfg.data.dev_fraction)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
        ctx = dataclasses.replace(ctx, cfg=cfg)

        def arm_config(label, method, base_name):
            return {"protocol": "sequence", "config": cfg.to_dict(), "method": method.name, "options": method.options(),
                    "base": base_name, "tasks": [t.fingerprint for t in tasks], **replay_tag(cfg, method)}

        def arm_seconds(calibration, method, base_cfg):
            T, windows = len(tasks) - 1, sum(t.windows.shape[0] for t in tasks)
            return (T * cfg.adapt.steps * calibration.step(base_cfg, method, cfg.adapt.batch_size)
                    + (T + 1) * windows * calibration.window(base_cfg))

        befores: dict[str, tuple] = {}  # base name -> its scores (row 0), shared by the arms on it

        def run(label, method, seed, base_name, load, arm_dir):
            model = load()
            if method.attach_rounding == 0 and base_name not in befores:
                befores[base_name] = base_scores(model, tasks, cfg.adapt.precision)
            return run_sequence_arm(model, fresh(method), tasks, cfg.adapt, seed, cfg.data.mix_from,
                                    befores.get(base_name))

        arms, summary = run_arms(ctx, built, tasks[0], tokenizer, pretrained, arm_config, run, arm_seconds)
        return RunResult.from_json({
            "protocol": "sequence", "preset": ctx.preset, "seeds": list(ctx.seeds), "base_seeds": ctx.base_seeds,
            "tasks": specs, **provenance(device), "precision": ctx.precision,
            "load": dataclasses.asdict(cfg.load),
            "score": "next-token accuracy on held-out windows, %", "date": datetime.date.today().isoformat(),
            "config": cfg.to_dict(), "bases": summary, "model": ctx.model,
            "methods": {label: summarize(runs, built[label]) for label, runs in arms.items()},
        })


run_sequence = PROTOCOLS["sequence"]  # run_sequence(cfg, methods, seeds, out, preset, device, model, ...)


def summarize(runs: list[dict], method: Method) -> dict:
    """One arm's method entry: every seed's metrics computed once from its R, then their mean ± std."""
    runs = [{**r, **sequence_metrics(r["r_matrix"], r.get("joint", False))} for r in runs]
    return {"method": method.name, **({"joint": True} if method.cfg.joint else {}), **{m: mean_std([r[m] for r in runs]) for m in METRICS}, **dev_summary(runs),
            "wall_s": mean_std([r["wall_s"] for r in runs]),
            "r_matrix": mean_nested([r["r_matrix"] for r in runs]),
            "ppl_matrix": mean_nested([r["ppl_matrix"] for r in runs]),
            "trainable_params": runs[0]["trainable_params"], "total_params": runs[0]["total_params"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "options": method.options(),
            "per_seed": per_seed(runs, METRICS + DEV_METRICS),
            **({"task_reports": mean_nested([r["task_reports"] for r in runs])} if "task_reports" in runs[0] else {})}


def dev_summary(runs: list[dict]) -> dict:
    """Seed means of the validation metrics and R (`*_dev`, `r_matrix_dev`) when every run has them, else {}."""
    if not all("r_matrix_dev" in r for r in runs):
        return {}
    return {**{m: mean_std([r[m] for r in runs]) for m in DEV_METRICS},
            "r_matrix_dev": mean_nested([r["r_matrix_dev"] for r in runs])}
