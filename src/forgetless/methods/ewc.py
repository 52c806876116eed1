"""EWC (elastic weight consolidation): every weight trains, pulled back towards what it was on
the domains learned before by a diagonal-Fisher quadratic penalty.

    penalty = lam / 2 * sum_j F_j (theta_j - theta*_j)^2

F is the empirical Fisher (squared per-sequence gradients of the LM loss, averaged) on
`fisher_samples` windows of the learned domain's training split; in a task sequence the Fisher
of each finished task is added (online EWC) and theta* moves to the current weights.

Source: Kirkpatrick et al., Overcoming catastrophic forgetting in neural networks (PNAS 2017).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.errors import ForgetlessError
from forgetless.methods.base import Method, MethodConfig, register_method
from forgetless.progress import progress_task
from forgetless.models.gpt import logits_of


@dataclass
class EWCConfig(MethodConfig):
    lam: float = field(default=1e4, metadata={
        "help": "penalty strength lambda (the knee of a one-seed sweep on the quick two-domain pair; its "
                "frontier's validation windows chose 1e3 there, docs/RESULTS.md)"})
    fisher_samples: int = field(default=64, metadata={"help": "windows of the learned domain for the Fisher"})

    def __post_init__(self):
        super().__post_init__()
        if self.lam < 0 or self.fisher_samples <= 0:
            raise ForgetlessError("ewc: lam must not be negative and fisher_samples must be positive")


@register_method("ewc")
class EWC(Method):
    """Full fine-tuning plus a diagonal-Fisher penalty towards the weights of the learned domains."""
    Config = EWCConfig

    needs_previous = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.fisher: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}

    def trainable_parameters(self, model):
        return list(model.named_parameters())

    def remember(self, model, data):
        """Add the Fisher of `data` (a Domain, or (N, T+1) token windows) at the current weights and
        anchor the penalty there."""
        params = dict(model.named_parameters())
        windows = data if torch.is_tensor(data) else random_windows(data.train, data.windows.shape[1] - 1,
                                                                      self.cfg.fisher_samples)
        fisher = empirical_fisher(model, windows[:self.cfg.fisher_samples])
        for name, f in fisher.items():
            self.fisher[name] = self.fisher.get(name, 0) + f
        self.anchor = {name: params[name].detach().clone() for name in fisher}

    def extra_loss(self, model, batch):
        if not self.fisher or self.cfg.lam == 0:
            return None
        params = dict(model.named_parameters())
        penalty = sum((f * (params[n] - self.anchor[n]).square()).sum() for n, f in self.fisher.items())
        return 0.5 * self.cfg.lam * penalty

    def hook_state(self):
        return {**{f"fisher.{n}": f for n, f in self.fisher.items()}, **{f"anchor.{n}": a for n, a in self.anchor.items()}}

    def load_hook_state(self, tensors):
        self.fisher = {k[len("fisher."):]: v for k, v in tensors.items() if k.startswith("fisher.")}
        self.anchor = {k[len("anchor."):]: v for k, v in tensors.items() if k.startswith("anchor.")}


def random_windows(tokens: torch.Tensor, block_size: int, samples: int, seed: int = 0) -> torch.Tensor:
    """`samples` windows (samples, block_size + 1) at random positions of a token stream."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - block_size - 1, (samples,), generator=g).tolist()
    return torch.stack([tokens[s:s + block_size + 1] for s in starts])


def empirical_fisher(model, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean over `windows` (N, T+1) of the squared gradient of each window's LM loss."""
    params = {n: p for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in params.items()}
    for p in params.values():
        p.requires_grad_(True)
    was_training = model.training
    model.eval()
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    device = next(iter(params.values())).device
    with progress_task("EWC Fisher (windows)", len(windows)) as advance:  # minutes on a 100M+ model on a CPU
        for window in windows.to(device):
            window = window[None]                                              # (1, T+1)
            loss = F.cross_entropy(logits_of(model, window[:, :-1]).flatten(0, 1), window[0, 1:])
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (n, _), grad in zip(params.items(), grads):
                if grad is not None:
                    fisher[n] += grad.square() / len(windows)
            advance()
    model.train(was_training)
    for n, p in params.items():
        p.requires_grad_(flags[n])
    return fisher
