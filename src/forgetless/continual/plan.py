"""The plan of a bench run, printed before its first step: the bases to pretrain (or found cached), the
arms to run (or found saved) and the time they should take, from a few training steps and one evaluation
timed on this machine. The run's bar then counts estimated seconds, so its time left corrects itself
with the speed the run really has.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forgetless.adapted import attach
from forgetless.checkpoint import write_json
from forgetless.config import code_fingerprint, stable_hash
from forgetless.continual.base_model import base_label, base_path, cached_base, load_base, warn_if_other_code
from forgetless.continual.evaluate import evaluate
from forgetless.continual.protocol import RunContext
from forgetless.data.splits import Batch
from forgetless.device import machine_text
from forgetless.continual.workers import can_fork, run_jobs, worker_threads
from forgetless.errors import ForgetlessError
from forgetless.methods import Method, build_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.progress import console, duration, progress_task


@dataclass
class Job:
    kind: str        # "base" (pretraining) or "arm" (a method and seed)
    label: str
    seconds: float   # estimated
    done: bool       # a cached base or a saved arm: no work left


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    calibration_s: float = 0.0
    calibrated: bool = True  # False: no estimate (a pretrained model: each loop shows its own time left)
    workers: int = 1         # processes side by side: the bases, then the arms, split between them
    auto: bool = False       # several `workers` chosen by the plan (--workers auto), not given

    @property
    def seconds(self) -> float:
        """Estimated seconds of the work left: per phase (bases, then arms), its jobs' time over the
        workers, and never less than its longest job."""
        left = [[j.seconds for j in self.jobs if j.kind == kind and not j.done] for kind in ("base", "arm")]
        return sum(max(sum(times) / self.workers, max(times)) for times in left if times)

    def summary(self) -> str:
        """One line: 'plan: pretrain 1 of 2 bases (1 cached), run 36 arms (0 saved) · about 9m 10s ...'."""
        parts = []
        for kind, verb, kept in (("base", "pretrain", "cached"), ("arm", "run", "saved")):
            jobs = [j for j in self.jobs if j.kind == kind]
            if jobs:
                todo = sum(not j.done for j in jobs)
                noun = f"{kind}{'s' if len(jobs) > 1 else ''}"
                parts.append(f"{verb} {todo} of {len(jobs)} {noun}" + (f" ({len(jobs) - todo} {kept})" if todo < len(jobs) else ""))
        if not self.calibrated:
            return f"plan: {', '.join(parts)}"
        threads = worker_threads(self.workers)
        on = f" on {self.workers} workers" if self.workers > 1 else ""
        on += " (auto)" if self.auto else ""
        return (f"plan: {', '.join(parts)} · about {duration(self.seconds)}{on} "
                f"(from steps timed here, {threads} thread{'s' if threads > 1 else ''}, in {self.calibration_s:.1f} s)")

    def show(self):
        console.print(self.summary(), highlight=False, soft_wrap=True)


class Calibration:
    """Seconds per training step (per base config, method and batch size) and per evaluated window, timed
    on fresh random-weight models on `device`: speed does not depend on the weights' values."""

    def __init__(self, device: torch.device):
        self.device, self.cache, self.spent = device, {}, 0.0

    def step(self, model_cfg: GPTConfig, method: Method | None, batch_size: int) -> float:
        """Seconds per optimizer step of `method` (None: pretraining, every weight) on a `model_cfg` GPT."""
        key = stable_hash([model_cfg.to_dict(), method and [method.name, method.options()], batch_size])
        if key not in self.cache:
            self.cache[key] = self.timed(lambda: step_seconds(model_cfg, method, batch_size, self.device))
        return self.cache[key]

    def window(self, model_cfg: GPTConfig) -> float:
        """Seconds to evaluate one held-out window."""
        key = stable_hash([model_cfg.to_dict(), "eval"])
        if key not in self.cache:
            self.cache[key] = self.timed(lambda: window_seconds(model_cfg, self.device))
        return self.cache[key]

    def timed(self, fn) -> float:
        t0 = time.perf_counter()
        value = fn()
        self.spent += time.perf_counter() - t0
        return value


def step_seconds(model_cfg: GPTConfig, method: Method | None, batch_size: int, device: torch.device,
                 timed: int = 2) -> float:
    """Mean time of `timed` AdamW steps (after one warm-up step) on random tokens."""
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    windows = torch.randint(model_cfg.vocab_size, (batch_size, model_cfg.block_size + 1), device=device)  # (B, T+1)
    if method is None:
        adapted = attach(model, build_method("full"))
    else:
        adapted = attach(model, build_method(method.name, method.options()))
        adapted.start_task(1, windows if adapted.method.needs_previous else None)
    opt = torch.optim.AdamW([p for _, p in adapted.trainable_parameters()], lr=0.0)
    times = []
    for _ in range(timed + 1):
        t0 = time.perf_counter()
        loss = adapted.losses(Batch.of(windows))[0]  # a Batch: its rows are marked (none from old data)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sum(times[1:]) / timed


def window_seconds(model_cfg: GPTConfig, device: torch.device, n: int = 16) -> float:
    """Time per window of evaluating `n` random windows (after a warm-up)."""
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    windows = torch.randint(model_cfg.vocab_size, (n, model_cfg.block_size + 1), device=device)  # (n, T+1)
    evaluate(model, windows[:2])
    t0 = time.perf_counter()
    evaluate(model, windows)
    return (time.perf_counter() - t0) / n


# ---- a bench run: bases, then arms, planned and under one bar ---------------------------------------
def run_arms(ctx: RunContext, built: dict, domain, tokenizer, pretrained, run_config, run,
             arm_seconds) -> tuple[dict, dict]:
    """Every (seed, arm) of `built` (label -> Method) over the run context `ctx`, saved under `ctx.out/arms/` as
    it finishes and reused when its config matches. First the plan; then one bar over the bases to pretrain on
    `domain` (cached; a `pretrained` (model, tokenizer) needs none) and the arms. With `ctx.base_seeds` N > 1,
    arm seed s starts from a base pretrained with seed pretrain.seed + s mod N (its own base, cached).

    `run_config(label, method, base_name)` is an arm's config (its saved result is reused while it matches);
    `run(label, method, seed, base_name, load, arm_dir)` runs it (`load()` is a fresh copy of its base);
    `arm_seconds(calibration, method, base_cfg)` estimates it. `workers` > 1: bases, then arms, run in that
    many forked CPU processes side by side (`continual.workers`). Returns (label -> results per seed, bases summary)."""
    cfg, seeds, device, model, out, base_seeds, workers = (ctx.cfg, ctx.seeds, ctx.device, ctx.model, ctx.out,
                                                           ctx.base_seeds, ctx.workers)
    if pretrained and base_seeds > 1:
        raise ForgetlessError("--base-seeds pretrains forgetless's own bases; a pretrained --model has one base")
    bases: dict[Path, tuple] = {}     # base checkpoint -> (model config, pretraining config)
    base_of: dict[tuple, Path] = {}  # (label, seed) -> base checkpoint
    if not pretrained:
        for seed, (label, method) in itertools.product(seeds, built.items()):
            pretrain = cfg.pretrain if base_seeds == 1 else \
                dataclasses.replace(cfg.pretrain, seed=cfg.pretrain.seed + seed % base_seeds)
            path = base_path(method.base_config(cfg.model), pretrain, domain, tokenizer)
            bases.setdefault(path, (method.base_config(cfg.model), pretrain))
            base_of[label, seed] = path
    name_of = (lambda label, seed: pretrained_name(model, pretrained[0])) if pretrained else \
        (lambda label, seed: base_of[label, seed].parent.name)
    todo = [(seed, label, out / "arms" / label / f"seed{seed}.json", run_config(label, built[label], name_of(label, seed)))
            for seed, label in itertools.product(seeds, built)]
    plan = make_plan(built, cfg.model, bases, todo, device, arm_seconds, not pretrained, domain.windows.shape[0],
                     workers)
    plan.show()
    units = {id(j): max(1, round(j.seconds)) if plan.calibrated else 1 for j in plan.jobs}
    results: dict[str, list[dict]] = {label: [] for label in built}
    base_jobs = [j for j in plan.jobs if j.kind == "base"]
    arm_jobs = [j for j in plan.jobs if j.kind == "arm"]
    by_index: dict[int, dict] = {}

    def arm(seed, label, arm_path, config):
        load = (lambda: copy.deepcopy(pretrained[0])) if pretrained else \
            (lambda: load_base(base_of[label, seed])[0].to(device))
        return lambda: run_or_reuse_arm(arm_path, config, lambda arm_dir: run(label, built[label], seed,
                                                                              name_of(label, seed), load, arm_dir))
    total = sum(units[id(j)] for j in plan.jobs if not j.done)
    rate = total / plan.seconds if plan.calibrated and plan.seconds > 0 else None  # units per second, as planned
    with progress_task("bench", total=total, percent=plan.calibrated, rate=rate) as advance:
        def arm_done(i, result):
            by_index[i] = result
            advance(0 if arm_jobs[i].done else units[id(arm_jobs[i])], arms=f"{len(by_index)}/{len(todo)}")
        run_jobs([lambda c=c, p=p: cached_base(c, p, domain, tokenizer, device) for c, p in bases.values()],
                 plan.workers, lambda i, _: advance(0 if base_jobs[i].done else units[id(base_jobs[i])]))
        run_jobs([arm(*job) for job in todo], plan.workers, arm_done, [j.seconds for j in arm_jobs])
    for i, (seed, label, _, _) in enumerate(todo):  # in seed order, whatever order they finished in
        results[label].append(by_index[i])
    if pretrained:
        from forgetless.models.hf import describe
        return results, {model: describe(pretrained[0])}
    return results, bases_summary(list(bases))


AUTO_ARM_S = 5.0  # --workers auto: processes side by side when the arms to run are estimated at this mean or more
AUTO_MAX_WORKERS = 8


def make_plan(built: dict, model_cfg: GPTConfig, bases: dict, todo: list, device, arm_seconds, calibrated: bool,
              n_windows: int, workers: int | None = 1) -> Plan:
    """The jobs of `run_arms`, each marked done (cached base, saved arm) or estimated (when `calibrated`, with
    the threads each job gets: a phase of one job runs in this process with all its threads).

    `workers` None (--workers auto): one process of one thread per torch thread (at most AUTO_MAX_WORKERS) when
    two or more arms are left to run and the plan estimates them at AUTO_ARM_S seconds or more on average (a fork
    then pays; forgetless's own models on a CPU, forked processes allowed, no torchrun), else 1."""
    if workers is not None:
        return timed_plan(built, model_cfg, bases, todo, device, arm_seconds, calibrated, n_windows, workers)
    side_by_side = min(torch.get_num_threads(), AUTO_MAX_WORKERS)
    left = sum(saved_arm(path, config) is None for _, _, path, config in todo)
    if calibrated and device.type == "cpu" and side_by_side > 1 and left > 1 and can_fork():
        plan = timed_plan(built, model_cfg, bases, todo, device, arm_seconds, calibrated, n_windows, side_by_side)
        arms = [j.seconds for j in plan.jobs if j.kind == "arm" and not j.done]
        if len(arms) > 1 and sum(arms) / len(arms) >= AUTO_ARM_S:
            return dataclasses.replace(plan, auto=True)
    return timed_plan(built, model_cfg, bases, todo, device, arm_seconds, calibrated, n_windows, 1)


def timed_plan(built: dict, model_cfg: GPTConfig, bases: dict, todo: list, device, arm_seconds, calibrated: bool,
               n_windows: int, workers: int) -> Plan:
    calibration = Calibration(device) if calibrated else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads if len(bases) < 2 else worker_threads(workers))  # run_jobs: one job, here
        jobs = plan_bases(bases, calibration, n_windows)
        torch.set_num_threads(threads if len(todo) < 2 else worker_threads(workers))
        jobs += plan_arms(built, model_cfg, todo, calibration, arm_seconds)
    finally:
        torch.set_num_threads(threads)
    return Plan(jobs, calibration.spent if calibration else 0.0, calibrated, workers)


def plan_bases(bases: dict, calibration, n_windows: int) -> list[Job]:
    """Every base as a Job: done (cached), or its seconds from `calibration` (None: no estimate)."""
    jobs = []
    for path, (base_cfg, pretrain) in bases.items():
        done = path.exists()
        seconds = 0.0 if done or not calibration else pretrain_seconds(calibration, base_cfg, pretrain, n_windows)
        jobs.append(Job("base", f"{base_label(base_cfg)} seed {pretrain.seed}", seconds, done))
    return jobs


def plan_arms(built: dict, model_cfg: GPTConfig, todo: list, calibration, arm_seconds) -> list[Job]:
    """Every arm as a Job: done (saved), or its seconds from `calibration` (None: no estimate)."""
    jobs = []
    for seed, label, arm_path, config in todo:
        done = saved_arm(arm_path, config) is not None
        method = built[label]
        seconds = 0.0 if done or not calibration else arm_seconds(calibration, method, method.base_config(model_cfg))
        jobs.append(Job("arm", f"{label} seed {seed}", seconds, done))
    return jobs


def pretrain_seconds(calibration: Calibration, model_cfg: GPTConfig, cfg, n_windows: int) -> float:
    return (cfg.steps * calibration.step(model_cfg, None, cfg.batch_size)
            + n_evaluations(cfg) * n_windows * calibration.window(model_cfg))


def n_evaluations(cfg) -> int:
    """Curve points of a training run: step 0, every `eval_every` steps, the end."""
    return 1 + math.ceil(cfg.steps / cfg.eval_every)


def pretrained_name(spec: str, lm) -> str:
    from forgetless.adapted import architecture_fingerprint
    return f"{spec}-{architecture_fingerprint(lm)['hash']}"


def bases_summary(paths: list[Path]) -> dict:
    """Base label -> its checkpoint, pretraining time, steps and curve; with several pretraining seeds,
    one entry per seed ("dense seed 1")."""
    metas = [load_base(path)[2] for path in paths]
    several = len({m["train_config"]["seed"] for m in metas}) > 1
    out = {}
    for path, m in zip(paths, metas):
        label = base_label(GPTConfig(**m["model_config"]))
        out[f"{label} seed {m['train_config']['seed']}" if several else label] = {
            "path": str(path), "pretrain_wall_s": m["wall_s"], "ffn": m["model_config"]["ffn"],
            "ffn_options": m["model_config"]["ffn_options"], "pretrain_steps": m["train_config"]["steps"],
            "pretrain_seed": m["train_config"]["seed"], "evals": m["history"]["evals"]}
    return out


def saved_arm(arm_path: Path, run_config: dict) -> dict | None:
    """The arm's saved result when its config matches `run_config`, else None. It matches when equal, or when
    `run_config` differs only by keys the saved config does not have (config fields and method options added to
    the code after the arm was saved: the arm ran without them); `config_added` lists those."""
    if arm_path.exists():
        saved = json.loads(arm_path.read_text())
        if saved.get("config_hash") == stable_hash(run_config):
            return saved
        if "run_config" in saved:
            added = sorted(added_keys(saved["run_config"], run_config))
            if added and stable_hash(without(run_config, saved["run_config"])) == saved["config_hash"]:
                return {**saved, "config_added": added}
    return None


def added_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys of `new` that `old` lacks (at any depth of nested dicts)."""
    out = []
    for key, value in new.items():
        if key not in old:
            out.append(f"{prefix}{key}")
        elif isinstance(value, dict) and isinstance(old[key], dict):
            out += added_keys(old[key], value, f"{prefix}{key}.")
    return out


def without(new: dict, old: dict) -> dict:
    """`new` without the keys `old` lacks (at any depth)."""
    return {k: without(v, old[k]) if isinstance(v, dict) and isinstance(old[k], dict) else v
            for k, v in new.items() if k in old}


def run_or_reuse_arm(arm_path: Path, run_config: dict, run) -> dict:
    """The arm's saved result if its config matches, else `run(arm_dir)`, saved."""
    saved = saved_arm(arm_path, run_config)
    if saved is not None:
        warn_if_other_code(saved.get("code"), f"arm {arm_path}", "delete it to run the arm again")
        if saved.get("config_added"):
            console.print(f"arm {arm_path} reused: saved before {', '.join(saved['config_added'])} existed (delete it "
                          "to run it again)", highlight=False, soft_wrap=True)
        return saved
    result = run(arm_path.parent)
    result["config_hash"], result["run_config"] = stable_hash(run_config), json.loads(json.dumps(run_config))
    result["code"], result["machine"] = code_fingerprint(), machine_text()
    write_json(arm_path, result)
    return result
