"""One adaptation arm: a method on a pretrained base, trained on domain B, scored on A and B."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.nn as nn

from forgetless.checkpoint import save_checkpoint
from forgetless.continual.evaluate import evaluate, module_stats, training_loss
from forgetless.data.domains import Domain
from forgetless.data.splits import Sampler
from forgetless.methods import Method
from forgetless.monitor import PeakRSS
from forgetless.presets import AdaptConfig
from forgetless.train import train


def freeze_all_but(model: nn.Module, method: Method) -> list[tuple[str, nn.Parameter]]:
    for p in model.parameters():
        p.requires_grad_(False)
    params = method.trainable_parameters(model)
    for _, p in params:
        p.requires_grad_(True)
    return params


def adapt_task(model: nn.Module, method: Method, task: Domain, replay_from: Domain, cfg: AdaptConfig, seed: int,
               task_index: int, sampler_seed: int, learned: Domain | None = None, **train_kwargs):
    """One task of adaptation: task hooks, the method's parameters, its lr and optimizer, mixing of
    original-domain rows (the method's `mix`, else the protocol's replay), training. `learned` is the domain learned
    last (default: `replay_from`).

    Returns (training history, trained parameters)."""
    method.remember(model, learned or replay_from)
    method.on_task_start(model, task_index)
    params = freeze_all_but(model, method)
    mix = cfg.replay if method.cfg.mix is None else method.cfg.mix
    cfg = dataclasses.replace(cfg, lr=method.cfg.lr or cfg.lr, seed=seed, replay=mix,
                              optimizer=method.cfg.optimizer or cfg.optimizer)
    sampler = Sampler(task.train, cfg.batch_size, task.windows.shape[1] - 1, sampler_seed,
                      other=replay_from.train if mix > 0 else None, p=mix)
    history = train(model, params, sampler, cfg,
                    lambda m, batch: training_loss(m, batch, method.extra_loss, method.token_weights),
                    hooks=method, **train_kwargs)
    method.on_task_end(model, task_index)
    return history, params


def score(model: nn.Module, a: Domain, b: Domain) -> dict:
    ea, eb = evaluate(model, a.windows), evaluate(model, b.windows)
    stats = {f"{k}_b": v for k, v in module_stats(model, b.windows).items()}  # e.g. APN routing on B
    return {"ppl_a": ea["ppl"], "acc_a": ea["acc"], "ppl_b": eb["ppl"], "acc_b": eb["acc"], **stats}


def run_arm(model: nn.Module, method: Method, a: Domain, b: Domain, cfg: AdaptConfig, seed: int,
            out_dir: Path | None = None, run_config: dict | None = None) -> dict:
    """Attach `method` to `model` (a pretrained base), adapt on B, return the arm's metrics.

    With `out_dir`, training checkpoints there (resumable) and the method's own tensors are saved.
    """
    before = score(model, a, b)
    torch.manual_seed(seed)
    model = method.attach(model)
    report_before = method.report(model, a.windows, b.windows)
    eval_s = 0.0

    def curve_point():
        nonlocal eval_s
        t = time.perf_counter()
        point = score(model, a, b)
        eval_s += time.perf_counter() - t
        return point

    ckpt = out_dir / f"seed{seed}.training.safetensors" if out_dir else None
    with PeakRSS() as memory:
        t0 = time.perf_counter()
        history, params = adapt_task(model, method, b, a, cfg, seed, 1, seed, evaluate=curve_point, ckpt_path=ckpt,
                                     run_config={**(run_config or {}), "arm": [method.name, seed]},
                                     desc=f"{method.name} seed {seed}")
        wall = time.perf_counter() - t0 - eval_s
    after = score(model, a, b)
    report_after = method.report(model, a.windows, b.windows)
    if out_dir:
        save_checkpoint(out_dir / f"seed{seed}.safetensors", method.state_dict(model),
                        {"kind": "method", "method": method.name, "options": method.options(), "seed": seed})
        ckpt.unlink(missing_ok=True)
    return {
        "method": method.name, "seed": seed,
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        "forgetting": after["ppl_a"] / before["ppl_a"] - 1,
        "trainable_params": sum(p.numel() for _, p in params),
        "total_params": sum(p.numel() for p in model.parameters()),
        "wall_s": wall, "peak_rss_mb": memory.peak_mb,
        "curve": history.evals, "loss": history.loss,
        **({"report": {"before": report_before, "after": report_after}} if report_after else {}),
    }
