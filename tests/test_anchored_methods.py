"""distill (KL to the task's starting model on mixed-in rows) and wise-ft (weights averaged with the
task's start): the terms do what their docstrings say, on our GPT and a tiny Llama."""
import pytest
import torch

from forgetless import attach
from forgetless.data.splits import Batch
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from tiny_models import tiny


def mixed_batch(rows: int = 4, mixed: int = 2, seed: int = 0) -> Batch:
    """(rows, 12) random tokens; the first `mixed` rows are original-domain rows."""
    w = torch.randint(0, 256, (rows, 13), generator=torch.Generator().manual_seed(seed))
    return Batch(w[:, :-1], w[:, 1:], torch.arange(rows) < mixed)


def perturb(model, scale: float = 0.05):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_distill_is_zero_at_the_start_and_pulls_back_towards_it(kind):
    adapted = attach(tiny(kind), "distill")
    adapted.start_task(1)
    method, batch = adapted.method, mixed_batch()
    assert method.extra_loss(adapted.model, batch).item() == pytest.approx(0.0, abs=1e-6)
    perturb(adapted.model)
    kl = method.extra_loss(adapted.model, batch)
    assert kl.item() > 1e-3
    opt = torch.optim.Adam(adapted.model.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        method.extra_loss(adapted.model, batch).backward()
        opt.step()
    assert method.extra_loss(adapted.model, batch).item() < 0.5 * kl.item()


def test_distill_counts_only_mixed_rows_and_scored_tokens():
    adapted = attach(tiny("gpt"), "distill[beta=2]")
    adapted.start_task(1)
    perturb(adapted.model)
    model, method, batch = adapted.model, adapted.method, mixed_batch()
    assert method.extra_loss(model, Batch(batch.x, batch.y, torch.zeros(4, dtype=torch.bool))) is None
    unscored = Batch(batch.x, torch.where(batch.from_other[:, None], -100, batch.y), batch.from_other)
    assert method.extra_loss(model, unscored).item() == 0.0
    only_mixed = Batch(batch.x[:2], batch.y[:2], batch.from_other[:2])
    torch.testing.assert_close(method.extra_loss(model, batch), method.extra_loss(model, only_mixed))
    half = attach(tiny("gpt"), "distill[beta=1]")
    half.start_task(1)
    perturb(half.model)
    torch.testing.assert_close(method.extra_loss(model, batch), 2 * half.method.extra_loss(half.model, batch))


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_wise_ft_keeps_weight_times_the_task_change(weight):
    adapted = attach(tiny("llama"), f"wise-ft[weight={weight}]")
    adapted.start_task(1)
    start = {n: p.detach().clone() for n, p in adapted.model.named_parameters()}
    perturb(adapted.model)
    trained = {n: p.detach().clone() for n, p in adapted.model.named_parameters()}
    adapted.end_task(1)
    for n, p in adapted.model.named_parameters():
        torch.testing.assert_close(p, start[n] + weight * (trained[n] - start[n]))


@pytest.mark.parametrize("spec, message", [("wise-ft", "weight must be in"), ("distill", "beta must not be")])
def test_bad_knobs_fail_in_one_line(spec, message):
    bad = {"wise-ft": {"weight": 1.5}, "distill": {"beta": -1}}[spec]
    with pytest.raises(ForgetlessError, match=message) as err:
        build_method(spec, bad)
    assert "\n" not in str(err.value)
