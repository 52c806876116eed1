"""A tiny adaptation of a random Hugging Face Llama (tied embeddings) for tests/test_fsdp.py: `main([...])` in
the test's process, or in N processes with FSDP (`torchrun --nproc_per_node N tests/fsdp_worker.py ... --fsdp`).

Rank 0 writes OUT: the trained parameters, whole ("param.<name>"), and meta {"loss", "evals", "world_size"};
--ckpt checkpoints the training and --stop-at stops it after a step (raises Stopped), as a killed run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from forgetless import attach, distributed
from forgetless.checkpoint import save_checkpoint
from forgetless.continual.evaluate import evaluate
from forgetless.data.splits import Sampler, eval_windows
from forgetless.train import StepHooks, TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import gguf_llama

BLOCK = 16


def tokens() -> torch.Tensor:
    """Bytes of a small play-like text (the Llama's vocabulary is 256)."""
    text = "".join(f"{['ROMEO', 'JULIET'][i % 2]}:\nO speak again, bright angel, line {i}.\n" for i in range(300))
    return torch.tensor(list(text.encode()))


class Stopped(Exception):
    pass


class Stop(StepHooks):
    """Stop after optimizer step `at` (0: never), leaving the last checkpoint as a killed job would."""

    def __init__(self, at: int):
        self.at = at

    def after_step(self, model, optimizer, step, last):
        if step == self.at:
            raise Stopped(step)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--method", default="full")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--stop-at", type=int, default=0)
    args = ap.parse_args(argv)
    distributed.init_from_env()
    data = tokens()
    adapted = attach(gguf_llama(256).train(), args.method)  # tied embeddings, as SmolLM2
    if args.fsdp:
        adapted.shard()
    adapted.start_task(1)
    cfg = TrainConfig(steps=args.steps, batch_size=8, lr=3e-3, warmup=2, eval_every=3, ckpt_every=2)
    windows = eval_windows(data[-2000:], BLOCK, 9)  # 9: the ranks' slices are unequal
    history = train(adapted.model, adapted.trainable_parameters(), Sampler(data, cfg.batch_size, BLOCK, seed=0), cfg,
                    lambda m, batch: adapted.losses(batch), evaluate=lambda: evaluate(adapted, windows, batch_size=4),
                    ckpt_path=Path(args.ckpt) if args.ckpt else None, run_config={"w": 1}, hooks=Stop(args.stop_at))
    params = distributed.full({f"param.{n}": p for n, p in adapted.named_parameters()})
    save_checkpoint(args.out, params, {"loss": history.loss, "evals": history.evals,
                                       "world_size": distributed.world_size()})


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
