"""Loading and training at size: a random Llama saved as a transformers folder, loaded by forgetless in bf16 and as
a bitsandbytes NF4 (4-bit) base, LoRA trained by transformers' Trainer with gradient checkpointing (the NF4 base
with both variants).

    python benchmarks/bench_at_size.py [--config llama-1b] [--device cuda] [--steps 3] [--batch 4] [--tokens 512]
    python benchmarks/bench_at_size.py --quick       # llama-tiny on the CPU: a check of the script

Prints a line per variant and one JSON line: per variant the load seconds, the weights' bytes, the training's peak
memory (CUDA: max allocated; CPU: peak RSS of the process), seconds per step (after the first), the first and
last loss, and whether LoRA's weights moved. A variant that cannot run here (no bitsandbytes) says why.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import torch
from bench_real import CONFIGS, random_model

import forgetless
from forgetless.device import resolve_device
from forgetless.models.hf import LoadConfig, load_model
from forgetless.monitor import PeakRSS

VARIANTS = {"bf16": LoadConfig("bf16", "none", "on"), "nf4": LoadConfig("bf16", "4bit", "on"),
            "nf4-reentrant": LoadConfig("bf16", "4bit", "reentrant")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama-1b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 2 steps of 2 x 32 tokens on the CPU")
    args = parser.parse_args()
    if args.quick:
        args.config, args.device, args.steps, args.batch, args.tokens = "llama-tiny", "cpu", 2, 2, 32
    return args


def saved_model(config: str, folder: Path) -> Path:
    """The random Llama and a word-level tokenizer as a transformers folder (what `hf:PATH` loads)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    random_model(config, torch.device("cpu")).save_pretrained(folder)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(255)}}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            eos_token="<unk>").save_pretrained(folder)
    return folder


def train_variant(folder: Path, load: LoadConfig, device: torch.device, args) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    if load.quantize != "none" and find_spec("bitsandbytes") is None:
        return {"skipped": "bitsandbytes is not installed"}
    t0 = time.perf_counter()
    model, _ = load_model(f"hf:{folder}", device, load)
    loaded_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapted = forgetless.attach(model, "lora")
    start = {n: p.detach().clone() for n, p in adapted.trainable_parameters()}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [{"input_ids": (ids := torch.randint(1, vocab, (args.tokens,), generator=g).tolist()), "labels": ids}
            for _ in range(args.batch * args.steps)]
    times, losses = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch,
                              learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
                              use_cpu=device.type == "cpu", bf16=False, gradient_checkpointing=True,
                              gradient_checkpointing_kwargs={"use_reentrant": load.gradient_checkpointing == "reentrant"})
    with PeakRSS() as rss:
        Trainer(model=adapted, args=targs, train_dataset=rows, data_collator=forgetless.data.Collator(pad_id=0),
                callbacks=[forgetless.ForgetlessCallback(adapted), Clock()]).train()
        end = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else rss.peak_mb
    steps = [b - a for a, b in zip(times, [*times[1:], end])][1:]  # the first step allocates: not timed
    return {"load_s": round(loaded_s, 2), "weights_mib": round(weight_bytes / 2**20, 1),
            "peak_mib": round(peak, 1), "peak_kind": "cuda max allocated" if device.type == "cuda" else "process RSS",
            "step_s": round(sum(steps) / len(steps), 3) if steps else None,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "lora_moved": any(not torch.equal(p, start[n]) for n, p in adapted.trainable_parameters()),
            "checkpointing": adapted.model.is_gradient_checkpointing}


def main():
    args = parse_args()
    device = resolve_device(args.device)
    out = {"benchmark": "at-size", "config": args.config, "device": str(device), "steps": args.steps,
           "batch": args.batch, "tokens": args.tokens,
           "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = saved_model(args.config, Path(tmp) / "model")
        for name, load in VARIANTS.items():
            result = out["variants"][name] = train_variant(folder, load, device, args)
            print(f"{name}: {result}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
