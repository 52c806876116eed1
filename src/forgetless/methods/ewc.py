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

from forgetless.data.splits import Batch
from forgetless.distributed import gathered, gradients, is_shard
from forgetless.errors import ForgetlessError
from forgetless.loss import training_loss
from forgetless.methods.base import ALL, Composed, MethodConfig, Term, register_method, register_term
from forgetless.methods.full import Full
from forgetless.progress import progress_task


PULL_SLICE = 1 << 20  # elements of p - a made at once in the penalty's backward


@dataclass
class EWCTermConfig:
    lam: float = field(default=1e4, metadata={
        "help": "penalty strength lambda (the knee of a one-seed sweep on the quick two-domain pair; its "
                "frontier's validation windows chose 1e3 there, docs/results/two-domain.md)"})
    fisher_samples: int = field(default=64, metadata={"help": "windows of the learned domain for the Fisher"})

    def __post_init__(self):
        if self.lam < 0 or self.fisher_samples <= 0:
            raise ForgetlessError("ewc: lam must not be negative and fisher_samples must be positive")
        if post := getattr(super(), "__post_init__", None):
            post()


@dataclass
class EWCConfig(EWCTermConfig, MethodConfig):
    pass


@register_term("ewc")
class EWCTerm(Term):
    """A diagonal-Fisher penalty pulling the trainable parameters back to where the task started."""
    Config = EWCTermConfig
    unshardable = ""
    needs_previous, copies, weight_penalty, prefix_once = True, 1, True, True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.fisher: dict[str, torch.Tensor] = {}  # over the trainable parameters, in their dtype

    def remember(self, method, model, data):
        """Add the Fisher of `data` (rows of old data: examples with input_ids and labels, (N, T+1) token
        windows, or a Domain) at the current weights; the penalty's anchor is the task's start (method.start)."""
        fisher = empirical_fisher(model, fisher_rows(data, self.cfg.fisher_samples), method.trainable_parameters(model))
        for name, f in fisher.items():
            self.fisher[name] = self.fisher.get(name, 0) + f

    def loss(self, method, model, batch):
        if not self.fisher or self.cfg.lam == 0:
            return None
        penalty = sum(pull(p, self.fisher[n], method.start[n]) for n, p in method.trainable_parameters(model)
                      if n in self.fisher)
        return 0.5 * self.cfg.lam * penalty

    def hook_state(self):
        return {f"fisher.{n}": f for n, f in self.fisher.items()}

    def load_hook_state(self, tensors):
        self.fisher = {k[len("fisher."):]: v for k, v in tensors.items() if k.startswith("fisher.")}


def pull(p: torch.Tensor, f: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Pull of one parameter, also under FSDP: a shard's summed over the ranks; a parameter FSDP holds gathered
    whole after the forward (the root module's, e.g. the embedding) against its gathered Fisher and anchor."""
    if is_shard(p) or not is_shard(f):
        return gathered(Pull.apply(p, f, a))
    return Pull.apply(p, gathered(f), gathered(a))


class Pull(torch.autograd.Function):
    """sum_j F_j (p_j - a_j)^2 of one parameter p, its Fisher F and anchor a; the backward computes
    2 F (p - a) again from them, so nothing of the size of p is kept from the forward to the backward
    (autograd's own graph would keep p - a and its square), and it makes one tensor of p's size, the gradient
    (p - a a slice at a time: autograd's makes four). Exactly autograd's gradient (tested)."""

    @staticmethod
    def forward(ctx, p, f, a):
        ctx.save_for_backward(p, f, a)
        return (f * (p - a).square()).sum()

    @staticmethod
    def backward(ctx, grad):
        p, f, a = ctx.saved_tensors
        out = f * grad                                   # autograd's (grad * f) * (2 * (p - a)), in place
        if is_shard(p) or not all(t.is_contiguous() for t in (out, p, a)):  # a DTensor's views do not write back
            return out.mul_((p - a).mul_(2)), None, None
        for o, x, y in zip(*(t.view(-1).split(PULL_SLICE) for t in (out, p, a))):
            o.mul_((x - y).mul_(2))
        return out, None, None


@register_method("ewc")
class EWC(Composed):
    """Full fine-tuning plus a diagonal-Fisher penalty towards the weights of the learned domains."""
    Config = EWCConfig
    order, trains, injects, takes_terms, copies, prefix_once = 90, ALL, False, False, 2, True
    unshardable = ""
    start_copies = ("start.",)  # copies of the weights at the task's start
    needs_previous = True

    def __init__(self, cfg):
        super().__init__(cfg, Full(cfg), [EWCTerm(cfg)])


def random_windows(tokens: torch.Tensor, block_size: int, samples: int, seed: int = 0) -> torch.Tensor:
    """`samples` windows (samples, block_size + 1) at random positions of a token stream."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - block_size - 1, (samples,), generator=g).tolist()
    return torch.stack([tokens[s:s + block_size + 1] for s in starts])


def fisher_rows(data, samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """At most `samples` (inputs (T,), targets (T,)) rows of `data`: the first windows of an (N, T+1) tensor,
    random windows of a Domain's training text, or a seeded random choice of examples (dicts with
    input_ids and optional labels, as forgetless.data.load gives; targets are the labels shifted by one)."""
    if torch.is_tensor(data):
        return [(w[:-1], w[1:]) for w in data[:samples]]
    if hasattr(data, "train") and hasattr(data, "windows"):  # a Domain
        return fisher_rows(random_windows(data.train, data.windows.shape[1] - 1, samples), samples)
    if not hasattr(data, "__len__") or not len(data):
        raise ForgetlessError(f"previous={type(data).__name__}: give rows of old data (examples with input_ids, "
                              "e.g. forgetless.data.load(old_file, tokenizer)) or (N, T+1) token windows")
    picks = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:samples].tolist()
    rows = []
    for i in sorted(picks):
        row = data[i]
        ids = torch.as_tensor(row["input_ids"])
        labels = torch.as_tensor(row["labels"]) if row.get("labels") is not None else ids
        rows.append((ids, torch.cat([labels[1:], labels.new_full((1,), -100)])))
    rows = [(x, y) for x, y in rows if (y != -100).any()]
    if not rows:
        raise ForgetlessError("previous: no row of old data has a scored token (every label is -100)")
    return rows


def empirical_fisher(model, rows: list[tuple[torch.Tensor, torch.Tensor]],
                     params: list[tuple[str, torch.nn.Parameter]] | None = None) -> dict[str, torch.Tensor]:
    """Mean over `rows` (inputs (T,), targets (T,), -100 not scored) of the squared gradient of each row's LM loss,
    for `params` (default: every parameter); accumulated in fp32, returned in each parameter's dtype."""
    params = dict(params if params is not None else model.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    for p in params.values():
        p.requires_grad_(True)
    was_training = model.training
    model.eval()
    for layer in model.modules():  # transformers checkpoints a layer only in training mode: its own flag on, dropout
        # off; not the reentrant variant, which cannot give the gradients of torch.autograd.grad
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) is True and not getattr(func, "keywords", {}).get(
                "use_reentrant", True):
            layer.training = True
    fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    device = next(iter(params.values())).device
    with progress_task("EWC Fisher (rows)", len(rows)) as advance:  # minutes on a 100M+ model on a CPU
        for x, y in rows:
            x, y = x.to(device)[None], y.to(device)[None]                      # (1, T), (1, T)
            _, loss = training_loss(model, Batch(x, y, torch.zeros(1, dtype=torch.bool, device=device)))  # the head in chunks
            grads = gradients(loss, list(params.values()))
            for (n, _), grad in zip(params.items(), grads):
                if grad is not None:
                    fisher[n] += grad.float().square() / len(rows)
            advance()
    model.train(was_training)
    for n, p in params.items():
        p.requires_grad_(flags[n])
    return {n: f.to(params[n].dtype) for n, f in fisher.items()}
