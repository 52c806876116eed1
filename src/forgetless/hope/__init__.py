"""HOPE experiments (`forgetless hope bench lm|needle`): the byte GPT, Titans memory without self-modification
and self-modifying HOPE at matched parameters, trained for the same CPU time.

    gpt           dense FFN, its width chosen so the model's parameters match HOPE's
    titans        FFN slot = Titans memory + CMS chain (nn/hope.py), the memory's projections fixed
    hope          the same slot with self-modifying projections (`self_modify=true`)
    hope-noattn   self-modifying HOPE with no attention: the memory is the block's only sequence mixer

Source: Nested Learning: The Illusion of Deep Learning Architectures (Behrouz, Razaviyayn, Zhong, Mirrokni).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from forgetless.loss import training_loss
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import TrainConfig, steps_for_seconds, train

HOPE_OPTIONS = {"titans": {}, "hope": {"self_modify": True}, "hope-noattn": {"self_modify": True, "attention": False}}
ARMS = ["gpt", *HOPE_OPTIONS]
SCAN_HELP = ("how the memories of the titans and hope arms run their chunks: parallel, or sequential (the form of "
             "the results before 2026-11-26): the same math, but sequential is slower, so the titans arm takes "
             "fewer steps in the CPU budget")

EXPERIMENTS = {
    "lm": ("forgetless.hope.lm", "byte-level language modelling: held-out PPL at equal parameters and CPU time"),
    "needle": ("forgetless.hope.needle", "key -> value pairs planted early in the context, queried late: "
                                         "recall accuracy against distance"),
}


def check_arms(arms: list[str]):
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ForgetlessError(f"unknown arm {unknown[0]!r}; valid: {', '.join(ARMS)}" if unknown else
                              f"give at least one arm of {', '.join(ARMS)}")


def arm_config(arm: str, model: GPTConfig) -> GPTConfig:
    """The model of one arm; `gpt`'s FFN width (an integer multiple of d_model) is the one whose parameter
    count is closest to the `titans` arm's."""
    if arm != "gpt":
        return dataclasses.replace(model, ffn="hope", ffn_options=HOPE_OPTIONS[arm])
    target = GPT(arm_config("titans", model)).num_params()
    return min((dataclasses.replace(model, ffn="dense", ffn_options={}, ffn_mult=m) for m in range(1, 33)),
               key=lambda c: abs(GPT(c).num_params() - target))


def arm_model(arm: str, model: GPTConfig, scan: str) -> GPT:
    """The arm's GPT (`arm_config`), its memories running their chunks by `scan` (nn/titans.py)."""
    from forgetless.nn.titans import NeuralMemory
    net = GPT(arm_config(arm, model))
    for m in net.modules():
        if isinstance(m, NeuralMemory):
            m.scan = scan
    return net


def train_for(model: GPT, sampler, cfg: TrainConfig, seconds: float, desc: str) -> dict:
    """Train every parameter of `model` for `seconds` of CPU time (steps set from a short timing; warmup at
    most a tenth of them, cosine to the end). Returns steps, CPU seconds and the loss curve against them."""
    steps = steps_for_seconds(seconds, model, sampler, cfg, training_loss)
    cfg = dataclasses.replace(cfg, steps=steps, warmup=min(cfg.warmup, steps // 10), ckpt_every=steps)
    t0 = time.process_time()
    history = train(model, list(model.named_parameters()), sampler, cfg, training_loss, desc=desc)
    cpu_s = time.process_time() - t0
    every = max(1, steps // 100)
    return {"steps": steps, "cpu_s": cpu_s,
            "loss_curve": {"cpu_s": [cpu_s * s / steps for s, _ in history.loss[::every]],
                           "loss": [v for _, v in history.loss[::every]]}}


def has_memory(model: torch.nn.Module) -> bool:
    from forgetless.nn.titans import NeuralMemory

    return any(isinstance(m, NeuralMemory) for m in model.modules())
