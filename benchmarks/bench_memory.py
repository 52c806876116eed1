"""Memory per method: one process per method on a random-weight Llama, peak live-tensor bytes per phase and
peak RSS, with PEFT's own LoRA measured in the same run as the baseline.

    nice -n 19 python benchmarks/bench_memory.py                       # two small shapes, fp32, both loss modes
    python benchmarks/bench_memory.py --shapes 1b --dtypes bf16 --losses answer   # Llama-3.2-1B's shape (a GPU)
    python benchmarks/bench_memory.py --heap lean                      # on CPU: adapt's heap (monitor.lean_heap)

Phases: attach (forgetless.attach), start (start_task: EWC's Fisher, the start copies), step2 (two AdamW steps:
forward, backward, optimizer state), save (save_pretrained). For each: peak RSS by its end (ru_maxrss, above the
process before the model was built: what the run needs of the machine, activations and allocator slack included)
and the tensor bytes Python objects hold after it (weights, gradients, AdamW and method state). The table's
peaks are RSS; bytes per parameter come from the two shapes' difference (same vocabulary, batch and tokens: what
grows with the parameters, activations of the wider layers included), extrapolated to an 8 B model.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from forgetless.memory import LivePeak

SHAPES = {  # LlamaConfig fields; 1b is Llama-3.2-1B's; xs for the tests
    "xs": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512),
    "s": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000),
    "m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),  # SmolLM2-135M's
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}
METHODS = ["peft-lora", "lora", "lora+ewc", "lora+distill", "lora+ewc+distill", "moram", "moram+ewc", "neutral",
           "neutral+distill", "full", "ewc", "distill", "ewc-distill", "osf"]
PHASES = ("attach", "start", "step2", "save")  # peak RSS (above the process before the model) by each one's end
EIGHT_B = 8.03e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--shapes", default="s,m", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="fp32", help="fp32 (fp32 weights, bf16 autocast), fp32-noamp (fp32 "
                    "weights and compute), bf16 (bf16 weights)")
    ap.add_argument("--losses", default="answer,full", help="answer (last quarter scored) and/or full sequence")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heap", default="glibc", choices=("glibc", "lean"),
                    help="the C heap of each method's process: glibc's default, or adapt's lean heap "
                         "(forgetless.monitor.lean_heap: allocations of 1 MiB or more mapped apart, given back when freed)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, *args.shapes.split(":"), args.dtypes, args.losses, args.batch,
                                 args.tokens, args.device)))
        return
    rows = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for loss in args.losses.split(","):
                for method in args.methods.split(","):
                    cmd = [sys.executable, __file__, "--child", method, "--shapes", shape, "--dtypes", dtype,
                           "--losses", loss, "--batch", str(args.batch), "--tokens", str(args.tokens),
                           "--device", args.device]
                    out = subprocess.run(cmd, capture_output=True, text=True,
                                         env={**os.environ, "FORGETLESS_HEAP": args.heap})
                    if out.returncode:
                        print(f"{method} {shape} {dtype} {loss}: failed: {out.stderr.strip().splitlines()[-1]}")
                        continue
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    r = rows[-1]
                    print(f"{shape:3s} {dtype:5s} {loss:6s} {method:18s} params {r['params'] / 1e6:7.1f} M  "
                          + "  ".join(f"{p} {r['held'][p] / 2**20:7.1f}/{r['rss'][p] / 2**20:7.1f}" for p in PHASES)
                          + " MiB (held/peak RSS)" + ratios(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"heap: {args.heap}")
    print(table(rows))
    print(estimates(rows))


def ratios(r: dict) -> str:
    if r["estimate"] is None:
        return ""
    live = r["live"]["step2"]
    return (f"; estimate {r['estimate'] / 2**20:.1f} MiB = {r['estimate'] / live:.2f}x measured live peak "
            f"{live / 2**20:.1f}, {r['estimate'] / r['peak']:.2f}x peak RSS")


def estimates(rows: list[dict]) -> str:
    """Markdown: forgetless.memory's estimate against the measured peak of live tensors (to step 2) and peak RSS."""
    out = ["| shape | dtype | loss | method | estimate MiB | live peak MiB | estimate / live | peak RSS MiB | "
           "estimate / RSS |", "|" + "---|" * 9]
    for r in rows:
        if r["estimate"] is not None:
            live = r["live"]["step2"]
            out.append(f"| {r['shape']} | {r['dtype']} | {r['loss']} | {r['method']} | {r['estimate'] / 2**20:.1f} | "
                       f"{live / 2**20:.1f} | {r['estimate'] / live:.2f} | {r['peak'] / 2**20:.1f} | "
                       f"{r['estimate'] / r['peak']:.2f} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    """Markdown: peak live MiB per shape, its ratio to PEFT LoRA's in the same setting, and bytes per parameter
    from the two smallest shapes, extrapolated to 8 B."""
    keys = sorted({(r["dtype"], r["loss"]) for r in rows})
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: min(r["params"] for r in rows if r["shape"] == s))
    out = ["| dtype | loss | method | " + " | ".join(f"peak MiB ({s}) | x PEFT LoRA ({s})" for s in shapes)
           + " | held MiB at step 2 (" + shapes[-1] + ") | bytes/param | 8 B, linear extrapolation (GiB, overstates) |",
           "|" + "---|" * (6 + 2 * len(shapes))]
    for dtype, loss in keys:
        at = {(r["shape"], r["method"]): r for r in rows if (r["dtype"], r["loss"]) == (dtype, loss)}
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for s in shapes:
                r, base = at.get((s, method)), at.get((s, "peft-lora"))
                cells += [f"{r['peak'] / 2**20:.0f}" if r else "-",
                          f"{r['peak'] / base['peak']:.2f}" if r and base else "-"]
            per = per_parameter(at, shapes, method)
            last = at.get((shapes[-1], method))
            rss = f"{last['held']['step2'] / 2**20:.0f}" if last else "-"
            extrapolated = f"{per:.1f} | {per * EIGHT_B / 2**30:.0f}" if per is not None else "- | -"
            out.append(f"| {dtype} | {loss} | {method} | " + " | ".join(cells) + f" | {rss} | {extrapolated} |")
    return "\n".join(out)


def per_parameter(at: dict, shapes: list[str], method: str) -> float | None:
    """(peak of the largest shape - peak of the smallest) / (their parameter difference)."""
    lo, hi = at.get((shapes[0], method)), at.get((shapes[-1], method))
    if not lo or not hi or hi["params"] == lo["params"]:
        return None
    return (hi["peak"] - lo["peak"]) / (hi["params"] - lo["params"])


def measure(method: str, shape: str, dtype: str, loss: str, batch: int, tokens: int, device: str) -> dict:
    """One method's run in this process: tensor bytes held after each phase and peak RSS by its end (both above
    the process before the model was built, with peft and every method's module already imported)."""
    from forgetless.monitor import lean_heap
    if os.environ.get("FORGETLESS_HEAP") == "lean":
        lean_heap()
    import peft  # noqa: F401 (imported before the baseline: every arm, PEFT's and ours, then pays for it alike)
    from transformers import LlamaConfig, LlamaForCausalLM

    import forgetless
    import forgetless.methods  # noqa: F401 (every method's module, for the same reason)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[shape]["vocab_size"]
    ids = torch.randint(vocab, (batch, tokens), generator=g).to(device)                       # (B, T)
    labels = ids.clone()
    if loss == "answer":
        labels[:, : tokens * 3 // 4] = -100  # the prompt: only the last quarter is scored
    retained = torch.arange(batch, device=device) < max(1, batch // 4)                     # (B,) old rows
    previous = torch.randint(vocab, (4, tokens + 1), generator=g)                          # (4, T+1) Fisher rows
    rss0, held0 = peak_rss(), held_bytes()
    held, rss, live = {}, {}, {}
    predicted = predict(method, shape, dtype, loss, batch, tokens)
    tracker = LivePeak().__enter__()  # every storage made from here on: the measured peak the estimate predicts
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if method == "peft-lora":
        from peft import LoraConfig, get_peft_model
        adapted = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    else:
        adapted = forgetless.attach(model, method)
    held["attach"], rss["attach"], live["attach"] = held_bytes() - held0, peak_rss() - rss0, tracker.peak
    if method != "peft-lora":
        adapted.start_task(1, previous if adapted.method.needs_previous else None)
    held["start"], rss["start"], live["start"] = held_bytes() - held0, peak_rss() - rss0, tracker.peak
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    adapted.train()
    for _ in range(2):
        with torch.autocast(device.split(":")[0], torch.bfloat16, enabled=dtype == "fp32"):  # fp32-noamp: none
            out = adapted(input_ids=ids, labels=labels, **({} if method == "peft-lora" else {"retained": retained}))
        out.loss.backward()
        held["step2"] = held_bytes() - held0  # gradients present, before the step frees them
        opt.step()
        opt.zero_grad(set_to_none=True)
    rss["step2"], live["step2"] = peak_rss() - rss0, tracker.peak
    tracker.__exit__(None, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        adapted.save_pretrained(tmp)
    held["save"], rss["save"] = held_bytes() - held0, peak_rss() - rss0
    return {"method": method, "shape": shape, "dtype": dtype, "loss": loss,
            "heap": os.environ.get("FORGETLESS_HEAP", "glibc"), "batch": batch, "tokens": tokens,
            "params": params, "trainable": sum(p.numel() for p in trainable), "held": held, "rss": rss,
            "peak": max(rss.values()), "live": live, "estimate": predicted}


def predict(method: str, shape: str, dtype: str, loss: str, batch: int, tokens: int) -> float | None:
    """forgetless.memory's estimate of the peak of this run (None for PEFT's LoRA, which has no forgetless method):
    the same model on the meta device, the same rows, retained rows, scored share and precision."""
    if method == "peft-lora":
        return None
    from transformers import LlamaConfig

    from forgetless.memory import Setting, estimate, meta_model
    from forgetless.methods import build_method
    setting = Setting(batch, tokens, mix=max(1, batch // 4) / batch, scored=0.25 if loss == "answer" else 1.0,
                      dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                      precision="bf16" if dtype == "fp32" else "fp32", every_position=True)  # Adapted's forward
    model = meta_model(LlamaConfig(**SHAPES[shape]), setting.dtype)
    return estimate(model, build_method(method), setting).total


def held_bytes() -> int:
    """Bytes of every distinct tensor storage Python objects reach (weights, gradients, optimizer and method
    state; not the activations autograd holds inside a step)."""
    seen = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj):
            for t in (obj, obj.grad if obj.requires_grad or obj.grad is not None else None):
                if t is not None and t.device.type != "meta":
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
