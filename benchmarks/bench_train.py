"""Training throughput of the quick preset: tokens/s of forgetless's loop vs a bare PyTorch loop.

Baseline: forward + cross-entropy + backward + AdamW step on fixed random batches.
Candidate: `forgetless.train.train` (sampler, lr schedule, clipping, progress bar) on real bytes.
Both use the quick preset's model and batch and run in this process, alternating, so the
ratio (candidate / baseline time per step) is robust to a noisy shared machine.

    python benchmarks/bench_train.py [--steps 30] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _timing import provenance

from forgetless.loss import training_loss
from forgetless.data.corpora import load_corpus
from forgetless.data.splits import Sampler, join
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.models.gpt import GPT
from forgetless.presets import build_config
from forgetless.train import train


def bare_loop(cfg, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain.lr)
    x = torch.randint(0, 256, (cfg.pretrain.batch_size, cfg.model.block_size + 1))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def forgetless_loop(cfg, tokens, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(cfg.model)
    sampler = Sampler(tokens, cfg.pretrain.batch_size, cfg.model.block_size, seed=0)
    train_cfg = type(cfg.pretrain)(**{**cfg.pretrain.__dict__, "steps": steps, "warmup": 2})
    t0 = time.perf_counter()
    train(model, list(model.named_parameters()), sampler, train_cfg, training_loss,
          desc="bench")
    return (time.perf_counter() - t0) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = build_config("quick")
    tokens = ByteTokenizer().encode(join(load_corpus("shakespeare-modern").docs))
    bare_loop(cfg, 3)  # warm up
    base, cand = [], []
    for _ in range(args.repeats):
        base.append(bare_loop(cfg, args.steps))
        cand.append(forgetless_loop(cfg, tokens, args.steps))
    b, c = statistics.median(base), statistics.median(cand)
    tokens_per_step = cfg.pretrain.batch_size * cfg.model.block_size
    print(f"quick preset: {tokens_per_step / c:,.0f} training tokens/s with forgetless's loop, "
          f"{tokens_per_step / b:,.0f} bare PyTorch ({torch.get_num_threads()} threads)")
    print(json.dumps({"bench": "train", "provenance": provenance(), "ratio": round(c / b, 3), "baseline_ms": round(1000 * b, 2),
                      "candidate_ms": round(1000 * c, 2), "candidate_tokens_per_s": round(tokens_per_step / c),
                      "config": {"preset": "quick", "steps": args.steps, "repeats": args.repeats,
                                 "tokens_per_step": tokens_per_step}}))


if __name__ == "__main__":
    main()
