"""The training loop shared by pretraining and adaptation.

AdamW (or another optimizer of forgetless.optim), linear warmup + cosine decay, gradient clipping, periodic evaluation, atomic
safetensors checkpoints with exact resume (model, optimizer, RNG and sampler state), and a
stop on a non-finite loss that keeps the last good checkpoint.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from forgetless import distributed
from forgetless.checkpoint import load_checkpoint, load_optimizer, optimizer_tensors, save_checkpoint
from forgetless.config import stable_hash
from forgetless.data.splits import Batch, Sampler
from forgetless.device import PRECISIONS, autocast, training_attention
from forgetless.errors import ForgetlessError
from forgetless.hooks import HookChain, StepHooks, module_hooks
from forgetless.optim import OPTIMIZERS, build_optimizer
from forgetless.progress import progress_task


@dataclass
class TrainConfig:
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=32, metadata={"help": "sequences per batch"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr as a fraction of the peak (cosine)"})
    warmup: int = field(default=50, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0 = off)"})
    eval_every: int = field(default=100, metadata={"help": "evaluate every N steps"})
    ckpt_every: int = field(default=100, metadata={"help": "checkpoint every N steps"})
    optimizer: str = field(default="adamw", metadata={
        "help": "adamw, muon, delta (delta-rule momentum), deep (MLP momentum) or l2reg (see forgetless.optim)"})
    optimizer_options: dict = field(default_factory=dict, metadata={
        "help": "options of the optimizer as JSON, e.g. '{\"erase\": 0.5}' for delta"})
    precision: str = field(default="fp32", metadata={
        "help": "fp32, bf16 (autocast), fp16 (autocast with loss scaling; CUDA only) or auto (bf16 where the "
                "hardware runs it natively: CUDA with bf16, a CPU with AVX-512 BF16 or AMX; else fp32)"})

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "ckpt_every"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ForgetlessError(f"lr must be positive, got {self.lr}")
        if self.warmup < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ForgetlessError("warmup, grad_clip and weight_decay must not be negative")
        if self.optimizer not in OPTIMIZERS:
            raise ForgetlessError(f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ForgetlessError(f"unknown precision {self.precision!r}; valid: auto, {', '.join(PRECISIONS)}")


@dataclass
class PretrainConfig(TrainConfig):
    seed: int = field(default=0, metadata={"help": "random seed of the base's initialisation and batches"})


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


class TrainingDiverged(ForgetlessError):
    pass


@dataclass
class History:
    loss: list = field(default_factory=list)   # [step, training LM loss]
    evals: list = field(default_factory=list)  # {"step": s, ...metrics}


LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]  # -> (total loss, LM loss)


def train(model: nn.Module, params: list[tuple[str, nn.Parameter]], sampler: Sampler, cfg: TrainConfig,
          loss_fn: LossFn, *, evaluate: Callable[[], dict] | None = None, ckpt_path: Path | None = None,
          run_config: dict | None = None, desc: str = "train", hooks: StepHooks | None = None,
          evaluate_at_end: bool = True) -> History:
    """Train `params` of `model` on batches from `sampler`, moved to the model's device; resume from
    `ckpt_path` when it exists and `run_config` matches. `evaluate` runs at step 0, every `eval_every`
    steps and at the end (unless `evaluate_at_end` is False: the caller scores the final model itself)."""
    if not params:
        raise ForgetlessError("nothing to train: the method selected no parameters (check target_modules)")
    if distributed.sharded(params) and (cfg.optimizer != "adamw" or cfg.precision == "fp16"):
        raise ForgetlessError(f"--fsdp runs with the adamw optimizer in fp32 or bf16 only, not {cfg.optimizer} in "
                              f"{cfg.precision}; choose those or drop --fsdp")
    run_config = run_config or {}
    device = params[0][1].device
    hooks = HookChain([hooks or StepHooks(), *module_hooks(model, params)])
    opt = hooks.make_optimizer(params, cfg) or build_optimizer(cfg.optimizer, params, cfg, model)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    history, start = History(), 0
    distributed.broadcast_parameters(params)
    frozen = frozen_versions(model, params)  # before a resume: what it loads counts as changed
    if ckpt_path is not None and Path(ckpt_path).exists():
        start, history = resume(model, opt, sampler, ckpt_path, run_config, hooks)
    elif evaluate is not None:
        history.evals.append({"step": 0, **evaluate()})

    def checkpoint(step: int):
        if ckpt_path is None:
            return
        optim, groups = optimizer_tensors(opt)
        tensors = {**{f"model.{k}": v for k, v in changed_state(model, frozen).items()}, **optim,
                   **{f"hooks.{k}": v for k, v in hooks.hook_state().items()},
                   "rng.torch": torch.get_rng_state(), "rng.sampler": sampler.get_state(),
                   **({"rng.cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})}
        meta = {"kind": "training", "step": step, "config_hash": stable_hash(run_config),
                "config": run_config, "optim_groups": groups, "history": asdict(history)}
        save_checkpoint(ckpt_path, distributed.full(tensors), meta)

    with progress_task(desc, total=cfg.steps, completed=start) as advance:
        for step in range(start, cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            model.train()
            batch, share = distributed.shard(sampler.next().to(device))  # this rank's rows of the global batch
            with autocast(device, cfg.precision), training_attention(model, device, cfg.precision, batch.x):
                loss, lm_loss = loss_fn(model, batch)
            if share != 1.0:  # the LM loss as this rank's part of the global batch's token mean
                loss = loss + (share - 1.0) * lm_loss
            lm_loss = distributed.average(lm_loss.detach() * share)  # the global batch's LM loss
            if not torch.isfinite(distributed.average(loss.detach())):
                where = f"the last good checkpoint (step {last_ckpt_step(step, cfg)}) is kept at {ckpt_path}" \
                    if ckpt_path is not None and Path(ckpt_path).exists() else "no checkpoint was written"
                raise TrainingDiverged(
                    f"{desc}: loss is {loss.item()} at step {step + 1}; stopped, {where}; lower the learning rate")
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            distributed.average_gradients(params)
            scaler.unscale_(opt)
            if cfg.grad_clip > 0:
                distributed.clip_grad_norm([p for _, p in params], cfg.grad_clip)
            done = step + 1
            hooks.before_step(model, opt, done, done == cfg.steps)
            scaler.step(opt)
            scaler.update()
            hooks.after_step(model, opt, done, done == cfg.steps)
            opt.zero_grad(set_to_none=True)  # the gradients go before the next forward: not alive beside its activations
            history.loss.append([done, round(lm_loss.item(), 5)])
            if evaluate is not None and (done == cfg.steps and evaluate_at_end or
                                         done < cfg.steps and done % cfg.eval_every == 0):
                history.evals.append({"step": done, **evaluate()})
            if done % cfg.ckpt_every == 0 or done == cfg.steps:
                checkpoint(done)
            advance(1, loss=lm_loss.item())
    return history


def frozen_versions(model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> dict[str, tuple] | None:
    """{state_dict key: (storage, in-place version)} of the model's parameters that are not trained (a frozen base);
    None under FSDP (its checkpoints hold the whole state)."""
    if distributed.sharded(params):
        return None
    trained = {id(p) for _, p in params}
    return {k: (v.data_ptr(), v._version) for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, nn.Parameter) and id(v) not in trained}


def changed_state(model: nn.Module, frozen: dict[str, tuple] | None) -> dict[str, torch.Tensor]:
    """What a training checkpoint keeps of the model: its state without the frozen parameters that are as they were
    at the start (`frozen_versions`): the trained parameters, buffers, and any frozen one changed in place or
    replaced since (so a LoRA checkpoint is its adapters, never a copy of the base). The whole state when `frozen`
    is None."""
    state = model.state_dict()
    if frozen is None:
        return state
    now = model.state_dict(keep_vars=True)
    return {k: v for k, v in state.items() if k not in frozen or frozen[k] != (now[k].data_ptr(), now[k]._version)}


def steps_for_seconds(seconds: float, model: nn.Module, sampler, cfg: TrainConfig, loss_fn: LossFn,
                      probe_steps: int = 10, warmup_steps: int = 2) -> int:
    """Training steps of `model` that fill `seconds` of process CPU time, timed on throwaway copies of the
    model and sampler after `warmup_steps` untimed ones (the first steps allocate and run slower)."""
    probe, probe_sampler = copy.deepcopy(model), copy.deepcopy(sampler)

    def run(steps: int):
        train(probe, list(probe.named_parameters()), probe_sampler, replace(cfg, steps=steps), loss_fn,
              desc="step timing")

    run(warmup_steps)
    t0 = time.process_time()
    run(probe_steps)
    return max(1, round(seconds * probe_steps / (time.process_time() - t0)))


def last_ckpt_step(step: int, cfg: TrainConfig) -> int:
    return (step // cfg.ckpt_every) * cfg.ckpt_every


def resume(model, opt, sampler, ckpt_path, run_config, hooks: StepHooks) -> tuple[int, History]:
    tensors, meta = load_checkpoint(ckpt_path)
    if meta.get("config_hash") != stable_hash(run_config):
        diff = config_diff(meta.get("config", {}), run_config)
        raise ForgetlessError(
            f"checkpoint {ckpt_path} was written with a different config ({diff}); "
            "use a new output directory, or run again with the same config")
    own = model.state_dict()  # under FSDP, each rank's shards
    saved = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    unknown = sorted(set(saved) - set(own))
    if unknown:
        raise ForgetlessError(f"checkpoint {ckpt_path} holds tensors this model lacks ({', '.join(unknown[:3])}); use a "
                              "new output directory, or run again with the same model and method")
    # the frozen parameters it leaves out are the model's own, as at the start of the run (`changed_state`)
    model.load_state_dict({k: distributed.shard_as(v, own.get(k)) for k, v in saved.items()}, strict=False)
    load_optimizer(opt, tensors, meta["optim_groups"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], next(model.parameters()).device)
    sampler.set_state(tensors["rng.sampler"])
    hooks.load_hook_state({k[len("hooks."):]: v for k, v in tensors.items() if k.startswith("hooks.")})
    return meta["step"], History(**meta["history"])


def config_diff(old: dict, new: dict, prefix: str = "") -> str:
    """First few differing keys, e.g. 'train.lr: 0.001 -> 0.0003'."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = config_diff(a, b, f"{prefix}{key}.")
            if sub:
                out.append(sub)
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return "; ".join(out[:3])
