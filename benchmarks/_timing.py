"""Shared timing for the layer benchmarks: forward + backward of a baseline and a candidate,
alternating within each repeat and taking medians, so their ratio holds on a noisy machine."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn


def step_ms(layer: nn.Module, x: torch.Tensor, iters: int) -> float:
    """ms per forward + backward of `layer` on `x` (waiting for a CUDA device to finish)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        layer.zero_grad(set_to_none=True)
        layer(x).square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return 1000 * (time.perf_counter() - t0) / iters


def compare(baseline: nn.Module, candidate: nn.Module, x: torch.Tensor, repeats: int, iters: int) -> dict:
    """Median ms per fwd+bwd step of each layer and ratio = candidate / baseline."""
    step_ms(baseline, x, 2), step_ms(candidate, x, 2)  # warm up
    base, cand = [], []
    for _ in range(repeats):
        base.append(step_ms(baseline, x, iters))
        cand.append(step_ms(candidate, x, iters))
    b, c = statistics.median(base), statistics.median(cand)
    return {"ratio": round(c / b, 3), "baseline_ms": round(b, 2), "candidate_ms": round(c, 2)}


def parser(doc: str) -> argparse.ArgumentParser:
    """The layer benchmarks' options: --repeats (medians over) and --iters (steps per repeat)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--repeats", type=int, default=7)
    out.add_argument("--iters", type=int, default=5)
    return out


def parse_args(doc: str) -> argparse.Namespace:
    return parser(doc).parse_args()


def provenance(**packages: str) -> dict:
    """What produced a benchmark's numbers: forgetless version, git commit, code fingerprint, torch, threads, the
    machine (CPU model, cores, how it runs bf16) and the versions of `packages` (label -> distribution name) where
    installed."""
    from importlib.metadata import PackageNotFoundError, version

    import forgetless
    from forgetless.config import code_fingerprint, git_commit
    from forgetless.device import machine_text

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {"forgetless": forgetless.__version__, "git_commit": git_commit(), "code": code_fingerprint(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": machine_text(),
            **{label: installed(name) for label, name in packages.items()}}


def spread(values: list[float]) -> dict:
    """Median, quartiles (inclusive) and extremes of `values`, rounded to 0.1."""
    values = sorted(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {key: round(v, 1) for key, v in
            (("median", statistics.median(values)), ("q1", q1), ("q3", q3), ("min", values[0]), ("max", values[-1]))}
