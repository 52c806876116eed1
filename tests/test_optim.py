"""Optimizers as associative memories: the equations, convergence on a convex quadratic, training the
smoke model, exact save/resume, option errors."""
import pytest
import torch
import torch.nn as nn

from forgetless.loss import training_loss
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.optim import OPTIMIZERS, DeepMomentum, DeltaMomentum, L2Regression, build_optimizer
from forgetless.train import TrainConfig, train

ALL = sorted(OPTIMIZERS)


def regression(seed=0):
    g = torch.Generator().manual_seed(seed)
    X, y = torch.randn(64, 8, generator=g), torch.randn(64, generator=g)
    return X, y


@pytest.mark.parametrize("name", ALL)
def test_decreases_a_convex_quadratic(name):
    X, y = regression()
    best = 0.5 * (X @ torch.linalg.lstsq(X, y).solution - y).square().mean().item()
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    opt = build_optimizer(name, list(model.named_parameters()), TrainConfig(lr=1e-2, weight_decay=0.0), model)
    losses = []
    for _ in range(400):
        loss = 0.5 * (model(X).squeeze(-1) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert losses[-1] - best < 0.25 * (losses[0] - best), (name, losses[0], losses[-1], best)


def setup(steps, optimizer, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8))
    sampler = Sampler(torch.arange(2000) % 7, 4, 8, seed=0)  # a learnable pattern
    cfg = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=5, ckpt_every=3, optimizer=optimizer, **kw)
    return model, sampler, cfg


@pytest.mark.parametrize("name", ALL)
def test_trains_the_smoke_model_without_nan(name):
    model, sampler, cfg = setup(40, name)
    history = train(model, list(model.named_parameters()), sampler, cfg, training_loss)
    losses = [v for _, v in history.loss]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ALL)
def test_state_survives_save_and_resume(name, tmp_path):
    model, sampler, cfg = setup(10, name)
    train(model, list(model.named_parameters()), sampler, cfg, training_loss)
    resumed, sampler2, _ = setup(10, name)
    ckpt = tmp_path / "ckpt.safetensors"

    def stop_at_step_8(m, batch, calls=[0]):
        calls[0] += 1
        if calls[0] == 8:
            raise KeyboardInterrupt
        return training_loss(m, batch)
    with pytest.raises(KeyboardInterrupt):
        train(resumed, list(resumed.named_parameters()), sampler2, cfg, stop_at_step_8, ckpt_path=ckpt)
    fresh, sampler3, _ = setup(10, name)  # a new process: new model, optimizer and sampler from the checkpoint
    train(fresh, list(fresh.named_parameters()), sampler3, cfg, training_loss, ckpt_path=ckpt)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n


def one_tensor(cls, **options):
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    return w, cls([w], lr=0.1, precondition="none", **options)


def step(w, opt, grad):
    w.grad = torch.tensor(grad)
    opt.step()


def test_delta_rule_momentum_equations():
    alpha = 0.9
    w, opt = one_tensor(DeltaMomentum, alpha=alpha, erase=1.0)
    g1, g2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    step(w, opt, g1.tolist())
    assert torch.allclose(w, torch.tensor([1.0, -2.0, 0.5]) - 0.1 * g1)   # empty memory: only the write
    before = w.detach().clone()
    step(w, opt, g2.tolist())
    g_hat = g2 / g2.norm()
    m2 = alpha * g1 - g_hat * (g_hat @ g1) + g2                             # (alpha I - g_hat g_hat^T) m + g
    assert torch.allclose(w, before - 0.1 * m2)


def test_delta_without_erase_is_heavy_ball_momentum():
    w, opt = one_tensor(DeltaMomentum, alpha=0.5, erase=0.0)
    step(w, opt, [1.0, 1.0, 1.0])
    step(w, opt, [3.0, 3.0, 3.0])
    assert torch.allclose(w, torch.tensor([1.0, -2.0, 0.5]) - 0.1 * 1.0 - 0.1 * (0.5 * 1.0 + 3.0))


def test_deep_momentum_starts_as_momentum_then_its_memory_learns():
    w, opt = one_tensor(DeepMomentum, alpha=0.9)
    step(w, opt, [1.0, -1.0, 2.0])
    assert torch.allclose(w, torch.tensor([1.0, -2.0, 0.5]) - 0.1 * torch.tensor([1.0, -1.0, 2.0]))
    state = opt.state[w]
    assert state["w2"].abs().sum() == 0
    step(w, opt, [1.0, -1.0, 2.0])        # the gradient agreed with the last update: the memory moves
    assert state["w2"].abs().sum() > 0


def test_l2_regression_erases_the_answer_to_the_input():
    """With one token, lr * erase = 1 and no gradient, W <- W (I - x_hat x_hat^T): W x = 0 after."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=False)
    opt = L2Regression([layer.weight], lr=1.0, erase=1.0, momentum=0.0, precondition="none").watch(layer)
    x = torch.randn(1, 4)
    layer(x)
    layer.weight.grad = torch.zeros_like(layer.weight)
    opt.step()
    assert torch.allclose(layer(x), torch.zeros(1, 3), atol=1e-6)


def test_muon_chain_takes_the_schedule_after_a_reload():
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=8))
    opt = build_optimizer("muon", list(model.named_parameters()), TrainConfig(lr=1e-3), model)
    kinds = [type(part).__name__ for part in opt.parts]
    assert kinds == ["Muon", "AdamW"]
    assert id(model.transformer.wte.weight) not in map(id, opt.parts[0].param_groups[0]["params"])  # embeddings: AdamW
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.5
    assert all(g["lr"] == 0.5 for part in opt.parts for g in part.param_groups)


def test_bad_optimizer_names_and_options():
    with pytest.raises(ForgetlessError, match="unknown optimizer 'adam'.*adamw"):
        TrainConfig(optimizer="adam")
    model = nn.Linear(2, 2)
    with pytest.raises(ForgetlessError, match="unknown option 'beta' of optimizer delta; valid: .*alpha"):
        build_optimizer("delta", list(model.named_parameters()), TrainConfig(optimizer_options={"beta": 1}))
    with pytest.raises(ForgetlessError, match="erase"):
        DeltaMomentum(model.parameters(), erase=2.0)
