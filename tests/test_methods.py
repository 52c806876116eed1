import pytest
import torch

from forgetless.checkpoint import load_checkpoint, save_checkpoint
from forgetless.errors import ForgetlessError
from forgetless.methods import METHODS, build_method, method_names
from forgetless.methods.base import find_modules, matches
from forgetless.models.gpt import logits_of
from tiny_models import hf_gpt2, ours

BASELINES = ["full", "ffn", "lora", "adapter"]



def test_registry_has_the_baselines_in_design_order():
    assert method_names()[:4] == BASELINES and set(BASELINES) <= set(METHODS)
    with pytest.raises(ForgetlessError, match="unknown method 'nope'; valid: .*lora"):
        build_method("nope")
    with pytest.raises(ForgetlessError, match="unknown config key methods.lora.rank; valid keys"):
        build_method("lora", {"rank": 4})
    with pytest.raises(ForgetlessError, match="methods.lora.r must be positive"):
        build_method("lora", {"r": 0})
    with pytest.raises(ForgetlessError, match="methods.lora.r: cannot read 'x' as int"):
        build_method("lora", {"r": "x"})
    # values from the command line arrive as strings and are read as the field's type
    assert build_method("lora", {"lr": "0.01", "r": "4"}).cfg.lr == 0.01
    assert build_method("lora", {"lr": "none"}).cfg.lr is None
    assert build_method("adapter", {"target_modules": "mlp,c_fc"}).cfg.target_modules == ["mlp", "c_fc"]


def test_target_rules_suffix_regex_exclude():
    assert matches("transformer.h.0.mlp.c_fc", ["c_fc"]) and not matches("transformer.h.0.mlp.c_fc", ["fc"])
    assert matches("transformer.h.1.mlp", [r"transformer\.h\.1\.mlp"])
    assert not matches("transformer.h.0.mlp", [r"transformer\.h\.1\.mlp"])
    found = find_modules(ours(), ["c_proj"], [r".*attn.*"])
    assert [n for n, _ in found] == ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]
    with pytest.raises(ForgetlessError, match="match no module of GPT"):
        find_modules(ours(), ["nothing"], [])


@pytest.mark.parametrize("make", [ours, hf_gpt2], ids=["ours", "hf-gpt2"])
@pytest.mark.parametrize("name", BASELINES)
def test_attach_keeps_function_and_trains_only_its_parameters(make, name):
    model = make().eval()
    x = torch.randint(0, 256, (2, 12))
    before = logits_of(model, x)
    method = build_method(name)
    model = method.attach(model).eval()
    assert torch.allclose(logits_of(model, x), before, atol=1e-6)  # new weights start neutral
    params = method.trainable_parameters(model)
    n_train, n_total = sum(p.numel() for _, p in params), sum(p.numel() for p in model.parameters())
    assert 0 < n_train <= n_total
    if name == "full":
        assert n_train == n_total
    else:
        assert n_train < n_total
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in params:
        p.requires_grad_(True)
    logits_of(model, x).sum().backward()
    assert all(p.grad is not None for _, p in params)


@pytest.mark.parametrize("name", BASELINES)
def test_method_state_roundtrip(tmp_path, name):
    method = build_method(name)
    model = method.attach(ours())
    with torch.no_grad():
        for _, p in method.trainable_parameters(model):
            p.add_(torch.randn_like(p))
    x = torch.randint(0, 256, (1, 8))
    expected = model.eval()(x)
    save_checkpoint(tmp_path / "m.safetensors", method.state_dict(model), {"kind": "method"})
    fresh = build_method(name)
    other = fresh.attach(ours())
    tensors, _ = load_checkpoint(tmp_path / "m.safetensors")
    fresh.load_state_dict(other, tensors)
    assert torch.allclose(other.eval()(x), expected, atol=1e-6)


def test_lora_uses_peft_layers_and_rank():
    method = build_method("lora", {"r": 4})
    model = method.attach(ours())
    from peft.tuners.lora import LoraLayer
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 2 * 4  # per block: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    names = [n for n, _ in method.trainable_parameters(model)]
    assert all("lora_A" in n or "lora_B" in n for n in names)
    a = dict(method.trainable_parameters(model))["transformer.h.0.mlp.c_fc.lora_A.default.weight"]
    assert a.shape == (4, 32)


def test_method_specs_make_labelled_arms():
    from forgetless.methods.base import parse_method_specs
    assert parse_method_specs("full, lora[r=16;alpha=32],apn[local=true]") == [
        ("full", "full", {}), ("lora[r=16;alpha=32]", "lora", {"r": "16", "alpha": "32"}),
        ("apn[local=true]", "apn", {"local": "true"})]
    with pytest.raises(ForgetlessError, match="write NAME\\[OPTION=VALUE;...\\]"):
        parse_method_specs("lora[r]")
