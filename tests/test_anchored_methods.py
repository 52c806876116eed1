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


def test_distill_is_kl_from_the_start_to_the_model_on_scored_tokens_only():
    """KL(p_start || p), not the reverse, averaged over the scored tokens of the mixed rows, through the
    training loss of a transformers model whose head skips unscored positions (labels -100)."""
    import torch.nn.functional as F
    from forgetless.models.gpt import logits_of
    adapted = attach(tiny("llama"), "distill")
    adapted.start_task(1)
    start = tiny("llama").eval()
    perturb(adapted.model)
    batch = mixed_batch()
    y = batch.y.clone()
    y[:, :5] = -100                                                     # a prompt: unscored, as with answers-only loss
    batch = Batch(batch.x, y, batch.from_other)
    adapted.train()
    total, lm = adapted.losses(batch)
    kl = (total - lm).item()
    with torch.no_grad():
        x = batch.x[batch.from_other]
        log_p0, log_p = (F.log_softmax(logits_of(m, x).float(), -1) for m in (start, adapted.model.eval()))
    forward = (log_p0.exp() * (log_p0 - log_p)).sum(-1)[:, 5:].mean().item()
    reverse = (log_p.exp() * (log_p - log_p0)).sum(-1)[:, 5:].mean().item()
    assert kl == pytest.approx(forward, rel=1e-4) and abs(forward - reverse) > 1e-3 * forward


def test_distill_teacher_survives_save_and_resume():
    adapted = attach(tiny("gpt"), "distill")
    adapted.start_task(1)
    perturb(adapted.model)
    fresh = build_method("distill")
    fresh.load_hook_state(adapted.method.hook_state())
    batch = mixed_batch()
    torch.testing.assert_close(fresh.extra_loss(adapted.model, batch), adapted.method.extra_loss(adapted.model, batch))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_ewc_distill_adds_the_fisher_penalty_and_the_kl_term(kind):
    previous = torch.randint(0, 256, (8, 13), generator=torch.Generator().manual_seed(1))
    methods = {}
    for spec in ("ewc-distill[lam=50;beta=2]", "ewc[lam=50]", "distill[beta=2]"):
        adapted = attach(tiny(kind), spec)
        adapted.start_task(1, previous=previous)
        perturb(adapted.model)
        methods[spec.split("[")[0]] = adapted
    batch = mixed_batch()
    both, ewc, kl = (m.method.extra_loss(m.model, batch) for m in methods.values())
    assert ewc.item() > 1e-4 and kl.item() > 1e-4
    torch.testing.assert_close(both, ewc + kl)
    fresh = build_method("ewc-distill", {"lam": 50, "beta": 2})
    fresh.load_hook_state(methods["ewc-distill"].method.hook_state())
    torch.testing.assert_close(fresh.extra_loss(methods["ewc-distill"].model, batch), both)


@pytest.mark.parametrize("name", ["distill", "ewc-distill"])
def test_distill_without_mixed_rows_is_refused(name):
    with pytest.raises(ForgetlessError, match="mix=0 leaves no rows"):
        build_method(name, {"mix": 0})


def test_ewc_distill_refuses_a_negative_penalty():
    with pytest.raises(ForgetlessError, match="lam must not be negative"):
        build_method("ewc-distill", {"lam": -1})
