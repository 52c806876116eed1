"""Continuum Memory System: one level is the dense FFN, levels move only on their period boundaries,
the two accumulations agree on SGD, resume is exact with half-gathered chunks, the cms arms."""
import dataclasses

import pytest
import torch

from forgetless import attach
from forgetless.hooks import StepHooks
from forgetless.loss import training_loss
from forgetless.data.splits import Sampler
from forgetless.errors import ForgetlessError
from forgetless.methods import build_method
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.nn.cms import Level
from forgetless.train import TrainConfig, train

TINY = dict(n_layer=2, n_head=2, d_model=16, block_size=8)


def gpt(**cms):
    torch.manual_seed(0)
    return GPT(GPTConfig(**TINY, ffn="cms", ffn_options=cms) if cms else GPTConfig(**TINY))


def run(model, steps=10, hooks=None, ckpt_path=None, loss_fn=training_loss, **kw):
    cfg = TrainConfig(**{**dict(steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=5, ckpt_every=3), **kw})
    sampler = Sampler(torch.arange(2000) % 7, 4, 8, seed=0)
    return train(model, list(model.named_parameters()), sampler, cfg, loss_fn, hooks=hooks, ckpt_path=ckpt_path)


def test_one_level_cms_is_the_dense_ffn_exactly():
    dense, cms = gpt(), gpt(periods=[1])
    x = torch.randint(0, 256, (3, 8))
    assert torch.equal(dense(x), cms(x))
    run(dense, steps=6)
    run(cms, steps=6)
    assert torch.equal(dense(x), cms(x))
    assert sum(p.numel() for p in dense.parameters()) == sum(p.numel() for p in cms.parameters())


class Recorder(StepHooks):
    def __init__(self, model):
        self.levels = [m for m in model.modules() if isinstance(m, Level)]
        self.last = [self.flat(m) for m in self.levels]
        self.moved = {}  # period -> steps at which a level of that period changed

    @staticmethod
    def flat(level):
        return torch.cat([p.detach().flatten() for p in level.parameters()]).clone()

    def after_step(self, model, optimizer, step, last):
        for i, level in enumerate(self.levels):
            now = self.flat(level)
            if not torch.equal(now, self.last[i]):
                self.moved.setdefault(level.update_period, set()).add(step)
            self.last[i] = now


@pytest.mark.parametrize("accumulate", ["grads", "updates"])
def test_levels_change_exactly_on_their_period_boundaries(accumulate):
    model = gpt(periods=[1, 2, 4], accumulate=accumulate)
    recorder = Recorder(model)
    run(model, steps=10, hooks=recorder)
    assert recorder.moved[1] == set(range(1, 11))
    assert recorder.moved[2] == {2, 4, 6, 8, 10}
    assert recorder.moved[4] == {4, 8, 10}          # 10: the end of training applies the cut-short chunk


def test_both_accumulations_are_the_sources_sum_of_updates_under_sgd():
    """Plain SGD at a constant lr: one step on the summed gradients = the sum of the per-step updates."""
    sgd = dict(optimizer="delta", optimizer_options={"alpha": 0.0, "erase": 0.0, "precondition": "none"},
               lr=0.05, warmup=0, min_lr_ratio=1.0, weight_decay=0.0, grad_clip=0.0)
    grads, updates = gpt(periods=[1, 3], accumulate="grads"), gpt(periods=[1, 3], accumulate="updates")
    run(grads, steps=6, **sgd)
    run(updates, steps=6, **sgd)
    for (name, a), b in zip(grads.named_parameters(), updates.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


@pytest.mark.parametrize("accumulate", ["grads", "updates"])
def test_resume_is_exact_with_half_gathered_chunks(accumulate, tmp_path):
    whole = gpt(periods=[1, 4], accumulate=accumulate)
    run(whole, steps=10)
    cut = gpt(periods=[1, 4], accumulate=accumulate)
    ckpt = tmp_path / "ckpt.safetensors"

    def stop_at_step_8(m, batch, calls=[0]):  # the checkpoint at step 6 holds steps 5-6 of a 4-step chunk
        calls[0] += 1
        if calls[0] == 8:
            raise KeyboardInterrupt
        return training_loss(m, batch)
    with pytest.raises(KeyboardInterrupt):
        run(cut, steps=10, ckpt_path=ckpt, loss_fn=stop_at_step_8)
    resumed = gpt(periods=[1, 4], accumulate=accumulate)
    run(resumed, steps=10, ckpt_path=ckpt)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_cms_arms_train_their_levels_and_report_how_far_each_moved():
    method = build_method("cms")
    model_cfg = method.base_config(GPTConfig(**TINY))
    assert model_cfg.ffn == "cms" and model_cfg.ffn_options["periods"] == [1, 4, 32, 128]
    dense_params = GPT(GPTConfig(**TINY)).num_params()
    assert abs(GPT(model_cfg).num_params() / dense_params - 1) < 0.05   # levels split the dense width

    adapted = attach(GPT(model_cfg), "cms-fast")
    fast, model = adapted.method, adapted.model
    trained = {n for n, _ in fast.trainable_parameters(model)}
    assert trained and all(".levels.0." in n or ".levels.1." in n for n in trained)  # periods 1 and 4
    assert trained < {n for n, _ in method.trainable_parameters(model)}
    train(model, adapted.trainable_parameters(), Sampler(torch.arange(2000) % 7, 4, 8, seed=0),
          TrainConfig(steps=8, batch_size=4, lr=1e-2), lambda m, batch: adapted.losses(batch), hooks=fast)
    change = dict(zip(*fast.report(model, None, None).values()))
    assert change[1] > 0 and change[4] > 0 and change[32] == 0 and change[128] == 0


def test_cms_errors_name_the_fix():
    with pytest.raises(ForgetlessError, match=r"method cms needs a base with ffn=cms \(this base: dense\)"):
        attach(GPT(GPTConfig(**TINY)), "cms")
    default_base = GPT(build_method("cms").base_config(GPTConfig(**TINY)))
    with pytest.raises(ForgetlessError, match=r"periods=\[1, 1, 1, 1\] \(this base: \[1, 4, 32, 128\]\)"):
        attach(default_base, "cms[periods=1,1,1,1]")  # the one-frequency control needs its own base
    with pytest.raises(ForgetlessError, match="cms.periods must be positive"):
        GPT(GPTConfig(**TINY, ffn="cms", ffn_options={"periods": [1, 0]}))
    with pytest.raises(ForgetlessError, match="cms.accumulate must be one of grads, updates"):
        build_method("cms", {"accumulate": "sum"})
    with pytest.raises(ForgetlessError, match="unknown config key cms.period; valid keys"):
        GPT(dataclasses.replace(GPTConfig(**TINY), ffn="cms", ffn_options={"period": [1]}))


def test_retrofit_widths_are_aligned_to_multiples_of_16():
    """Beside a transformers model the CMS levels' and the HOPE memory's widths, from retrofit_size, are rounded to
    the nearest multiple of 16 (narrower ones kept) and the slots stay near their parameter budget."""
    from tiny_models import hf_llama

    from forgetless.methods.cms import aligned
    from forgetless.nn.adapter import n_params
    from forgetless.nn.titans import NeuralMemory
    assert [aligned(w) for w in (5, 15, 16, 23, 24, 47, 234)] == [5, 15, 16, 16, 32, 48, 240]
    total = n_params(hf_llama())  # d = 32: the budget asks for levels of width 31
    cms = attach(hf_llama(), "cms", retrofit_size=0.5)
    assert {m.c_fc.out_features for m in cms.model.modules() if isinstance(m, Level)} == {32}
    hope = attach(hf_llama(), "hope", retrofit_size=0.5)
    assert {m.c_proj.in_features for m in hope.model.modules() if isinstance(m, NeuralMemory)} == {32}
    for adapted in (cms, hope):
        assert sum(p.numel() for _, p in adapted.trainable_parameters()) == pytest.approx(0.5 * total, rel=0.05)
