"""The APN arms and their continual knobs."""

import pytest
import torch

from forgetless import attach
from forgetless.data.splits import Sampler
from forgetless.methods import build_method
from forgetless.methods.apn import apn_modules
from forgetless.models.gpt import GPT, GPTConfig
from forgetless.train import TrainConfig, train

SMALL = {"n_patches": 32, "top_k": 1, "rank": 4}
DENSE = GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8)


def apn_model(method, seed=0):
    torch.manual_seed(seed)
    return GPT(method.base_config(DENSE))


def run(method, model, steps=6, **cfg):
    adapted = attach(model, method)
    adapted.start_task(1)
    sampler = Sampler(torch.arange(3000) % 11, 4, 8, seed=0)
    train(adapted.model, adapted.trainable_parameters(), sampler,
          TrainConfig(**{**dict(steps=steps, batch_size=4, lr=1e-2, warmup=1), **cfg}),
          lambda m, b: adapted.losses(b), hooks=method)
    return adapted.model


class ActiveTracker:
    """Wraps a method's attach and before_step to record every patch active in any step."""

    def __init__(self, method):
        self.seen = None
        inner, attach = method.before_step, method.attach

        def recording_attach(model):
            model = attach(model)
            for m in apn_modules(model):
                m.record = True
            return model
        method.attach = recording_attach

        def before_step(model, optimizer, step, last):
            masks = torch.stack([method.active(m) for m in apn_modules(model)])
            self.seen = masks if self.seen is None else self.seen | masks
            inner(model, optimizer, step, last)
        method.before_step = before_step


@pytest.mark.parametrize("local", [True, False])
def test_local_updates_leave_inactive_patches_bit_identical(local):
    method = build_method("apn", {"apn": SMALL, "local": local, "allocate": False})
    model = apn_model(method)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    tracker = ActiveTracker(method)
    run(method, model)
    never = ~tracker.seen                                                     # (layers, K)
    assert never.any()
    for layer, m in enumerate(apn_modules(model)):
        name = next(n for n, mod in model.named_modules() if mod is m)
        same = (m.decoders.detach() == start[f"{name}.decoders"]).flatten(1).all(1)   # (K,)
        if local:
            assert same[never[layer]].all()  # untouched, despite AdamW momentum and weight decay
            assert not same[tracker.seen[layer]].all()
        else:
            assert not same[never[layer]].all()  # the control: global updates move them too


def test_novelty_allocation_reseeds_least_used_patch_with_cooldown():
    method = build_method("apn", {"apn": SMALL, "allocate": True, "novelty_threshold": 1.1, "novelty_window": 2,
                                  "cooldown": 3, "decoders_only": True, "train_prototypes": False})
    model = apn_model(method)
    protos = [m.prototypes.detach().clone() for m in apn_modules(model)]
    model = run(method, model, steps=9)
    assert method.allocations == 3 * 2  # steps 2, 5 and 8 in each of 2 layers
    for m, before in zip(apn_modules(model), protos):
        changed = (m.prototypes.detach() != before).any(1).sum().item()
        assert 1 <= changed <= 3  # only re-seeded patches moved (prototypes do not train here)


def test_norm_cap_bounds_each_patch():
    method = build_method("apn", {"apn": SMALL, "norm_cap": 0.05})
    model = apn_model(method)
    start = [m.decoders.detach().clone() for m in apn_modules(model)]
    run(method, model, steps=5, lr=0.1)
    for m, s in zip(apn_modules(model), start):
        rel = (m.decoders.detach() - s).flatten(1).norm(dim=1) / s.flatten(1).norm(dim=1)
        assert rel.max() <= 0.05 + 1e-5 and rel.max() > 0.01


def test_gain_rule_clips_each_patch_gradient_and_uses_sgd():
    method = build_method("apn", {"apn": SMALL, "update_rule": "gain", "grad_cap": 1e-3})
    model = method.attach(apn_model(method))
    assert isinstance(method.make_optimizer(method.trainable_parameters(model), TrainConfig()), torch.optim.SGD)
    x = torch.randint(0, 256, (4, 8))
    model(x).square().mean().backward()
    method.before_step(model, None, 1, False)
    for m in apn_modules(model):
        norms = sum(p.grad.flatten(1).norm(dim=1) ** 2 for n, p in m.named_parameters()
                    if n in ("prototypes", "gate_a", "gate_b", "decoders")).sqrt()
        assert norms.max() <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize("rule", ["gain", "adamw"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("gate", ["router", "entropy"])
def test_gating_outside_the_range_freezes_patches(gate, top_k, rule):
    """No token passes the gate: nothing moves, not through the load-balancing loss (top_k >= 2 gives
    it a gradient) nor through AdamW's weight decay on zero gradients."""
    method = build_method("apn", {"apn": {**SMALL, "top_k": top_k, "balance": 1.0}, "gate_on": gate, "gate_min": 50.0,
                                  "update_rule": rule})
    model = apn_model(method)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run(method, model, steps=3)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_param_matched_base_within_five_percent():
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128)  # the quick preset's model
    base = GPT(build_method("apn-param-matched").base_config(cfg))
    dense = GPT(cfg)
    assert abs(base.num_params() / dense.num_params() - 1) < 0.05


def test_retrofit_starts_neutral_and_trains_only_apn():
    method = build_method("apn-retrofit", {"apn": SMALL})
    torch.manual_seed(0)
    model = GPT(method.base_config(DENSE)).eval()
    assert model.config.ffn == "dense"
    x = torch.randint(0, 256, (2, 8))
    before = model(x)
    adapted = attach(model, method)
    assert torch.equal(adapted(x), before)
    names = [n for n, _ in adapted.trainable_parameters()]
    assert names and all(".mlp.adapter." in n for n in names)


def test_dispatch_is_dense_only_for_a_transformers_retrofit_with_few_patches():
    """auto: dense beside a transformers model's MLPs when n_patches <= 4 top_k (a retrofit's few patches), sparse on
    forgetless's own bases and for many patches; the option overrides; both train the same weights."""
    from tiny_models import hf_llama

    def dense(model, **options):
        return {m.dense for m in apn_modules(attach(model, "apn-retrofit", **options).model)}
    many = {"apn": {"n_patches": 17}}
    assert dense(hf_llama()) == {True}  # K = 4 of top 4 at this size
    assert dense(hf_llama(), **many) == {False} and dense(hf_llama(), **many, dispatch="dense") == {True}
    assert dense(hf_llama(), dispatch="sparse") == {False}
    assert dense(GPT(DENSE), apn={"n_patches": 4}) == {False}
    trained = []
    for dispatch in ("sparse", "dense"):
        model = run(build_method("apn-retrofit", {"dispatch": dispatch}), hf_llama(), steps=3)
        trained.append(torch.cat([p.detach().flatten() for m in apn_modules(model) for p in m.parameters()]))
    assert not torch.equal(trained[0], torch.cat([p.detach().flatten() for m in apn_modules(
        attach(hf_llama(), "apn-retrofit").model) for p in m.parameters()]))  # they moved
    assert torch.allclose(trained[0], trained[1], atol=1e-5)


@pytest.mark.parametrize("options,message", [
    ({"update_rule": "sgd"}, "update_rule must be adamw or gain"), ({"gate_on": "loss"}, "gate_on must be none"),
    ({"dispatch": "fast"}, "dispatch must be auto, sparse or dense"),
    ({"norm_cap": -1}, "norm_cap >= 0"), ({"apn": {"rank": 0}}, "apn.rank must be positive")])
def test_bad_apn_method_options(options, message):
    from forgetless.errors import ForgetlessError
    with pytest.raises(ForgetlessError, match=message):
        build_method("apn", options)


def test_apn_arm_on_a_dense_model_is_refused():
    from forgetless.errors import ForgetlessError
    with pytest.raises(ForgetlessError, match="method apn needs a base with ffn=apn \\(this base: dense\\)"):
        attach(GPT(DENSE), "apn")
    matched = build_method("apn-param-matched")
    with pytest.raises(ForgetlessError, match="method apn-param-matched needs a base with n_patches="):
        attach(GPT(build_method("apn").base_config(DENSE)), matched)  # a K=256 base is not the matched one


@pytest.mark.parametrize("options, head_positions", [({}, 3), ({"gate_on": "router"}, 3), ({"gate_on": "entropy"}, 8)])
def test_answers_only_loss_runs_the_output_head_only_where_rows_are_scored(options, head_positions):
    """APN on a transformers model: the head runs at the 3 scored positions of 8, as LoRA's does, unless
    gate_on=entropy needs every position's predictive entropy (the routing regularizer covers all tokens)."""
    from forgetless.data.splits import Batch
    from tiny_models import hf_llama
    adapted = attach(hf_llama(), "apn-retrofit", **options)
    x = torch.randint(256, (2, 8))
    y = x.clone()
    y[:, :5] = -100  # the prompt: not scored
    positions = []  # the head's outputs' positions, over all its calls (forgetless.loss runs it in chunks)
    adapted.model.get_output_embeddings().register_forward_hook(lambda m, i, out: positions.append(out.shape[:-1].numel()))
    loss = adapted.loss(Batch(x, y, torch.zeros(2, dtype=torch.bool)))
    assert sum(positions) == 2 * head_positions and torch.isfinite(loss)


def test_live_stats_are_each_layers_patch_usage_and_a_composition_keeps_them():
    """What `forgetless serve`'s dashboard draws (the trait Method.live_stats): per APN layer, the share of a
    document's tokens routed to each patch (top_k 1: one patch a token, so a layer's shares sum to 1 in steps of
    1/tokens); `apn+distill` keeps the trait, a method without APN modules declares none."""
    windows = torch.arange(27).reshape(3, 9) % 11                             # (W, T+1): 24 tokens
    for name in ("apn", "apn+distill"):
        method = build_method(name, {"apn": SMALL})
        usage = method.live_stats(attach(apn_model(method), method).model, windows)["usage"]
        assert len(usage) == DENSE.n_layer and all(len(row) == SMALL["n_patches"] for row in usage), name
        for row in usage:
            assert sum(row) == pytest.approx(1) and all(24 * s == pytest.approx(round(24 * s)) for s in row), name
    assert build_method("lora").live_stats is None and build_method("lora+distill").live_stats is None
