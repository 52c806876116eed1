"""One instruction-stream arm, old code against new, in one process: wall time (training, and the rest: scoring,
general PPL, saving) and the metrics' change in units of their sampling error.

The arm is `forgetless study`'s: the `real` preset (4 tasks of 256 training rows, 32 steps of batch 8 each, 50 test
rows per task and the held-out FOMC, 32 general-text windows), one `lora` arm, seed 0; options cut it down for a
loaded machine. "old" is the arm with the scoring of `--old-rev` (default: the commit before the lean scoring, read
from git: `git show REV:src/forgetless/continual/scoring.py`, loaded in place of today's) and every R cell scored
after every task (data.r_cells all, as then), training batches padded as drawn and every row run whole (no shared
prompt run once: loss.SHARED_MIN out of reach), "new" today's code with the study's `--r-cells` (default metrics:
between tasks only the task just learned) and `--group-by-length` (default 8: training rows regrouped by length over 8
batches, adapt.group_by_length).
Per precision (`--precisions fp32,bf16`; bf16 only where the CPU runs it natively, unless given), old and new
alternate `--repeats` times (old, new, old, new ...; `--new-first`: new, old, ...), so machine load hits both; the
medians are compared; `--bf16-against-fp32`: only old in fp32 and new in bf16. Each arm's time is also given
without the untrained model's scores (`without_base_s`): a run of N arms (`forgetless study`, old and new alike)
scores the untrained model once for all, so an arm's share of it is 1/N; without it is the limit of many arms.
The headline is the whole arm's wall time. The metric check compares new's first run with old's first run
(bench_precision.metric_check: R cells and general PPL after each task, in sampling errors). New trains bf16 on a
CPU with eager attention (device.training_attention), old with the model's SDPA.

    python benchmarks/bench_arm.py [--precisions fp32,bf16 | --bf16-against-fp32] [--repeats 1] [--new-first]
        [--tasks dbpedia,amazon,yahoo,agnews] [--steps 32] [--train-examples 256] [--test-rows 50] [--held-out FOMC]
        [--threads N] [--quick]

`--padding-only`: the training tokens that are padding, as drawn and grouped (`--group-by-length`), no arm.
`--scoring-rows N`: label scoring alone (N test rows of the first task), old and new alternating, no arm.
`--attention N`: N bf16 training steps of the first task's batches (seed 0, grouped), each run with the model's
SDPA attention and with the eager attention bf16 training takes on a CPU (device.training_attention), alternating,
no arm.
`--quick`: the tests' tiny Llama and one task (seconds; the test of this script).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from _timing import provenance
from bench_precision import load, metric_check

from forgetless import attach, loss
from forgetless import device as device_module
from forgetless.continual import instruct, scoring
from forgetless.continual.evaluate import evaluate
from forgetless.continual.instruct import load_stream, run_on
from forgetless.continual.instruct import saved_scores as instruct_saved_scores
from forgetless.data.instructions import InstructionSampler, load_task
from forgetless.device import autocast, cpu_bf16, resolve_device, training_attention
from forgetless.presets import build_config

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "ec11510"  # the commit before the lean scoring (label scores on a cropped cache, length-sorted batches)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, hf:PATH, PATH.gguf or random")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--precisions", default=None, help="fp32,bf16 [default: bf16 too where the CPU has it]")
    parser.add_argument("--repeats", type=int, default=1, help="old/new pairs per precision")
    parser.add_argument("--new-first", action="store_true", help="each pair runs new, then old (an order effect "
                        "shows against a run in the default order)")
    parser.add_argument("--bf16-against-fp32", action="store_true", help="only old in fp32 and new in bf16, "
                        "compared with each other (the bf16 goal), --repeats times")
    parser.add_argument("--tasks", default="dbpedia,amazon,yahoo,agnews", help="the stream's tasks, in order")
    parser.add_argument("--held-out", default="FOMC", help="held-out tasks ('' for none)")
    parser.add_argument("--steps", type=int, default=32, help="training steps per task")
    parser.add_argument("--train-examples", type=int, default=256, help="training rows per task")
    parser.add_argument("--test-rows", type=int, default=50, help="test rows per task")
    parser.add_argument("--old-rev", default=OLD_REV, help="the git revision whose scoring is 'old'")
    parser.add_argument("--r-cells", default="metrics", choices=["all", "metrics"],
                        help="the R cells the new arm scores between tasks (the old one: all)")
    parser.add_argument("--group-by-length", type=int, default=8,
                        help="the new arm's adapt.group_by_length (the old one: 0, batches as drawn)")
    parser.add_argument("--scoring-rows", type=int, default=0, help="time label scoring alone: this many test rows of "
                        "the first task, old and new alternating --repeats times per precision (no arm)")
    parser.add_argument("--padding-only", action="store_true", help="count the training tokens that are padding, "
                        "as drawn and with --group-by-length (no arm: seconds)")
    parser.add_argument("--attention", type=int, default=0, help="time training steps with SDPA and with eager "
                        "attention: this many batches of the first task, each run both ways, alternating (no arm)")
    parser.add_argument("--quick", action="store_true", help="the tests' tiny Llama, one task: seconds")
    args = parser.parse_args()
    if min(args.threads, args.repeats, args.steps, args.train_examples, args.test_rows) < 1:
        parser.error("--threads, --repeats, --steps, --train-examples and --test-rows must be at least 1")
    return args


def old_scoring(rev: str):
    """The module continual/scoring.py as it was at `rev`."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/forgetless/continual/scoring.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_scoring.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("forgetless.continual.old_scoring", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides(args) -> dict:
    if args.quick:
        return {"model": {"block_size": 128}, "data": {"tasks": ["dbpedia"], "held_out_tasks": [], "train_examples": 16,
                                                      "test_rows": 8, "eval_windows": 4},
                "adapt": {"steps": 2, "batch_size": 4}}
    return {"data": {"tasks": args.tasks.split(","), "held_out_tasks": [t for t in args.held_out.split(",") if t],
                     "train_examples": args.train_examples, "test_rows": args.test_rows},
            "adapt": {"steps": args.steps}}


def run_arm(lm, tokenizer, settings: dict, precision: str, out: Path, about: str, scoring=None,
            r_cells: str = "all", group: int = 0) -> tuple[dict, float, float]:
    """One `lora` arm: (results, wall seconds, of which the untrained model's scores took); `scoring`: a scoring
    module used in place of today's, every training row run whole with SDPA attention; `group`:
    adapt.group_by_length. A run of several arms scores the untrained model once for all (instruct.saved_scores,
    both old and new)."""
    cfg = build_config("real", {**settings, "data": {**settings["data"], "r_cells": r_cells},
                                "adapt": {**settings["adapt"], "precision": precision, "group_by_length": group}})
    base = []

    def timed_base(*args):
        t0 = time.perf_counter()
        scored = instruct_saved_scores(*args)
        base.append(time.perf_counter() - t0)
        return scored

    with contextlib.ExitStack() as old:
        old.enter_context(mock.patch.object(instruct, "saved_scores", timed_base))
        if scoring:
            old.enter_context(mock.patch.object(instruct, "task_hits", scoring.task_hits))
            old.enter_context(mock.patch.object(loss, "SHARED_MIN", sys.maxsize))
            old.enter_context(mock.patch.object(device_module, "EAGER_BYTES", 0))
        t0 = time.perf_counter()
        results = run_on(lm, tokenizer, cfg, ["lora"], [0], out, "real", about)
        return results, time.perf_counter() - t0, sum(base)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device("cpu")
    precisions = args.precisions.split(",") if args.precisions else ["fp32", *(["bf16"] if cpu_bf16() else [])]
    lm, tokenizer, about = load(argparse.Namespace(quick=args.quick, model=args.model), device)
    old = old_scoring(args.old_rev)
    settings = overrides(args)
    load_avg, made_by = os.getloadavg(), provenance(transformers="transformers")  # the code as imported, at the start
    print(f"{about}, {args.threads} thread(s), load {load_avg[0]:.1f} on {os.cpu_count()} CPUs; old = scoring of "
          f"{args.old_rev}, every R cell, batches as drawn, rows whole; new: r_cells {args.r_cells}, group_by_length "
          f"{args.group_by_length}", flush=True)
    if args.scoring_rows:
        return scoring_only(lm, tokenizer, old, args, precisions, device)
    if args.attention:
        return attention_only(lm, tokenizer, args, settings, precisions, device)
    if args.padding_only:
        cfg = build_config("real", settings)
        return print(json.dumps({"bench": "arm padding", "padding": padding(load_stream(cfg, tokenizer), cfg,
                                                                            args.group_by_length)}))
    order = ("new", "old") if args.new_first else ("old", "new")
    runs = sorted([("fp32", "old"), ("bf16", "new")], key=lambda run: order.index(run[1])) \
        if args.bf16_against_fp32 else [(p, name) for p in precisions for name in order]
    timed, first = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for precision, name in runs:
                scoring, cells, group = (old, "all", 0) if name == "old" else (None, args.r_cells, args.group_by_length)
                results, wall, base = run_arm(lm, tokenizer, settings, precision, Path(tmp) / f"{precision}-{name}-{r}",
                                              about, scoring, cells, group)
                train_s = results.methods["lora"].wall_s["mean"]
                timed.setdefault((precision, name), []).append({
                    "wall_s": round(wall, 3), "train_s": round(train_s, 3), "rest_s": round(wall - train_s, 3),
                    "base_scores_s": round(base, 3), "without_base_s": round(wall - base, 3)})
                first.setdefault((precision, name), results.to_json())
                print(f"{precision} {name} #{r}: {wall:.1f} s ({train_s:.1f} s training, {wall - train_s:.1f} s "
                      f"scoring and the rest, of which {base:.1f} s the untrained model's scores), load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    cfg = build_config("real", settings)
    stream = load_stream(cfg, tokenizer)
    padded = padding(stream, cfg, args.group_by_length)
    general = stream.general.windows
    losses = [evaluate(lm, general[i:i + 1])["loss"] for i in range(len(general))]
    tested = [len(t.test[:cfg.data.test_rows or None]) for t in stream.tasks]
    median = {k: {key: statistics.median(run[key] for run in v) for key in ("wall_s", "without_base_s")}
              for k, v in timed.items()}
    out = {"bench": "arm", "precisions": {}, "config": {**vars(args), "settings": settings, "model": about},
           "padding": padded, "load_at_start": load_avg, "load_at_end": os.getloadavg(), "provenance": made_by}
    pairs = [(p, p) for p in precisions if {(p, "old"), (p, "new")} <= set(timed)] + \
        ([("fp32", "bf16")] if ("fp32", "old") in timed and ("bf16", "new") in timed else [])
    for old_p, new_p in pairs:
        a, b = median[old_p, "old"], median[new_p, "new"]
        check = metric_check(first[old_p, "old"], first[new_p, "new"], losses, tested, general.numel() - len(general),
                             ("old", "new"))
        label = old_p if old_p == new_p else "new_bf16_vs_old_fp32"
        out["precisions"][label] = {"old": timed[old_p, "old"], "new": timed[new_p, "new"],
                                    "speedup": round(a["wall_s"] / b["wall_s"], 3),
                                    "speedup_without_base": round(a["without_base_s"] / b["without_base_s"], 3),
                                    "metric_check": check}
        if label == "new_bf16_vs_old_fp32":
            out[label] = round(a["wall_s"] / b["wall_s"], 3)
        print(f"{label}: old {old_p} {a['wall_s']:.1f} s, new {new_p} {b['wall_s']:.1f} s: "
              f"{a['wall_s'] / b['wall_s']:.2f}x (without the untrained model's scores: "
              f"{a['without_base_s']:.1f} s against {b['without_base_s']:.1f} s, "
              f"{a['without_base_s'] / b['without_base_s']:.2f}x); "
              f"metrics: {check['cells']} values, largest change {check['max_z']:.2f} sampling errors, "
              f"{check['cells_beyond_one_se']} at or beyond one", flush=True)
    print(json.dumps(out))


def padding(stream, cfg, group: int) -> dict:
    """Per task: training tokens of the arm's batches (seed 0's draws) and the share that is padding, as drawn and
    regrouped by length over `group` batches."""
    out = {}
    for t, (name, rows) in enumerate(zip(cfg.data.tasks, stream.train), start=1):
        for label, g in (("as drawn", 1), (f"group_by_length {group}", group)):
            sampler = InstructionSampler(rows, cfg.adapt.batch_size, t, group=g)  # learn_task's seed for seed 0
            batches = [sampler.next() for _ in range(cfg.adapt.steps)]
            tokens = sum(b.x.numel() for b in batches)
            real = sum(int((y != -100).nonzero().max()) + 1 for b in batches for y in b.y)  # a row ends at its eos
            out.setdefault(name, {})[label] = {"tokens": tokens, "padding": round(1 - real / tokens, 3)}
        print(f"{name}: training tokens as drawn {out[name]['as drawn']['tokens']:,} "
              f"({out[name]['as drawn']['padding']:.0%} padding), grouped by {group} "
              f"{out[name][label]['tokens']:,} ({out[name][label]['padding']:.0%})", flush=True)
    return out


def scoring_only(lm, tokenizer, old, args, precisions: list[str], device):
    """Label scoring of `--scoring-rows` rows of the first task, old and new alternating: seconds, and whether the
    same label wins on every row."""
    task = load_task(args.tasks.split(",")[0])
    prompts = [ex.prompt for ex in task.test[:args.scoring_rows]]
    for precision in precisions:
        runs, scores = {"old": [], "new": []}, {}
        for r in range(args.repeats):
            for name, module in (("old", old), ("new", scoring)):
                with autocast(device, precision):
                    t0 = time.perf_counter()
                    scores[name] = module.label_scores(lm, tokenizer, prompts, task.labels, 8)  # (N, K)
                    runs[name].append(round(time.perf_counter() - t0, 1))
                print(f"{precision} {name} #{r}: {runs[name][-1]} s, load {os.getloadavg()[0]:.1f}", flush=True)
        agree = (scores["old"].argmax(1) == scores["new"].argmax(1)).float().mean().item()
        print(json.dumps({"bench": "arm scoring", "precision": precision, "rows": len(prompts), **runs,
                          "ratios": [round(a / b, 2) for a, b in zip(runs["old"], runs["new"])], "argmax_agree": agree,
                          "max_abs_diff": (scores["old"] - scores["new"]).abs().max().item()}), flush=True)


def attention_only(lm, tokenizer, args, settings: dict, precisions: list[str], device):
    """`--attention` training steps of `lora` on the first task's batches in bf16, each with SDPA and with eager
    attention (device.training_attention; the order alternates), no weight moving: seconds of each, summed."""
    if "bf16" not in precisions:
        raise SystemExit("--attention compares bf16 training steps (fp32 keeps SDPA): add bf16 to --precisions")
    cfg = build_config("real", {**settings, "data": {**settings["data"], "tasks": settings["data"]["tasks"][:1]}})
    stream = load_stream(cfg, tokenizer)
    sampler = InstructionSampler(stream.train[0], cfg.adapt.batch_size, 1, group=args.group_by_length)
    batches = [sampler.next().to(device) for _ in range(args.attention)]
    adapted = attach(lm, "lora")
    adapted.model.train()
    seconds, used = {"sdpa": 0.0, "eager": 0.0}, {"sdpa": set(), "eager": set()}
    hook = adapted.model.register_forward_pre_hook(lambda module, args: ran.add(module.config._attn_implementation))
    for i, batch in enumerate(batches):
        for name in list(seconds)[::1 if i % 2 else -1]:
            ran = used[name]
            with mock.patch.object(device_module, "EAGER_BYTES", 0 if name == "sdpa" else device_module.EAGER_BYTES):
                t0 = time.perf_counter()
                with autocast(device, "bf16"), training_attention(adapted.model, device, "bf16", batch.x):
                    adapted.losses(batch)[0].backward()
                seconds[name] += time.perf_counter() - t0
            adapted.model.zero_grad(set_to_none=True)
    hook.remove()
    print(json.dumps({"bench": "arm attention", "precision": "bf16", "steps": len(batches),
                      "tokens": sum(b.x.numel() for b in batches), **{k: round(v, 3) for k, v in seconds.items()},
                      "ran": {k: sorted(v) for k, v in used.items()},
                      "sdpa_over_eager": round(seconds["sdpa"] / seconds["eager"], 3)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
