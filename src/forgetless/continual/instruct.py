"""The instruction-task sequence on a pretrained model (docs/DESIGN.md §3.4): tasks 1..T (prompt/answer
files, e.g. the cl500 streams) learned in order, the loss on the answer tokens only.

R[t][i] = the score (%) on task i's test rows after training through task t (label accuracy by answer
log-likelihood, or exact match of a greedy answer or of its first line); column 0 is general ability, next-token accuracy
on held-out general text, so the R metrics of `continual.metrics` apply as in the corpus sequence.
Beside R: general-text perplexity and held-out tasks (never trained) after every task, and with
`data.dev_rows` the same R on validation rows (each task's last training rows, never trained on;
general text's validation windows in column 0), whose metrics (`*_dev`) are where choices are made.
Each arm keeps the outcome of every scored test row and the general text's loss per window, so intervals
can include the test rows' sampling error (continual/bootstrap.py).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import hashlib
import itertools
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn

from forgetless.adapted import architecture_fingerprint, attach
from forgetless.continual.evaluate import evaluate
from forgetless.continual.metrics import DEV_METRICS, dev_metrics, sequence_metrics
from forgetless.continual.plan import Job, Plan, run_or_reuse_arm, saved_arm
from forgetless.continual.protocol import Protocol, Request, RunContext, build_arms, fresh, provenance, register_protocol
from forgetless.continual.scoring import task_hits
from forgetless.continual.sequence import Sequence, dev_summary
from forgetless.data.domains import Domain, load_domains
from forgetless.data.instructions import (IGNORE, Encoded, InstructionSampler, InstructionTask, encode, is_task_spec,
                                          load_task)
from forgetless.data.splits import eval_windows
from forgetless.errors import ForgetlessError
from forgetless.hooks import HookChain, StepHooks
from forgetless.methods import Method, MethodSpec
from forgetless.monitor import PeakRSS
from forgetless.presets import RunConfig, resolve_run
from forgetless.progress import progress_task
from forgetless.report import SEQUENCE
from forgetless.report.results import RunResult
from forgetless.stats import mean_nested, mean_std, per_seed
from forgetless.train import train

METRICS = ["op", "op_tasks", "bwt", "bwt_drop", "bwt_tasks", "bwt_drop_clipped", "forgetting", "forgetting_tasks",
           "fwt", "la", "general_ppl_change"]


@dataclasses.dataclass
class Stream:
    """What every arm of a run shares: the tasks, their encoded training rows, general text, held-out tasks."""
    tasks: list[InstructionTask]
    train: list[Encoded]
    general: Domain
    held_out: list[InstructionTask]
    mix_from: Encoded | None  # rows mixed into every task (e.g. Lima), else the earlier tasks' rows
    general_rows: Encoded     # windows of the general text's training split, no targets (see learn_task)
    dev: list[InstructionTask]  # each task's validation rows as its test rows (empty: none)

    def fingerprint(self) -> list[str]:
        return [task_hash(t) for t in [*self.tasks, *self.held_out, *self.dev]] + [self.general.fingerprint]


SCORED = ("both", "test", "validation")  # which rows an arm scores after every task (`scored_on`)


class Scored(NamedTuple):
    """Everything scored at one point of an arm (before any task, after each task)."""
    row: list[float]          # the R row: general-text accuracy, then each task's score (%)
    held: list[float]         # the held-out tasks' scores
    ppl: float                # general-text perplexity
    dev: list[float]          # the R row on validation rows ([] without them)
    hits: list[str]           # per task, its scored rows in order: "1" counted right, "0" not
    window_loss: list[float]  # the general text's mean loss per window


@register_protocol
class Instructions(Protocol):
    """The task sequence over instruction tasks on a pretrained model (`bench --protocol sequence` with
    instruction --tasks and a --model)."""
    name = "instructions"
    pretrains = False
    report = SEQUENCE  # its results are a sequence's (`kind` instructions)
    refines = "sequence"
    instruction_rows = True
    method_set, default_methods = "sequence", Sequence.default_methods
    result_keys = ("kind", "tasks", "held_out_tasks", "score", "config", "bases")
    method_keys = ("op", "op_tasks", "bwt", "bwt_tasks", "la", "general_ppl_change", "general_ppl", "r_matrix")

    def takes(self, request: Request) -> bool:
        return any(is_task_spec(t) for t in request.cfg.data.tasks)

    def check(self, request: Request):
        if request.model == "byte-gpt":
            raise ForgetlessError("instruction tasks need a pretrained model: add --model smollm2-135m (or hf:PATH, "
                                  "a .gguf file); byte-gpt takes text corpora as tasks")
        super().check(request)
        if request.workers is not None and request.workers > 1:
            raise ForgetlessError("--workers runs forgetless's own bases and arms side by side; an instruction stream "
                                  "on a pretrained model runs in one process (use --workers 1)")

    def run(self, ctx: RunContext, methods: list[MethodSpec | str]) -> RunResult:
        """Every (method, seed) arm over the instruction tasks `cfg.data.tasks` on the pretrained `ctx.model`."""
        from forgetless.models.hf import describe, load_model
        lm, tokenizer = load_model(ctx.model, ctx.device, ctx.cfg.load)
        results = run_on(lm, tokenizer, ctx.cfg, methods, ctx.seeds, ctx.out, ctx.preset, ctx.model)
        return results.with_keys(**provenance(ctx.device), model=ctx.model, bases={ctx.model: describe(lm)},
                                 precision=ctx.precision,  # as requested (ctx.cfg holds it resolved)
                                 load=dataclasses.asdict(ctx.cfg.load))


def run_on(lm: nn.Module, tokenizer, cfg: RunConfig, methods, seeds: list[int], out: Path, preset: str,
           model: str, scored: str = "both") -> RunResult:
    """The protocol on a loaded model (each arm adapts its own copy) and its tokenizer; `scored`: which rows
    every arm scores (`scored_on`)."""
    _, cfg, precision = resolve_run(cfg, next(lm.parameters()).device)
    built, arms = run_arms_on(lm, tokenizer, cfg, methods, seeds, out, model, scored)
    return sequence_results(cfg, built, arms, seeds, preset, scored).with_keys(precision=precision)


def run_arms_on(lm: nn.Module, tokenizer, cfg: RunConfig, methods, seeds: list[int], out: Path, model: str,
                scored: str = "both") -> tuple[dict, dict[str, list[dict]]]:
    """(label -> Method, label -> each seed's arm result): every arm run, or reused from `out/arms/`."""
    built = build_arms(cfg, methods, sequence=True)
    stream = scored_on(load_stream(cfg, tokenizer), scored)
    arms: dict[str, list[dict]] = {label: [] for label in built}
    todo = arm_jobs(lm, cfg, built, stream, seeds, out, model, scored)
    before = functools.cache(lambda: saved_scores(out / "before.json", base_config(lm, cfg, stream, model, scored),
                                                  lambda: scores(lm, tokenizer, stream, cfg)))  # attach is output-neutral
    Plan([Job("arm", f"{label} seed {seed}", 0.0, saved_arm(path, config) is not None)
          for seed, label, _, path, config in todo], calibrated=False).show()
    with progress_task("bench arms", total=len(todo)) as advance:
        for seed, label, method, arm_path, run_config in todo:
            arms[label].append(run_or_reuse_arm(
                arm_path, run_config,
                lambda arm_dir: instruction_arm(copy.deepcopy(lm), tokenizer, fresh(method), stream, cfg, seed,
                                                arm_dir, before())))
            advance(1)
    return built, arms


def arm_jobs(lm: nn.Module, cfg: RunConfig, built: dict, stream: Stream, seeds: list[int], out: Path, model: str,
             scored: str = "both") -> list[tuple]:
    """(seed, label, method, arm file, arm config) of every arm: the config decides whether a saved arm is
    reused (`plan.saved_arm`)."""
    base = base_config(lm, cfg, stream, model, scored)
    return [(seed, label, method, out / "arms" / label / f"seed{seed}.json",
             {"protocol": "instructions", "config": base["config"], "method": method.name, "options": method.options(),
              **{k: v for k, v in base.items() if k not in ("protocol", "config")}})
            for seed, (label, method) in itertools.product(seeds, built.items())]


def base_config(lm: nn.Module, cfg: RunConfig, stream: Stream, model: str, scored: str) -> dict:
    """What the scores of the untrained model depend on (an arm's config adds its method)."""
    return {"protocol": "instructions", "config": cfg.to_dict(), "model": [model, architecture_fingerprint(lm)],
            "stream": stream.fingerprint(), **({"scored": scored} if scored != "both" else {})}


def saved_scores(path: Path, config: dict, compute) -> Scored:
    """The untrained model's `scores`, saved at `path` and reused while `config` matches: a study run again
    (resumed, or with more methods) does not score the base again."""
    return Scored(*run_or_reuse_arm(path, config, lambda _: {"scores": list(compute())})["scores"])


def sequence_results(cfg: RunConfig, built: dict, arms: dict[str, list[dict]], seeds: list[int], preset: str,
                     scored: str = "both") -> RunResult:
    """The run's results (docs/DESIGN.md §6.3) from its arms."""
    tasks = "label accuracy or exact match (%) on {} (ScienceQA-like tasks: of the answer's first line)"
    score = ("validation rows in place of test rows: column 0: next-token accuracy (%) on the general text's "
             "validation windows; tasks: " + tasks.format("each task's validation rows")) if scored == "validation" \
        else "column 0: next-token accuracy (%) on held-out general text; tasks: " + tasks.format("test rows")
    return RunResult.from_json({
        "protocol": "sequence", "kind": "instructions", "preset": preset, "seeds": list(seeds),
        "tasks": [cfg.data.general, *cfg.data.tasks],
        "held_out_tasks": [] if scored == "validation" else list(cfg.data.held_out_tasks),
        **({"scored": scored} if scored != "both" else {}),
        "score": score, "date": datetime.date.today().isoformat(), "config": cfg.to_dict(),
        "methods": {label: summarize(runs, built[label]) for label, runs in arms.items()},
    })


def load_stream(cfg: RunConfig, tokenizer) -> Stream:
    data = cfg.data
    if not data.tasks:
        raise ForgetlessError("the instruction sequence needs tasks: --tasks dbpedia,amazon,... (cl500 names or files)")
    tasks, dev = zip(*[split_dev(load_task(spec), data.dev_rows) for spec in data.tasks])
    tasks, dev = list(tasks), [d for d in dev if d is not None]
    take = (lambda rows: rows[:data.train_examples]) if data.train_examples else (lambda rows: rows)
    train_rows = [encode(take(t.train), tokenizer, cfg.model.block_size) for t in tasks]
    (general,), _ = load_domains([data.general], tokenizer, cfg.model.block_size, data.val_fraction, data.eval_windows,
                                  data.dev_fraction)
    mix_from = encode(take(load_task(data.mix_from).train), tokenizer, cfg.model.block_size) \
        if data.mix_from != "earlier" else None
    return Stream(tasks, train_rows, general, [load_task(spec) for spec in data.held_out_tasks], mix_from,
                  untargeted(eval_windows(general.train, cfg.model.block_size, 256), train_rows[0].pad_id), dev)


def split_dev(task: InstructionTask, rows: int) -> tuple[InstructionTask, InstructionTask | None]:
    """(the task without its last `rows` training examples, those rows as a task's test rows: its validation
    set, left out where a kept training prompt or a test prompt repeats them, compared as whitespace-normalised
    text); (task, None) for rows=0."""
    if not rows:
        return task, None
    if rows >= len(task.train):
        raise ForgetlessError(f"{task.name}: data.dev_rows={rows} leaves no training example of its "
                              f"{len(task.train)}; give fewer validation rows")
    kept = task.train[:-rows]
    seen = {" ".join(ex.prompt.split()) for ex in kept + task.test}
    dev = [ex for ex in task.train[-rows:] if " ".join(ex.prompt.split()) not in seen]
    if not dev:
        raise ForgetlessError(f"{task.name}: each of its last {rows} training prompts repeats a kept training or a "
                              "test prompt, so it has no validation rows; give more data.dev_rows")
    return (dataclasses.replace(task, train=kept),
            dataclasses.replace(task, name=f"{task.name} (validation)", train=[], test=dev))


def scored_on(stream: Stream, scored: str) -> Stream:
    """The stream as scored after every task: "both" (test rows, and validation rows beside them when it has
    them), "test" (test rows only), or "validation" (each task's validation rows in place of its test rows and
    the general text's validation windows in place of its held-out ones, no held-out task: an lr grid chooses
    on this R without a test row being scored)."""
    if scored not in SCORED:
        raise ForgetlessError(f"unknown scoring {scored!r}; valid: {', '.join(SCORED)}")
    if scored == "test":
        return dataclasses.replace(stream, dev=[])
    if scored == "validation":
        if not stream.dev:
            raise ForgetlessError("scoring validation rows needs them: give --data-dev-rows N (each task's last N "
                                  "training rows, never trained on)")
        return dataclasses.replace(
            stream, tasks=[dataclasses.replace(t, test=d.test) for t, d in zip(stream.tasks, stream.dev)],
            general=dataclasses.replace(stream.general, windows=stream.general.dev_windows), held_out=[], dev=[])
    return stream


def instruction_arm(model: nn.Module, tokenizer, method: Method, stream: Stream, cfg: RunConfig, seed: int,
                    out_dir: Path | None = None, before: tuple | None = None) -> dict:
    """Attach `method`, train it on every task in order, score everything after each task. `before`: the
    model's `scores` before training (the same for every method: attach changes no output, a contract
    test checks it bit for bit), else scored here."""
    torch.manual_seed(seed)
    adapted = attach(model, method)
    kept = Scored([], [], [], [], [], [])  # each field: its value at every point scored
    rows, held, general_ppl, dev_rows, hits, window_loss = kept
    wall, loss = 0.0, []

    def score_all(now=None, only=None):
        for values, value in zip(kept, now or scores(adapted.model, tokenizer, stream, cfg, only)):
            values.append(copy.copy(value))

    score_all(before)
    T, joint = len(stream.tasks), method.cfg.joint
    lean = cfg.data.r_cells == "metrics"
    phases = [(1, joined(stream.train), joint_config(cfg, T))] if joint else \
        [(t, rows_t, cfg) for t, rows_t in enumerate(stream.train, start=1)]
    with PeakRSS() as memory:
        for t, rows_t, task_cfg in phases:
            t0 = time.perf_counter()
            history, params = learn_task(adapted, t, rows_t, stream, task_cfg, seed)
            wall += time.perf_counter() - t0
            loss += [[t, s, v] for s, v in history.loss]
            score_all(only=t if lean and not joint and t < T else None)
    if joint:  # one state after all tasks: it is every row's "after task t" (metrics.sequence_metrics)
        for scored in kept:
            scored[2:] = scored[1:2] * (T - 1)
    if out_dir is not None:
        adapted.save_pretrained(out_dir / f"seed{seed}")
    dev = {"r_matrix_dev": dev_rows, **dev_metrics(dev_rows)} if stream.dev else {}
    return {"method": method.name, "seed": seed, **({"joint": True} if joint else {}), "r_matrix": rows,
            "held_out": held, "general_ppl": general_ppl, **metrics(rows, general_ppl, joint), **dev,
            "r_hits": hits, "general_window_loss": window_loss, "trainable_params": sum(p.numel() for _, p in params),
            "total_params": sum(p.numel() for p in adapted.model.parameters()), "wall_s": wall,
            "peak_rss_mb": memory.peak_mb, "loss": loss}


def joint_config(cfg: RunConfig, tasks: int) -> RunConfig:
    """A joint arm's one phase: task 1 on every task's training rows joined (`joined`: each task weighs as its
    rows, equally on cl500's 500 each), for the steps the sequential arms take in all (one schedule)."""
    return dataclasses.replace(cfg, adapt=dataclasses.replace(cfg.adapt, steps=cfg.adapt.steps * tasks))


def learn_task(adapted, t: int, rows: Encoded, stream: Stream, cfg: RunConfig, seed: int, timer: StepHooks | None = None):
    """Task t: start it (EWC protects the rows learned last, or general text's training split before task 1), then train
    on its rows, a fraction `mix` of each batch drawn from the mixing set, else the earlier tasks' rows (replay).
    A method that mixes original data (Neutral: its l1 term silences the adapters on those rows) gets the mixing
    set, else general-text windows without targets: they feed its term, the LM loss stays on the answers.
    `timer`: step hooks run after the method's (the compute plan times steps with them)."""
    method = adapted.method
    previous = stream.general if t == 1 else windows_of(stream.train[t - 2], cfg.model.block_size)
    adapted.start_task(t, previous)
    earlier = joined(stream.train[:t - 1]) if t > 1 else None
    other = stream.mix_from or (stream.general_rows if method.mixes_original else earlier)
    adapt = method.training_config(cfg.adapt)
    adapt = dataclasses.replace(adapt, mix=adapt.mix if other else 0.0)
    sampler = InstructionSampler(rows, adapt.batch_size, 1000 * seed + t, other if adapt.mix else None, adapt.mix,
                                 group=adapt.group_by_length)
    params = adapted.trainable_parameters()
    history = train(adapted.model, params, sampler, adapt, lambda m, batch: adapted.losses(batch),
                    hooks=HookChain([method, timer]) if timer else method,
                    desc=f"{method.name} seed {seed} " + ("all tasks" if method.cfg.joint else f"task {t}"))
    adapted.end_task(t)
    return history, params


def scores(model: nn.Module, tokenizer, stream: Stream, cfg: RunConfig, only: int | None = None) -> Scored:
    """Every task's score and scored rows, the held-out tasks', general text (accuracy, PPL, loss per window)
    and, with validation rows, the R row on them; under the training's precision. `only`: task `only` alone
    (on test and validation rows), every other value None (data.r_cells "metrics" between tasks)."""
    if only is not None:
        T, (s, h) = len(stream.tasks), score(model, tokenizer, stream.tasks[only - 1], cfg)
        dev = [None] * (T + 1) if stream.dev else []
        if stream.dev:
            dev[only] = score(model, tokenizer, stream.dev[only - 1], cfg)[0]
        return Scored([s if i == only else None for i in range(T + 1)], [None] * len(stream.held_out), None, dev,
                      [h if i == only else None for i in range(1, T + 1)], None)
    general = evaluate(model, stream.general.windows, precision=cfg.adapt.precision)
    dev = [100 * evaluate(model, stream.general.dev_windows, precision=cfg.adapt.precision)["acc"]] + \
        [score(model, tokenizer, t, cfg)[0] for t in stream.dev] if stream.dev else []
    tasks = [score(model, tokenizer, t, cfg) for t in stream.tasks]
    return Scored([100 * general["acc"]] + [s for s, _ in tasks], [score(model, tokenizer, t, cfg)[0] for t in stream.held_out],
                  general["ppl"], dev, [h for _, h in tasks], general["window_loss"])


def score(model: nn.Module, tokenizer, task: InstructionTask, cfg: RunConfig) -> tuple[float, str]:
    """(the task's score in %, its scored rows as "1"/"0" outcomes in row order)."""
    hits, _ = task_hits(model, tokenizer, task, cfg.data.test_rows or None, cfg.adapt.batch_size,
                        precision=cfg.adapt.precision)
    return 100.0 * sum(hits) / len(hits), "".join("1" if h else "0" for h in hits)


def metrics(rows: list[list[float]], general_ppl: list[float], joint: bool = False) -> dict:
    """The R metrics with general ability as task 0; OP, BWT and forgetting over the tasks alone (the
    TRACE / MoRAM columns; general ability has its own: column 0 and the general PPL change). `joint`:
    R of a joint arm (metrics.sequence_metrics)."""
    return {**sequence_metrics(rows, joint), "general_ppl_change": general_ppl[-1] / general_ppl[0] - 1}


def windows_of(rows: Encoded, block_size: int) -> torch.Tensor:
    """The rows' tokens (prompt and answer) as one stream, cut into windows (W, block_size + 1)."""
    stream = torch.cat([torch.cat([x, y[-1:]]) for x, y in zip(rows.x, rows.y)])
    return eval_windows(stream, block_size, 64)


def untargeted(windows: torch.Tensor, pad_id: int) -> Encoded:
    """Windows (W, T+1) as rows with every target -100: seen by the model, not by the LM loss."""
    return Encoded(list(windows[:, :-1]), [torch.full((windows.shape[1] - 1,), IGNORE) for _ in windows], pad_id)


def joined(parts: list[Encoded]) -> Encoded:
    return Encoded([x for p in parts for x in p.x], [y for p in parts for y in p.y], parts[0].pad_id)


def task_hash(task: InstructionTask) -> str:
    text = repr([task.name, [(e.prompt, e.answer) for e in task.train + task.test], task.labels, task.first_line])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def summarize(runs: list[dict], method: Method) -> dict:
    runs = [{**r, **metrics(r["r_matrix"], r["general_ppl"], r.get("joint", False))} for r in runs]  # arms saved before a metric existed
    return {"method": method.name, **({"joint": True} if method.cfg.joint else {}), **{m: mean_std([r[m] for r in runs]) for m in METRICS}, **dev_summary(runs),
            "wall_s": mean_std([r["wall_s"] for r in runs]), "r_matrix": mean_nested([r["r_matrix"] for r in runs]),
            "held_out": mean_nested([r["held_out"] for r in runs]),
            "general_ppl": mean_nested([r["general_ppl"] for r in runs]),
            "trainable_params": runs[0]["trainable_params"], "total_params": runs[0]["total_params"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "options": method.options(),
            "per_seed": per_seed(runs, METRICS + DEV_METRICS)}
