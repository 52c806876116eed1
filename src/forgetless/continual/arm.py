"""One adaptation arm: a method on a pretrained base, trained on domain B, scored on A and B."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn

from forgetless.adapted import Adapted, attach
from forgetless.continual.evaluate import evaluate, module_stats
from forgetless.data.domains import Domain
from forgetless.data.splits import Sampler
from forgetless.device import autocast
from forgetless.methods import Method
from forgetless.monitor import PeakRSS
from forgetless.presets import AdaptConfig
from forgetless.train import train


def adapt_task(adapted: Adapted, task: Domain, replay_from: Domain, cfg: AdaptConfig, task_index: int,
               sampler_seed: int, learned: Domain | None = None, **train_kwargs):
    """One task of adaptation: start the task (what was `learned` last, default `replay_from`), the
    method's lr and optimizer, mixing of original-domain rows (the method's `mix`, else the protocol's),
    training, end of the task.

    Returns (training history, trained parameters)."""
    method = adapted.method
    adapted.start_task(task_index, learned or replay_from)
    params = adapted.trainable_parameters()
    cfg = method.training_config(cfg)
    sampler = Sampler(task.train, cfg.batch_size, task.windows.shape[1] - 1, sampler_seed,
                      other=replay_from.train if cfg.mix > 0 else None, p=cfg.mix)
    history = train(adapted.model, params, sampler, cfg, lambda m, batch: adapted.losses(batch), hooks=method,
                    **train_kwargs)
    adapted.end_task(task_index)
    return history, params


def score(model: nn.Module, a: Domain, b: Domain, dev: bool = False, precision: str = "fp32",
          same_as: dict | None = None) -> dict:
    """PPL and accuracy on A's and B's held-out windows (and module monitors on B) under `precision` (the
    training's); with `dev`, PPL on their validation windows too (ppl_a_dev, ppl_b_dev: what choices are made on).
    `same_as`: the scores of a model whose outputs are this one's bit for bit (the base before an exactly neutral
    attach): its PPL and accuracy are taken, only the monitors are computed."""
    if same_as is None:
        ea, eb = evaluate(model, a.windows, precision=precision), evaluate(model, b.windows, precision=precision)
        out = {"ppl_a": ea["ppl"], "acc_a": ea["acc"], "ppl_b": eb["ppl"], "acc_b": eb["acc"]}
    else:
        out = {k: same_as[k] for k in ("ppl_a", "acc_a", "ppl_b", "acc_b")}
    with autocast(next(model.parameters()).device, precision):
        out.update({f"{k}_b": v for k, v in module_stats(model, b.windows).items()})  # e.g. APN routing on B
    if dev and a.dev_windows is not None and b.dev_windows is not None:
        out.update(ppl_a_dev=evaluate(model, a.dev_windows, precision=precision)["ppl"],
                   ppl_b_dev=evaluate(model, b.dev_windows, precision=precision)["ppl"])
    return out


def run_arm(model: nn.Module, method: Method, a: Domain, b: Domain, cfg: AdaptConfig, seed: int,
            out_dir: Path | None = None, run_config: dict | None = None, before: dict | None = None,
            fsdp: bool = False) -> dict:
    """Attach `method` to `model` (a pretrained base, on its device), adapt on B, return the arm's metrics.

    `before` is `score(model, a, b)` when the caller has it (arms on one base share it). With `out_dir`,
    training checkpoints there (resumable) and the method is saved (save_pretrained) in `out_dir/seed<seed>/`.
    The last point of the curve is the final score (not computed twice), the first is `before` where attach changes
    no output (`Method.attach_rounding` 0; the monitors are computed). With `fsdp`, the model is
    sharded over the processes once the method is attached (Adapted.shard).
    """
    before = before or score(model, a, b, dev=True, precision=cfg.precision)
    torch.manual_seed(seed)
    adapted = attach(model, method)
    if fsdp:
        adapted.shard(cfg.precision)
    model = adapted.model
    report_before = method.report(model, a.windows, b.windows)
    eval_s, first = 0.0, before if method.attach_rounding == 0 else None  # step 0: the base's outputs, bit for bit

    def curve_point():
        nonlocal eval_s, first
        t = time.perf_counter()
        point, first = score(model, a, b, precision=cfg.precision, same_as=first), None
        eval_s += time.perf_counter() - t
        return point

    ckpt = out_dir / f"seed{seed}.training.safetensors" if out_dir else None
    with PeakRSS() as memory:
        t0 = time.perf_counter()
        history, params = adapt_task(adapted, b, a, cfg, 1, seed, evaluate=curve_point, ckpt_path=ckpt,
                                     run_config={**(run_config or {}), "arm": [method.name, seed]},
                                     desc=f"{method.name} seed {seed}", evaluate_at_end=False)
        wall = time.perf_counter() - t0 - eval_s
    after = score(model, a, b, dev=True, precision=cfg.precision)
    history.evals.append({"step": cfg.steps, **{k: v for k, v in after.items() if "_dev" not in k}})
    report_after = method.report(model, a.windows, b.windows)
    if out_dir:
        adapted.save_pretrained(out_dir / f"seed{seed}")
        ckpt.unlink(missing_ok=True)
    return {
        "method": method.name, "seed": seed,
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        "forgetting": after["ppl_a"] / before["ppl_a"] - 1,
        **({"forgetting_dev": after["ppl_a_dev"] / before["ppl_a_dev"] - 1} if "ppl_a_dev" in after else {}),
        "trainable_params": sum(p.numel() for _, p in params),
        "total_params": sum(p.numel() for p in model.parameters()),
        "wall_s": wall, "peak_rss_mb": memory.peak_mb,
        "curve": history.evals, "loss": history.loss,
        **({"report": {"before": report_before, "after": report_after}} if report_after else {}),
    }
