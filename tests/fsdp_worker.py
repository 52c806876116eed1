"""A tiny adaptation of a random Hugging Face Llama (tied embeddings) for tests/test_fsdp.py: `main([...])` in
the test's process, or in N processes with FSDP (`torchrun --nproc_per_node N tests/fsdp_worker.py ... --fsdp`).

Rank 0 writes OUT: the trained parameters, whole ("param.<name>"), and meta {"loss", "evals", "world_size"};
--ckpt checkpoints the training and --stop-at stops it after a step (raises Stopped), as a killed run.
--streams M1,M2,... instead trains each method on a stream of TASKS short tasks (`streams`), OUT a folder.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from forgetless import attach, distributed
from forgetless.checkpoint import save_checkpoint
from forgetless.continual.evaluate import evaluate
from forgetless.data.splits import Sampler, eval_windows
from forgetless.hooks import StepHooks
from forgetless.train import TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import gguf_llama

BLOCK = 16


def tokens(task: int = 1) -> torch.Tensor:
    """Bytes of a small play-like text (the Llama's vocabulary is 256); another register for each `task` (0: the
    text the base "knew", which methods protecting old data remember at task 1)."""
    names, line = [("NURSE", "PETER"), ("ROMEO", "JULIET"), ("alpha", "beta"), ("x", "y")][task], ["Anon, anon!",
                  "O speak again, bright angel", "sum 12 + 30 = 42", "{'k': [1, 2]}"][task]
    text = "".join(f"{names[i % 2]}:\n{line}, line {i}.\n" for i in range(300))
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
    ap.add_argument("--streams", default="", help="methods, comma-separated: each learns --tasks tasks in turn")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args(argv)
    distributed.init_from_env()
    if args.streams:
        return streams(Path(args.out), args.streams.split(","), args.tasks, args.steps, args.fsdp, args.precision)
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


def streams(out: Path, methods: list[str], tasks: int, steps: int, fsdp: bool, precision: str):
    """Each method, attached to the same random Llama, learns `tasks` tasks of `steps` AdamW steps in turn
    (start_task with the previous task's windows, which its `mix` replays); rank 0 writes out/METHOD.safetensors: the
    whole trained tensors "param.<name>", the method's state "state.<name>" and meta {"loss", "world_size"}. With
    `fsdp`, ranks other than 0 build the model on the meta device; each writes out/METHOD.rank<r>.json: whether every
    tensor of its attached model was on meta, the elements its shards hold and the model's."""
    out.mkdir(parents=True, exist_ok=True)
    for spec in methods:
        torch.manual_seed(0)
        with distributed.meta_unless_main() if fsdp else contextlib.nullcontext():
            adapted = attach(gguf_llama(256).train(), spec)
        if fsdp:
            on_meta = all(t.is_meta for t in adapted.model.state_dict().values())
            adapted.shard(precision)
            held = sum(p.to_local().numel() if distributed.is_shard(p) else p.numel() for p in adapted.parameters())
            (out / f"{spec}.rank{distributed.rank()}.json").write_text(json.dumps(
                {"meta": on_meta, "held": held, "total": sum(p.numel() for p in adapted.parameters())}))
        losses = []
        for task in range(1, tasks + 1):
            adapted.start_task(task, previous=eval_windows(tokens(task - 1), BLOCK, 4))
            cfg = TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=1, eval_every=steps, precision=precision)
            sampler = Sampler(tokens(task), 4, BLOCK, seed=task, other=tokens(task - 1), p=adapted.method.cfg.mix or 0.0)
            history = train(adapted.model, adapted.trainable_parameters(), sampler, cfg,
                            lambda m, batch, adapted=adapted: adapted.losses(batch), desc=f"{spec} task {task}")
            losses += history.loss
            adapted.end_task(task)
        tensors = distributed.full({**{f"param.{n}": p for n, p in adapted.named_parameters()},
                                    **{f"state.{k}": v for k, v in adapted.method.hook_state().items()}})
        save_checkpoint(out / f"{spec}.safetensors", tensors, {"loss": losses, "world_size": distributed.world_size()})


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
