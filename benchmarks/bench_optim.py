"""The optimizers' step vs AdamW's on the quick preset's GPT (0.84 M parameters, fixed random
gradients; l2reg with the inputs of one forward recorded): median ms per `optimizer.step()`, all
optimizers alternating within each repeat, so the ratios (optimizer / AdamW) hold on a noisy
machine. Forward + backward of a 32 x 128 batch is printed too, for scale.

    python benchmarks/bench_optim.py [--repeats 7] [--iters 5]
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from _timing import parse_args, provenance

from forgetless.models.gpt import GPT, GPTConfig
from forgetless.optim import OPTIMIZERS, build_optimizer
from forgetless.train import TrainConfig


def step_ms(opt: torch.optim.Optimizer, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        opt.step()
    return 1000 * (time.perf_counter() - t0) / iters


def main():
    args = parse_args(__doc__)
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    params = list(model.named_parameters())
    opts = {name: build_optimizer(name, params, TrainConfig(lr=1e-9), model) for name in OPTIMIZERS}
    idx = torch.randint(0, 256, (32, 128))
    t0 = time.perf_counter()
    model(idx).square().mean().backward()  # also records the linear layers' inputs for l2reg's erase term
    fwd_bwd_ms = 1000 * (time.perf_counter() - t0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    times = {name: [] for name in opts}
    for name, opt in opts.items():
        step_ms(opt, 2)  # warm up, creates the state
    for _ in range(args.repeats):
        for name, opt in opts.items():
            times[name].append(step_ms(opt, args.iters))
    ms = {name: statistics.median(t) for name, t in times.items()}
    ratios = {name: round(v / ms["adamw"], 3) for name, v in ms.items()}
    for name in opts:
        print(f"{name:6s} {ms[name]:7.2f} ms per step, ratio {ratios[name]:.2f} vs AdamW")
    print(f"(forward + backward of one 32 x 128 batch: {fwd_bwd_ms:.0f} ms, unwarmed)")
    slowest = max((n for n in ms if n != "adamw"), key=ms.get)
    print(json.dumps({"bench": "optim", "provenance": provenance(), "ratio": ratios[slowest], "baseline_ms": round(ms["adamw"], 2),
                      "candidate_ms": round(ms[slowest], 2),
                      "config": {"candidate": slowest, "ratios": ratios, "params": model.num_params(),
                                 "threads": torch.get_num_threads(), "repeats": args.repeats, "iters": args.iters}}))


if __name__ == "__main__":
    main()
