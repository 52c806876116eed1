"""Data-parallel throughput: time per global step of 2 processes (torchrun, gloo) vs 1 process.

Both train the same model on the same global batch with one thread per process; the ratio is
candidate (2 processes) / baseline (1 process) ms per step, below 1 when data parallelism pays off.
On a 2-core CPU machine (ours) the point of DDP is correctness, not speed: the all-reduce, the
duplicated sampling and the shared cores eat most of the gain; on GPUs, one per rank, it is the way
to scale. Each launch is timed after a warm-up, inside the training loop (no process start-up).

    python benchmarks/bench_ddp.py [--steps 30] [--repeats 3] [--preset smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import provenance

from forgetless import distributed
from forgetless.checkpoint import write_json
from forgetless.loss import training_loss
from forgetless.data.corpora import load_corpus
from forgetless.data.splits import Sampler, join
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.models.gpt import GPT
from forgetless.presets import build_config
from forgetless.train import train


def worker(out: str, preset: str, steps: int, batch_size: int):
    """One launch (alone or as a torchrun rank): ms per step of `steps` steps after 3 warm-up steps."""
    distributed.init_from_env()
    torch.set_num_threads(1)
    cfg = build_config(preset)
    tokens = ByteTokenizer().encode(join(load_corpus("tinyshakespeare").docs))
    torch.manual_seed(0)
    model = GPT(cfg.model)
    sampler = Sampler(tokens, batch_size, cfg.model.block_size, seed=0)
    params = list(model.named_parameters())
    for n in (3, steps):
        train_cfg = type(cfg.pretrain)(**{**cfg.pretrain.__dict__, "steps": n, "warmup": 2, "batch_size": batch_size})
        t0 = time.perf_counter()
        train(model, params, sampler, train_cfg, training_loss, desc="bench")
    write_json(out, {"ms": 1000 * (time.perf_counter() - t0) / steps})


def launch(procs: int, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ms.json"
        cmd = [sys.executable, __file__, "--worker", str(out), "--preset", args.preset, "--steps", str(args.steps),
               "--batch-size", str(args.batch_size)]
        if procs > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                        "--master_addr", "127.0.0.1", "--master_port", str(port)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        return json.loads(out.read_text())["ms"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.preset, args.steps, args.batch_size)
    base, cand = [], []
    for _ in range(args.repeats):
        base.append(launch(1, args))
        cand.append(launch(2, args))
    b, c = statistics.median(base), statistics.median(cand)
    print(f"{args.preset} model, global batch {args.batch_size}: {c:.1f} ms/step with 2 processes, {b:.1f} ms/step "
          f"with 1 ({os.cpu_count()} cores, 1 thread per process; on this CPU box DDP is for correctness, not speed)")
    print(json.dumps({"bench": "ddp", "provenance": provenance(), "ratio": round(c / b, 3), "baseline_ms": round(b, 2), "candidate_ms": round(c, 2),
                      "config": {"preset": args.preset, "steps": args.steps, "repeats": args.repeats,
                                 "batch_size": args.batch_size, "processes": 2, "cores": os.cpu_count()}}))


if __name__ == "__main__":
    main()
