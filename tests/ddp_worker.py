"""A tiny pretraining (and adaptation) run for tests/test_ddp.py, launched in one process
(`python tests/ddp_worker.py ...`) or in N (`torchrun --nproc_per_node N tests/ddp_worker.py ...`).

Rank 0 writes OUT: the trained parameters ("param.<name>") and meta {"loss": [[step, loss]], "evals": [...],
"world_size": N}; --ckpt/--kill-at checkpoint the pretraining and kill it after a step; with --method (a spec,
e.g. "cms[periods=1,2,4]"), the pretrained base goes to OUT.base and the adapted method to OUT.method/
(save_pretrained).

`--batch FILE` runs the runs FILE lists (one `OUT ARGS...` a line) one after another in the same processes and
process group (one launch instead of one each: a launch costs ~10 s of imports per process); a run that
raises a ForgetlessError writes its message to OUT.error and the next one starts.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from forgetless import attach, distributed
from forgetless.checkpoint import save_checkpoint
from forgetless.continual.evaluate import evaluate
from forgetless.hooks import StepHooks
from forgetless.loss import training_loss
from forgetless.data.splits import Batch, Sampler, eval_windows
from forgetless.errors import ForgetlessError
from forgetless.methods.base import parse_method_specs
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import TrainConfig, train

SMOKE = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of Tiny Shakespeare: the first 100 kB (A) and the next 100 kB upper-cased (B)."""
    text = Path(os.environ["FORGETLESS_TINYSHAKESPEARE"]).read_bytes()
    return torch.tensor(list(text[:100_000])), torch.tensor(list(text[100_000:200_000].upper()))


class Kill(StepHooks):
    """Die (the last rank) after optimizer step `at` (0: never), as a killed job would."""

    def __init__(self, at: int):
        self.at = at

    def after_step(self, model, optimizer, step, last):
        if step == self.at and distributed.rank() == distributed.world_size() - 1:
            os._exit(3)


class AnswersOnly(Sampler):
    """Batches scored on a ragged suffix of every row (row i scores its last 4 + 3i targets), so the
    ranks' shards hold unequal numbers of scored tokens."""

    def next(self) -> Batch:
        batch = super().next()
        batch.y = batch.y.clone()  # a view of the windows, like x
        for i in range(len(batch.y)):
            batch.y[i, :max(0, batch.y.shape[1] - 4 - 3 * i)] = -100
        return batch


def main():
    distributed.init_from_env()
    torch.set_num_threads(1)
    if sys.argv[1] != "--batch":
        return run(parse(sys.argv[1:]))
    for line in Path(sys.argv[2]).read_text().splitlines():
        args = parse(shlex.split(line))
        try:
            run(args)
        except ForgetlessError as e:  # raised on every rank alike (a refused option): the group stays in step
            if distributed.is_main():
                Path(f"{args.out}.error").write_text(str(e))


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--method", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--answers-only", action="store_true")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--kill-at", type=int, default=0)
    return ap.parse_args(argv)


def run(args: argparse.Namespace):
    a, b = tokens()
    method = parse_method_specs(args.method)[0].build() if args.method else None
    torch.manual_seed(0)
    model = GPT(method.base_config(SMOKE) if method else SMOKE)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=3e-3, warmup=2, eval_every=3, ckpt_every=2,
                      optimizer=args.optimizer)
    windows = eval_windows(b if method else a, SMOKE.block_size, 9)  # 9: the ranks' slices are unequal
    sampler = (AnswersOnly if args.answers_only else Sampler)(a, cfg.batch_size, SMOKE.block_size, seed=0)
    history = train(model, list(model.named_parameters()), sampler, cfg, training_loss,
                    evaluate=lambda: evaluate(model, windows), ckpt_path=Path(args.ckpt) if args.ckpt else None,
                    run_config={"w": 1}, hooks=Kill(args.kill_at), desc="pretrain")
    trained = model
    if method:
        save_checkpoint(f"{args.out}.base", model.state_dict(), {"kind": "base"})
        adapted = attach(model, method)
        for task in (1, 2):  # task 2 grows what grows (MoRAM atoms)
            adapted.start_task(task)
            sampler = Sampler(b, cfg.batch_size, SMOKE.block_size, seed=task, other=a, p=0.25)
            history = train(adapted, adapted.trainable_parameters(), sampler, cfg,
                            lambda m, batch: adapted.losses(batch), evaluate=lambda: evaluate(adapted, windows),
                            desc=f"adapt {task}", hooks=adapted.method)
            adapted.end_task(task)
        adapted.save_pretrained(f"{args.out}.method")
        trained = adapted
    save_checkpoint(args.out, {f"param.{n}": p for n, p in trained.named_parameters()},
                    {"loss": history.loss, "evals": history.evals, "world_size": distributed.world_size()})


if __name__ == "__main__":
    sys.exit(main())
