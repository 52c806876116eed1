"""One MoRAM-wrapped linear (64 atoms) vs a PEFT LoRA linear of rank 64: forward + backward time.

Both wrap the same frozen nn.Linear and get the same input (which needs grad, as inside a
network). MoRAM is measured as the source's LLM setting leaves it after 8 tasks (8 x 8 atoms,
the newest 8 training, top-k 8) and, second, with all 64 atoms training. Baseline and candidate
alternate within each repeat and medians are compared (see _timing.py).

    python benchmarks/bench_moram.py [--repeats 7] [--iters 5]
"""
from __future__ import annotations

import copy
import json

import torch
import torch.nn as nn
from _timing import compare, parse_args, provenance
from peft import LoraConfig, inject_adapter_in_model

from forgetless.nn.moram import MoRAMConfig, MoRAMLinear

SIZES = {"d768": dict(d=768, tokens=2048), "quick": dict(d=128, tokens=2048)}


def frozen_linear(d: int) -> nn.Module:
    layer = nn.Sequential(nn.Linear(d, d))
    layer.requires_grad_(False)
    return layer


def lora_layer(base: nn.Module, rank: int) -> nn.Module:
    layer = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"]), copy.deepcopy(base))
    for name, p in layer.named_parameters():
        p.requires_grad_("lora_" in name)
    with torch.no_grad():  # B = 0 would let autograd skip work that a trained adapter needs
        for name, p in layer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return layer


def moram_layer(base: nn.Module, d: int, tasks: int, per_task: int) -> nn.Module:
    layer = MoRAMLinear(copy.deepcopy(base), d, d, MoRAMConfig(atoms_per_task=per_task, top_k=8))
    for _ in range(tasks):
        layer.add_task()
    with torch.no_grad():
        for v in layer.values:
            v.normal_(std=0.02)
    return layer


def main():
    args = parse_args(__doc__)
    results = {}
    for name, size in SIZES.items():
        torch.manual_seed(0)
        d = size["d"]
        x = torch.randn(size["tokens"], d, requires_grad=True)
        base = frozen_linear(d)
        lora = lora_layer(base, 64)
        for label, (tasks, per_task) in {"8x8": (8, 8), "1x64": (1, 64)}.items():
            r = results[f"{name}/{label}"] = compare(lora, moram_layer(base, d, tasks, per_task), x,
                                                     args.repeats, args.iters)
            print(f"{name:5s} d={d} tokens={size['tokens']} atoms {label}: LoRA r=64 {r['baseline_ms']:.2f} ms, "
                  f"MoRAM {r['candidate_ms']:.2f} ms, ratio {r['ratio']:.2f} (fwd+bwd)")
    main_row = results["d768/8x8"]
    print(json.dumps({"bench": "moram", "provenance": provenance(), **main_row,
                      "config": {"sizes": SIZES, "threads": torch.get_num_threads(), "repeats": args.repeats,
                                 "iters": args.iters, "all": results}}))


if __name__ == "__main__":
    main()
