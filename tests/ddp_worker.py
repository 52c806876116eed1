"""A tiny pretraining (and adaptation) run for tests/test_ddp.py and benchmarks/bench_ddp.py, launched in
one process (`python tests/ddp_worker.py ...`) or in N (`torchrun --nproc_per_node N tests/ddp_worker.py ...`).

Rank 0 writes OUT: the trained parameters ("param.<name>") and meta {"loss": [[step, loss]], "evals": [...],
"ms_per_step": ...}; with --method, the adapted method also goes to OUT.method/ (save_pretrained).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from forgetless import attach, distributed
from forgetless.checkpoint import save_checkpoint
from forgetless.continual.evaluate import evaluate, training_loss
from forgetless.data.splits import Batch, Sampler, eval_windows
from forgetless.methods import build_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import HookChain, StepHooks, TrainConfig, train

SMOKE = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of Tiny Shakespeare: the first 100 kB (A) and the next 100 kB upper-cased (B)."""
    text = Path(os.environ["FORGETLESS_TINYSHAKESPEARE"]).read_bytes()
    return torch.tensor(list(text[:100_000])), torch.tensor(list(text[100_000:200_000].upper()))


class Kill(StepHooks):
    """Die (rank 1, or rank 0 alone) after optimizer step `at`, as a killed job would."""

    def __init__(self, at: int):
        self.at = at

    def after_step(self, model, optimizer, step, last):
        if step == self.at and distributed.rank() == distributed.world_size() - 1:
            os._exit(3)


def answers_only(model, batch: Batch):
    """LM loss on a ragged suffix of every row (row i scores its last 4 + 3i tokens): ranks hold unequal counts."""
    y = batch.y.clone()
    for i in range(len(y)):
        y[i, :max(0, y.shape[1] - 4 - 3 * i)] = -100
    return training_loss(model, Batch(batch.x, y, batch.from_other))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--method", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--answers-only", action="store_true")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--kill-at", type=int, default=0)
    args = ap.parse_args()
    distributed.init_from_env()
    torch.set_num_threads(1)
    a, b = tokens()
    method = build_method(args.method, {}) if args.method else None
    torch.manual_seed(0)
    model = GPT(method.base_config(SMOKE) if method else SMOKE)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=3e-3, warmup=2, eval_every=3, ckpt_every=2,
                      optimizer=args.optimizer)
    windows = eval_windows(b if method else a, SMOKE.block_size, 9)  # 9: the ranks' slices are unequal
    loss_fn = answers_only if args.answers_only else training_loss
    hooks = Kill(0 if method else args.kill_at)
    ckpt = Path(args.ckpt) if args.ckpt and not method else None
    start = time.perf_counter()
    history = train(model, list(model.named_parameters()), Sampler(a, cfg.batch_size, SMOKE.block_size, seed=0),
                    cfg, loss_fn, evaluate=lambda: evaluate(model, windows), ckpt_path=ckpt, run_config={"w": 1},
                    hooks=hooks, desc="pretrain")
    trained = model
    if method:
        adapted = attach(model, method)
        for task in (1, 2):  # task 2 grows what grows (MoRAM atoms)
            adapted.start_task(task)
            sampler = Sampler(b, cfg.batch_size, SMOKE.block_size, seed=task, other=a, p=0.25)
            ckpt = Path(f"{args.ckpt}.{task}") if args.ckpt else None
            history = train(adapted, adapted.trainable_parameters(), sampler, cfg,
                            lambda m, batch: adapted.losses(batch), evaluate=lambda: evaluate(adapted, windows),
                            ckpt_path=ckpt, run_config={"task": task}, desc=f"adapt {task}",
                            hooks=HookChain([adapted.method, Kill(args.kill_at if task == 2 else 0)]))
            adapted.end_task(task)
        adapted.save_pretrained(f"{args.out}.method")
        trained = adapted
    ms = 1000 * (time.perf_counter() - start) / (args.steps * (3 if method else 1))
    save_checkpoint(args.out, {f"param.{n}": p for n, p in trained.named_parameters()},
                    {"loss": history.loss, "evals": history.evals, "ms_per_step": ms,
                     "world_size": distributed.world_size()})


if __name__ == "__main__":
    sys.exit(main())
