"""Adaptation step time of every forgetless method on a real pretrained model, against PEFT LoRA timed beside it.

Every method is attached with `forgetless.attach` to its own deep copy of the loaded model
(SmolLM2-135M by default, float32) and timed over whole adaptation steps as the protocols run them:
forward, the answer-only training loss (`adapted.loss`: cross-entropy on the answer tokens, the
prompt's targets -100, plus the method's own terms), backward, gradient clipping, the method's step
hooks and its optimizer step (AdamW, preset `real`: lr 5e-4, weight decay 0.1, clip 1.0). The
baseline is PEFT LoRA r=8 (alpha 16) on q_proj and v_proj built with the real `peft` package
(`get_peft_model`), trained on the same batch with the same cross-entropy and optimizer.

Timing is interleaved: each method gets its own LoRA copy, and after both have run their warm-up steps
they alternate step by step (LoRA, method, LoRA, method, ...), so both see the same state of a shared
machine. A method's ratio is the median of its steps over the median of the LoRA steps of the same
rounds; the spread (quartiles, extremes, and the per-round ratio's range) is printed and kept. Peak
memory is each model's own: the process's peak RSS (and on CUDA the allocator's peak) over its warm-up
steps, run before the other model of the pair exists (the frozen base, resident throughout, included).
The issue's target: every method that attaches modules beside the frozen base within 1.3x of LoRA's
step; full, ffn, ewc, ... train the base's own weights and are shown for scale.

The batch: B rows of T random token ids, the last `--answer-tokens` of each row scored (the prompt
part -100, as the instruction protocol encodes it); methods with a default mix (neutral) get their
share of rows flagged as mixed-in original data, so their gate term runs. EWC's Fisher is computed
at start_task on `--fisher-windows` windows (setup, not step time).

    python benchmarks/bench_real.py [--methods all|lora,neutral,...] [--steps 5] [--warmup 1] [--batch 8]
        [--tokens 200] [--answer-tokens 32] [--threads 2] [--model smollm2-135m|hf:PATH]
        [--config llama-1b] [--device cpu|cuda] [--precision fp32|bf16] [--profile N] [--quick]

`--config` times a random-initialised transformers model of a named shape instead of a pretrained one
(`llama-1b`: Llama 3.2 1B's, 1.24B parameters; `llama-tiny`: seconds on a CPU, to check the script).
`--quick`: llama-tiny, batch 2 x 32 tokens, 3 steps (options given explicitly win).
`--precision bf16` runs forward and loss under bf16 autocast over float32 weights, as the protocols do.
On a CPU without native bf16 (AVX-512 BF16 or AMX) it is skipped with a one-line reason, except on
llama-tiny (a check of the script): there bf16 is emulated, many times slower than fp32, and says nothing
about machines that have it.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _timing import provenance, spread
from peft import LoraConfig, get_peft_model

import forgetless
from forgetless.continual.evaluate import training_loss
from forgetless.data.splits import Batch
from forgetless.device import autocast, resolve_device
from forgetless.hooks import HookChain, StepHooks, module_hooks
from forgetless.methods import method_names
from forgetless.methods.base import parse_method_specs
from forgetless.models.hf import describe, load_model
from forgetless.monitor import PeakRSS, release_memory, rss_mb
from forgetless.optim import build_optimizer
from forgetless.presets import build_config

TARGET = 1.3
BASELINE = "peft-lora-r8-qv"
CONFIGS = {  # --config: LlamaConfig options of random-initialised models
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                     tie_word_embeddings=True),  # Llama 3.2 1B's shape
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
}
QUICK = {"config": "llama-tiny", "batch": 2, "tokens": 32, "answer_tokens": 8, "steps": 3}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all", help="all (every registered method) or specs, e.g. lora,neutral")
    parser.add_argument("--steps", type=int, default=5, help="interleaved rounds: timed steps of each method and its LoRA")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps of each model first (at least one runs: memory is measured there)")
    parser.add_argument("--batch", type=int, default=8, help="rows per batch")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per row (model inputs)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="scored tokens at the end of each row")
    parser.add_argument("--fisher-windows", type=int, default=4, help="windows of EWC's Fisher (setup)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, hf:PATH or PATH.gguf")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="a random-initialised Llama of this shape instead of --model")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="autocast of forward and loss")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the rounds, one more step of each model of a pair under torch.profiler: the N "
                             "operators whose self CPU time exceeds LoRA's most (where a method's extra time goes)")
    parser.add_argument("--quick", action="store_true", help="check the script: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    args = parser.parse_args()
    if args.quick:  # options given explicitly win
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or not 0 < args.answer_tokens <= args.tokens:
        parser.error("need --steps >= 1, --warmup >= 0, --batch >= 1 and 0 < --answer-tokens <= --tokens")
    args.warmup = max(1, args.warmup)  # memory is measured over the warm-up
    return args


def no_native_bf16(device: torch.device) -> str | None:
    """Why bf16 would be emulated on `device` (None: the hardware computes in bf16)."""
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else f"{torch.cuda.get_device_name(device)} has no bf16"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: oneDNN's answer
        flags = {"avx512_bf16"} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    if flags & {"avx512_bf16", "amx_bf16"}:
        return None
    return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16 (AVX-512 BF16 or AMX): "
            "bf16 would be emulated, many times slower than fp32, and say nothing of machines that have it")


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


class Arm:
    """One model in training as forgetless.train runs it: `step()` is one whole optimizer step, timed."""

    def __init__(self, model, params, loss_fn, hooks: StepHooks, cfg, precision: str, facts: dict):
        self.model, self.loss_fn, self.hooks, self.cfg, self.precision = model, loss_fn, hooks, cfg, precision
        self.opt = hooks.make_optimizer(params, cfg) or build_optimizer(cfg.optimizer, params, cfg, model)
        self.tensors = [p for _, p in params]
        self.device = self.tensors[0].device
        self.facts = {"trainable_params": sum(p.numel() for p in self.tensors), **facts}
        self.steps, self.loss = 0, float("nan")
        model.train()

    def step(self) -> float:
        """ms of one step (`loss.item()` waits for the device)."""
        t0 = time.perf_counter()
        with autocast(self.device, self.precision):
            loss = self.loss_fn()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.tensors, self.cfg.grad_clip)
        self.steps += 1
        self.hooks.before_step(self.model, self.opt, self.steps, False)
        self.opt.step()
        self.hooks.after_step(self.model, self.opt, self.steps, False)
        self.loss = loss.item()
        return 1000 * (time.perf_counter() - t0)

    def warm_up(self, steps: int) -> dict:
        """Untimed steps; the peak RSS over them (and the CUDA allocator's) with only this model
        beside the base."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with PeakRSS() as memory:
            for _ in range(steps):
                self.step()
        cuda = self.device.type == "cuda"
        return {"peak_rss_mb": memory.peak_mb, **({"peak_cuda_mb": torch.cuda.max_memory_allocated(self.device) / 2**20}
                                                  if cuda else {})}


def lora_arm(base, batch: Batch, cfg, args) -> Arm:
    t0 = time.perf_counter()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Arm(model, params, lambda: training_loss(model, batch)[0], StepHooks(), cfg, args.precision,
               {"setup_s": time.perf_counter() - t0, "trains_base": False})


def method_arm(base, spec, batch: Batch, cfg, args) -> Arm:
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
    mixed = with_mix(batch, method.cfg.mix)
    hooks = HookChain([method, *module_hooks(adapted.model, params)])
    return Arm(adapted.model, params, lambda: adapted.loss(mixed), hooks, cfg, args.precision,
               {"setup_s": time.perf_counter() - t0, "trains_base": any(id(p) in base_ids for _, p in params),
                "mixed_rows": int(mixed.from_other.sum())})


def free():
    gc.collect()
    release_memory()
    torch.cuda.empty_cache()  # a no-op without CUDA


def interleaved(base, spec, batch: Batch, cfg, args) -> dict:
    """The method's and its own LoRA's steps, alternating after each one's warm-up (memory: the method's first)."""
    free()
    rss_before = rss_mb()
    torch.manual_seed(0)
    arm = method_arm(base, spec, batch, cfg, args)
    memory = arm.warm_up(args.warmup)
    lora = lora_arm(base, batch, cfg, args)
    lora.warm_up(args.warmup)
    ms, lora_ms = [], []
    for _ in range(args.steps):  # A B A B ...
        lora_ms.append(lora.step())
        ms.append(arm.step())
    out = {**arm.facts, **memory, "rss_before_mb": rss_before, "loss": arm.loss, "step_ms": ms, "lora_ms": lora_ms}
    if args.profile:
        out["profile"] = extra_ops(arm, lora, args.profile)
    del arm, lora
    free()
    return out


def op_ms(arm: Arm) -> dict[str, float]:
    """Self CPU ms per operator over one more step of `arm` (under the profiler, so small operators weigh more)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        arm.step()
    return {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}


def extra_ops(arm: Arm, lora: Arm, n: int) -> list[list]:
    """[operator, method ms, LoRA ms] of the `n` operators whose self time in one step of `arm` exceeds that in
    one step of `lora` most; first the total."""
    mine, theirs = op_ms(arm), op_ms(lora)
    top = sorted(set(mine) | set(theirs), key=lambda op: theirs.get(op, 0.0) - mine.get(op, 0.0))[:n]
    total = ["total", round(sum(mine.values()), 1), round(sum(theirs.values()), 1)]
    return [total] + [[op, round(mine.get(op, 0.0), 1), round(theirs.get(op, 0.0), 1)] for op in top]


def row(r: dict, tokens: int) -> dict:
    """One method's results: medians, spreads and the ratio to the LoRA steps of its rounds."""
    ms, lora = spread(r["step_ms"]), spread(r["lora_ms"])
    ratio = statistics.median(r["step_ms"]) / statistics.median(r["lora_ms"])
    paired = [m / b for m, b in zip(r["step_ms"], r["lora_ms"])]
    out = {"ms": ms["median"], "baseline_ms": lora["median"], "ratio": round(ratio, 3),
           "ms_spread": ms, "baseline_ms_spread": lora, "ratio_per_round": [round(min(paired), 3), round(max(paired), 3)],
           "tokens_per_s": round(1000 * tokens / ms["median"], 1), "trainable_params": r["trainable_params"],
           "peak_rss_mb": round(r["peak_rss_mb"]), "rss_before_mb": round(r["rss_before_mb"]),
           "setup_s": round(r["setup_s"], 2), "trains_base": r["trains_base"],
           "meets_target": None if r["trains_base"] else ratio <= TARGET, "loss": round(r["loss"], 4),
           "step_ms_all": [round(t, 1) for t in r["step_ms"]], "baseline_ms_all": [round(t, 1) for t in r["lora_ms"]]}
    if "peak_cuda_mb" in r:
        out["peak_cuda_mb"] = round(r["peak_cuda_mb"])
    if "profile" in r:
        out["profile_ms"] = r["profile"]  # [operator, method ms, LoRA ms], the total first
    return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = resolve_device(args.device)
    model_name = args.config or args.model
    if args.precision == "bf16" and args.config != "llama-tiny" and (why := no_native_bf16(device)):
        print(f"bf16 skipped: {why}; run --precision fp32 here")
        print(json.dumps({"bench": "real", "skipped": why, "config": {"model": model_name, "device": str(device),
                                                                       "precision": args.precision}}))
        return
    made_by = provenance(peft="peft", transformers="transformers")  # before the run: the code that runs
    load_start = os.getloadavg()
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
          f"batch {args.batch} x {args.tokens} tokens ({args.answer_tokens} scored per row), {args.warmup} warm-up "
          f"steps each, then {args.steps} interleaved rounds (LoRA, method); {device}, {args.precision}, "
          f"{torch.get_num_threads()} threads; load average {load_start[0]:.2f}", flush=True)

    free()
    alone = lora_arm(base, batch, cfg, args)  # the baseline's own memory, beside the base only
    baseline = {**alone.facts, **alone.warm_up(args.warmup)}
    del alone
    rows = {}
    for spec in specs:
        rows[spec.label] = r = row(interleaved(base, spec, batch, cfg, args), tokens)
        print(f"  {spec.label}: {r['ms']:.0f} ms/step [{r['ms_spread']['q1']:.0f}-{r['ms_spread']['q3']:.0f}], "
              f"LoRA in the same rounds {r['baseline_ms']:.0f} [{r['baseline_ms_spread']['q1']:.0f}-"
              f"{r['baseline_ms_spread']['q3']:.0f}]: {r['ratio']:.2f}x (setup {r['setup_s']:.1f} s)", flush=True)
        for op, mine, theirs in r.get("profile_ms", []):
            print(f"    {op:<40} {mine:>9.1f} ms  LoRA {theirs:>9.1f} ms  (+{mine - theirs:.1f})", flush=True)
    lora_all = [t for r in rows.values() for t in r["baseline_ms_all"]]
    baseline_ms = statistics.median(lora_all) if lora_all else float("nan")
    load_end = os.getloadavg()

    peak = "peak_cuda_mb" if device.type == "cuda" else "peak_rss_mb"  # the table's memory column
    header = (f"{'method':<22} {'ms/step':>8} {'IQR':>11} {'LoRA ms':>8} {'IQR':>11} {'x LoRA':>7} {'per round':>11} "
              f"{'trainable':>13} {'peak CUDA MB' if device.type == 'cuda' else 'peak RSS MB':>12}  target")
    print("\n" + header + "\n" + "-" * len(header))
    iqr = lambda s: f"{s['q1']:.0f}-{s['q3']:.0f}"  # noqa: E731
    print(f"{BASELINE:<22} {baseline_ms:>8.0f} {'':>11} {baseline_ms:>8.0f} {'':>11} {1:>7.2f} {'':>11} "
          f"{baseline['trainable_params']:>13,} {baseline[peak]:>12.0f}  baseline (median of all its rounds)")
    for label, r in rows.items():
        verdict = "trains base" if r["trains_base"] else ("meets" if r["meets_target"] else "MISSES")
        lo, hi = r["ratio_per_round"]
        print(f"{label:<22} {r['ms']:>8.0f} {iqr(r['ms_spread']):>11} {r['baseline_ms']:>8.0f} "
              f"{iqr(r['baseline_ms_spread']):>11} {r['ratio']:>7.2f} {f'{lo:.2f}-{hi:.2f}':>11} "
              f"{r['trainable_params']:>13,} {r[peak]:>12.0f}  {verdict}")
    attach_style = [k for k, r in rows.items() if not r["trains_base"]]
    meet = [k for k in attach_style if rows[k]["meets_target"]]
    print(f"\ntarget <= {TARGET}x {BASELINE} timed in the same rounds: {len(meet)} of {len(attach_style)} attach-style "
          f"methods meet it: {', '.join(meet) or 'none'}; miss: {', '.join(k for k in attach_style if k not in meet) or 'none'}"
          f"; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")

    print(json.dumps({
        "bench": "real", "provenance": made_by, "baseline": BASELINE,
        "baseline_ms": round(baseline_ms, 1), "methods": rows,
        "config": {"model": model_name, "random_init": bool(args.config), "device": str(device),
                   "precision": args.precision, "model_facts": facts, "batch": args.batch, "tokens": args.tokens,
                   "answer_tokens": args.answer_tokens, "steps": args.steps, "warmup": args.warmup,
                   "timing": "interleaved: LoRA, method per round; ratio = method median / its LoRA median",
                   "threads": torch.get_num_threads(), "optimizer": cfg.optimizer, "lr": cfg.lr,
                   "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "fisher_windows": args.fisher_windows,
                   "target_ratio": TARGET, "baseline_trainable_params": baseline["trainable_params"],
                   "baseline_peak_rss_mb": round(baseline["peak_rss_mb"]),
                   **({"baseline_peak_cuda_mb": round(baseline["peak_cuda_mb"])} if device.type == "cuda" else {}),
                   "load_average": [round(load_start[0], 2), round(load_end[0], 2)], "cpus": os.cpu_count(),
                   "load_s": round(load_s, 1), "torch": torch.__version__, "argv": sys.argv[1:],
                   "date": datetime.date.today().isoformat()}}))


if __name__ == "__main__":
    main()
