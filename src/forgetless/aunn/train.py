"""Training an AUNN on a data list: random large batches, strict serial order, or an anneal.

`batch`  every step B indices from a random permutation of [0, N) (each index once per epoch).
`serial` batch 1, indices in order, each once per epoch ("RNN-style").
`anneal` step t is serial with probability rising linearly from 0 to 1 over the run (a fixed
         schedule: about half the steps are serial, ever more of them towards the end).
Serial steps are placed so the last one lands on index N-1: the model ends "fresh off" the end of
the data, ready to predict the next index.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from forgetless.aunn.model import AUNN, AUNNConfig
from forgetless.errors import ForgetlessError
from forgetless.progress import progress_task

MODES = ("batch", "serial", "anneal")


@dataclass
class AUNNTrainConfig:
    mode: str = field(default="anneal", metadata={
        "help": "batch (random large batches), serial (batch 1 in order) or anneal (batch -> serial)"})
    steps: int = field(default=2000, metadata={"help": "optimizer steps (serial: epochs x N ends each epoch on the last index)"})
    batch_size: int = field(default=256, metadata={"help": "indices per random batch"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate (AdamW), kept for conditioning and generation"})
    warmup: int = field(default=100, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on matrices"})
    fast_lr_mult: float = field(default=10.0, metadata={"help": "lr multiplier of the memory units (model.fast_units)"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this (0 = off)"})
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the batch order"})

    def __post_init__(self):
        if self.mode not in MODES:
            raise ForgetlessError(f"unknown train.mode {self.mode!r}; valid: {', '.join(MODES)}")
        for name in ("steps", "batch_size"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"train.{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0 or self.fast_lr_mult <= 0:
            raise ForgetlessError("train.lr and train.fast_lr_mult must be positive")
        if self.warmup < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ForgetlessError("train.warmup, train.weight_decay and train.grad_clip must not be negative")


def build_learner(model_cfg: AUNNConfig, cfg: AUNNTrainConfig) -> Learner:
    """A fresh AUNN, initialised from `cfg.seed`, with its optimizer."""
    torch.manual_seed(cfg.seed)
    return Learner(AUNN(model_cfg), cfg)


class Learner:
    """An AUNN with its optimizer and the next free index: training, conditioning and generation
    are all `step`s on (index, datum) pairs."""

    def __init__(self, model: AUNN, cfg: AUNNTrainConfig, position: int = 0):
        self.model, self.cfg, self.position, self.steps_done = model, cfg, position, 0
        fast = {id(p) for p in model.fast_parameters()}
        slow = [p for p in model.parameters() if id(p) not in fast]
        groups = [{"params": [p for p in slow if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
                  {"params": [p for p in slow if p.dim() < 2], "weight_decay": 0.0, "lr_mult": 1.0},
                  {"params": model.fast_parameters(), "weight_decay": 0.0, "lr_mult": cfg.fast_lr_mult}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.99))

    def step(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the pairs (idx (B,), target (B,)); returns each pair's loss before it."""
        warm = min(1.0, (self.steps_done + 1) / self.cfg.warmup) if self.cfg.warmup else 1.0
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * group["lr_mult"] * warm
        self.model.train()
        losses = self.model.item_losses(idx, target)  # (B,)
        loss = losses.mean()
        if not torch.isfinite(loss):
            raise ForgetlessError(f"AUNN loss is {loss.item()} at step {self.steps_done + 1}; lower --train-lr")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.steps_done += 1
        return losses.detach()

    @torch.no_grad()
    def predict(self, idx: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, 256) logits or (B,) values
        self.model.eval()
        return self.model(idx)

    @torch.no_grad()
    def losses(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each pair's loss (B,) under the current weights, without a step."""
        self.model.eval()
        return self.model.item_losses(idx, target)

    def snapshot(self) -> dict:
        """Copies of the weights, the optimizer state and the position (cheap enough to take per example)."""
        return {"params": [p.detach().clone() for p in self.model.parameters()],
                "opt": {p: {k: v.clone() for k, v in s.items()} for p, s in self.opt.state.items()},
                "position": self.position, "steps_done": self.steps_done}

    def restore(self, snap: dict):
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), snap["params"]):
                p.copy_(saved)
        self.opt.state.clear()
        for p, s in snap["opt"].items():
            self.opt.state[p] = {k: v.clone() for k, v in s.items()}
        self.position, self.steps_done = snap["position"], snap["steps_done"]


def serial_steps(cfg: AUNNTrainConfig) -> int:
    return cfg.steps if cfg.mode == "serial" else cfg.steps // 2 if cfg.mode == "anneal" else 0


def is_serial(step: int, cfg: AUNNTrainConfig) -> bool:
    """Anneal: serial iff the cumulative serial share t^2 / 2T passes an integer at this step."""
    if cfg.mode != "anneal":
        return cfg.mode == "serial"
    T = cfg.steps
    return (step + 1) ** 2 // (2 * T) > step ** 2 // (2 * T)


def schedule(n: int, cfg: AUNNTrainConfig, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """The index batch of every step, (B,) int64, for data of length n."""
    if n <= 0:
        raise ForgetlessError("cannot train on empty data")
    pointer = -serial_steps(cfg) % n  # the last serial step lands on n - 1
    order, used = torch.empty(0, dtype=torch.int64), 0
    for step in range(cfg.steps):
        if is_serial(step, cfg):
            yield torch.tensor([pointer])
            pointer = (pointer + 1) % n
            continue
        if used >= len(order):
            order, used = torch.randperm(n, generator=generator), 0
        yield order[used:used + cfg.batch_size]
        used += cfg.batch_size


def fit(learner: Learner, data: torch.Tensor, desc: str = "aunn train") -> dict:
    """Train on `data` (N,) stored at indices 0..N-1 with `learner.cfg`; returns the loss curve
    (mean loss per stretch of steps, with the process CPU seconds spent so far)."""
    cfg = learner.cfg
    generator = torch.Generator().manual_seed(cfg.seed)
    every = max(1, cfg.steps // 200)
    curve: dict = {"step": [], "loss": [], "cpu_s": []}
    t0 = time.process_time()
    window: list[float] = []
    with progress_task(desc, total=cfg.steps) as advance:
        for step, idx in enumerate(schedule(len(data), cfg, generator)):
            window.append(learner.step(idx, data[idx]).mean().item())
            if (step + 1) % every == 0 or step + 1 == cfg.steps:
                curve["step"].append(step + 1)
                curve["loss"].append(sum(window) / len(window))
                curve["cpu_s"].append(time.process_time() - t0)
                advance(len(window), loss=curve["loss"][-1])
                window = []
    learner.position = max(learner.position, len(data))
    return curve
