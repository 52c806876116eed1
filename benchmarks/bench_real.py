"""Adaptation step time of every forgetless method on a real pretrained model, against PEFT LoRA.

Every method is attached with `forgetless.attach` to its own deep copy of the loaded model
(SmolLM2-135M by default, float32) and timed over whole adaptation steps as the protocols run them:
forward, the answer-only training loss (`adapted.loss`: cross-entropy on the answer tokens, the
prompt's targets -100, plus the method's own terms), backward, gradient clipping, the method's step
hooks and its optimizer step (AdamW, preset `real`: lr 5e-4, weight decay 0.1, clip 1.0). The
baseline is PEFT LoRA r=8 (alpha 16) on q_proj and v_proj built with the real `peft` package
(`get_peft_model`), trained on the same batch with the same cross-entropy and optimizer; it is
timed before the first method and again after every method, and each method's ratio is its median
step / the median of the two baseline runs just before and after it, so slow drift of a shared
machine cancels instead of tilting the methods timed late (all baseline runs: `baseline_ms_runs`). The issue's target: every method that attaches modules beside the frozen base
within 1.3x of LoRA's step; full, ffn and ewc train the base's own weights and are shown for scale.

The batch: B rows of T random token ids, the last `--answer-tokens` of each row scored (the prompt
part -100, as the instruction protocol encodes it); methods with a default mix (neutral) get their
share of rows flagged as mixed-in original data, so their gate term runs. EWC's Fisher is computed
at start_task on `--fisher-windows` windows (setup, not step time).

    python benchmarks/bench_real.py [--methods all|lora,neutral,...] [--steps 3] [--warmup 1] [--batch 8]
        [--tokens 200] [--answer-tokens 32] [--threads 2] [--model smollm2-135m|hf:PATH]
        [--config llama-1b] [--device cpu|cuda] [--precision fp32|bf16]

`--config` times a random-initialised transformers model of a named shape instead of a pretrained one
(`llama-1b`: Llama 3.2 1B's, 1.24B parameters; `llama-tiny`: seconds on a CPU, to check the script).
`--precision bf16` runs forward and loss under bf16 autocast over float32 weights, as the protocols do;
on CUDA the peak is also the CUDA allocator's over the steps (peak_cuda_mb; the base model, resident
throughout, included), beside the process's peak RSS.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import statistics
import time

import torch
from _timing import provenance
from peft import LoraConfig, get_peft_model

import forgetless
from forgetless.continual.evaluate import training_loss
from forgetless.data.splits import Batch
from forgetless.methods import method_names
from forgetless.methods.base import parse_method_specs
from forgetless.models.hf import describe, load_model
from forgetless.monitor import PeakRSS, release_memory, rss_mb
from forgetless.optim import build_optimizer
from forgetless.presets import build_config
from forgetless.adapted import resolve_device
from forgetless.train import HookChain, StepHooks, autocast, module_hooks

TARGET = 1.3
BASELINE = "peft-lora-r8-qv"
CONFIGS = {  # --config: LlamaConfig options of random-initialised models
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                     tie_word_embeddings=True),  # Llama 3.2 1B's shape
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all", help="all (every registered method) or specs, e.g. lora,neutral")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--batch", type=int, default=8, help="rows per batch")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per row (model inputs)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="scored tokens at the end of each row")
    parser.add_argument("--fisher-windows", type=int, default=4, help="windows of EWC's Fisher (setup)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, hf:PATH or PATH.gguf")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="a random-initialised Llama of this shape instead of --model")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="autocast of forward and loss")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or not 0 < args.answer_tokens <= args.tokens:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1 and 0 < --answer-tokens <= --tokens")
    return args


def answer_batch(vocab: int, rows: int, tokens: int, answer: int, seed: int = 0) -> Batch:
    """(B, T) random inputs; targets are the next tokens on the last `answer` positions, -100 before."""
    ids = torch.randint(0, vocab, (rows, tokens + 1), generator=torch.Generator().manual_seed(seed))
    y = ids[:, 1:].clone()
    y[:, :tokens - answer] = -100
    return Batch(ids[:, :-1], y, torch.zeros(rows, dtype=torch.bool))


def with_mix(batch: Batch, mix: float | None) -> Batch:
    """The batch with round(mix * B) rows (at least one when mix > 0) flagged as mixed-in original data."""
    if not mix:
        return batch
    n = min(len(batch.x), max(1, round(mix * len(batch.x))))
    flags = torch.zeros(len(batch.x), dtype=torch.bool)
    flags[:n] = True
    return Batch(batch.x, batch.y, flags)


def random_model(name: str, device: torch.device):
    """A LlamaForCausalLM of shape CONFIGS[name], initialised (seed 0) on `device`, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**CONFIGS[name]))


def timed_steps(model, params, loss_fn, hooks: StepHooks, cfg, warmup: int, steps: int, precision: str) -> dict:
    """Run warmup + steps optimizer steps as forgetless.train does; ms of the timed ones (`loss.item()` waits
    for the device), peak RSS over all and, on CUDA, the allocator's peak."""
    opt = hooks.make_optimizer(params, cfg) or build_optimizer(cfg.optimizer, params, cfg, model)
    tensors = [p for _, p in params]
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    ms, losses = [], []
    with PeakRSS() as memory:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            with autocast(device, precision):
                loss = loss_fn()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tensors, cfg.grad_clip)
            hooks.before_step(model, opt, i + 1, False)
            opt.step()
            hooks.after_step(model, opt, i + 1, False)
            losses.append(loss.item())
            if i >= warmup:
                ms.append(1000 * (time.perf_counter() - t0))
    cuda = {"peak_cuda_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
    return {"step_ms": ms, "peak_rss_mb": memory.peak_mb, "loss": losses[-1], **cuda}


def run_baseline(base, batch: Batch, cfg, args) -> dict:
    t0 = time.perf_counter()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    setup = time.perf_counter() - t0
    out = timed_steps(model, params, lambda: training_loss(model, batch)[0], StepHooks(), cfg, args.warmup, args.steps,
                      args.precision)
    return {**out, "trainable_params": sum(p.numel() for _, p in params), "setup_s": setup, "trains_base": False}


def run_method(base, spec, batch: Batch, cfg, args) -> dict:
    t0 = time.perf_counter()
    model = copy.deepcopy(base)
    base_ids = {id(p) for p in model.parameters()}
    adapted = forgetless.attach(model, spec)
    method = adapted.method
    if method.needs_previous:  # EWC: the Fisher of what the model knew (here random windows)
        vocab = model.get_input_embeddings().num_embeddings
        previous = torch.randint(0, vocab, (args.fisher_windows, batch.x.shape[1] + 1),
                                 generator=torch.Generator().manual_seed(1))
        adapted.start_task(1, previous=previous)
    else:
        adapted.start_task(1)
    params = adapted.trainable_parameters()
    setup = time.perf_counter() - t0
    hooks = HookChain([method, *module_hooks(adapted.model, params)])
    mixed = with_mix(batch, method.cfg.mix)
    out = timed_steps(adapted.model, params, lambda: adapted.loss(mixed), hooks, cfg, args.warmup, args.steps,
                      args.precision)
    return {**out, "trainable_params": sum(p.numel() for _, p in params), "setup_s": setup,
            "trains_base": any(id(p) in base_ids for _, p in params), "mixed_rows": int(mixed.from_other.sum())}


def isolated(fn, *a) -> dict:
    """fn(*a) with the memory of the previous run given back first (its copy, grads, optimizer state)."""
    gc.collect()
    release_memory()
    torch.cuda.empty_cache()  # a no-op without CUDA
    rss = rss_mb()
    out = fn(*a)
    gc.collect()
    release_memory()
    torch.cuda.empty_cache()
    return {**out, "rss_before_mb": rss}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = resolve_device(args.device)
    model_name = args.config or args.model
    t0 = time.perf_counter()
    base = random_model(args.config, device) if args.config else load_model(args.model, device)[0]
    base.requires_grad_(False)
    load_s = time.perf_counter() - t0
    facts = describe(base)
    batch = answer_batch(base.get_input_embeddings().num_embeddings, args.batch, args.tokens,
                         args.answer_tokens).to(device)
    cfg = dataclasses.replace(build_config("real").adapt, batch_size=args.batch)
    specs = parse_method_specs(",".join(method_names()) if args.methods == "all" else args.methods)
    tokens = args.batch * args.tokens
    print(f"{model_name}: {facts['class']}, {facts['total_params']:,} params, loaded in {load_s:.0f} s; "
          f"batch {args.batch} x {args.tokens} tokens ({args.answer_tokens} scored per row), "
          f"{args.warmup} warm-up + {args.steps} timed steps, {device}, {args.precision}, "
          f"{torch.get_num_threads()} threads", flush=True)

    baselines = [isolated(run_baseline, base, batch, cfg, args)]
    print(f"  baseline {BASELINE}: {statistics.median(baselines[0]['step_ms']):.0f} ms/step", flush=True)
    results = {}
    for spec in specs:
        torch.manual_seed(0)
        r = results[spec.label] = isolated(run_method, base, spec, batch, cfg, args)
        baselines.append(isolated(run_baseline, base, batch, cfg, args))
        r["baseline_ms"] = statistics.median(baselines[-2]["step_ms"] + baselines[-1]["step_ms"])  # just before, after
        print(f"  {spec.label}: {statistics.median(r['step_ms']):.0f} ms/step (setup {r['setup_s']:.1f} s); "
              f"baseline around it {r['baseline_ms']:.0f} ms/step", flush=True)
    first, last = baselines[0], baselines[-1]
    baseline_ms = statistics.median([t for b in baselines for t in b["step_ms"]])

    rows = {}
    for label, r in results.items():
        ms = statistics.median(r["step_ms"])
        ratio = ms / r["baseline_ms"]
        rows[label] = {"ms": round(ms, 1), "baseline_ms": round(r["baseline_ms"], 1), "ratio": round(ratio, 3),
                       "tokens_per_s": round(1000 * tokens / ms, 1), "trainable_params": r["trainable_params"],
                       "peak_rss_mb": round(r["peak_rss_mb"]), "rss_before_mb": round(r["rss_before_mb"]),
                       "setup_s": round(r["setup_s"], 2), "trains_base": r["trains_base"],
                       "meets_target": None if r["trains_base"] else ratio <= TARGET,
                       "loss": round(r["loss"], 4), "step_ms_all": [round(t, 1) for t in r["step_ms"]]}
        if "peak_cuda_mb" in r:
            rows[label]["peak_cuda_mb"] = round(r["peak_cuda_mb"])

    peak = "peak_cuda_mb" if device.type == "cuda" else "peak_rss_mb"  # the table's memory column
    header = (f"{'method':<22} {'ms/step':>9} {'LoRA ms':>8} {'x LoRA':>7} {'tokens/s':>9} {'trainable':>13} "
              f"{'peak CUDA MB' if device.type == 'cuda' else 'peak RSS MB':>12}  target")
    print("\n" + header + "\n" + "-" * len(header))
    print(f"{BASELINE:<22} {baseline_ms:>9.0f} {baseline_ms:>8.0f} {1:>7.2f} {1000 * tokens / baseline_ms:>9.0f} "
          f"{first['trainable_params']:>13,} {max(b[peak] for b in baselines):>12.0f}  baseline (all runs)")
    for label, r in rows.items():
        verdict = "trains base" if r["trains_base"] else ("meets" if r["meets_target"] else "MISSES")
        print(f"{label:<22} {r['ms']:>9.0f} {r['baseline_ms']:>8.0f} {r['ratio']:>7.2f} {r['tokens_per_s']:>9.0f} "
              f"{r['trainable_params']:>13,} {r[peak]:>12.0f}  {verdict}")
    attach_style = [k for k, r in rows.items() if not r["trains_base"]]
    meet = [k for k in attach_style if rows[k]["meets_target"]]
    print(f"\ntarget <= {TARGET}x {BASELINE} ({baseline_ms:.0f} ms): {len(meet)} of {len(attach_style)} attach-style "
          f"methods meet it: {', '.join(meet) or 'none'}; miss: "
          f"{', '.join(k for k in attach_style if k not in meet) or 'none'}")

    print(json.dumps({
        "bench": "real", "provenance": provenance(peft="peft", transformers="transformers"), "baseline": BASELINE, "baseline_ms": round(baseline_ms, 1), "methods": rows,
        "config": {"model": model_name, "random_init": bool(args.config), "device": str(device),
                   "precision": args.precision, "model_facts": facts, "batch": args.batch, "tokens": args.tokens,
                   "answer_tokens": args.answer_tokens, "steps": args.steps, "warmup": args.warmup,
                   "threads": torch.get_num_threads(), "optimizer": cfg.optimizer, "lr": cfg.lr,
                   "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "fisher_windows": args.fisher_windows,
                   "target_ratio": TARGET, "baseline_trainable_params": first["trainable_params"],
                   "baseline_ms_first": round(statistics.median(first["step_ms"]), 1),
                   "baseline_ms_last": round(statistics.median(last["step_ms"]), 1),
                   "baseline_ms_runs": [round(statistics.median(b["step_ms"]), 1) for b in baselines],
                   "baseline_peak_rss_mb": round(max(b["peak_rss_mb"] for b in baselines)),
                   **({"baseline_peak_cuda_mb": round(max(b["peak_cuda_mb"] for b in baselines))}
                      if device.type == "cuda" else {}),
                   "load_s": round(load_s, 1), "torch": torch.__version__,
                   "date": datetime.date.today().isoformat()}}))


if __name__ == "__main__":
    main()
