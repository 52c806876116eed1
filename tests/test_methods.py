import pytest

from forgetless import attach
from forgetless.errors import ForgetlessError
from forgetless.methods import METHODS, build_method, method_names
from forgetless.methods.base import find_modules, matches
from forgetless.presets import AdaptConfig
from forgetless.train import TrainConfig
from tiny_models import ours

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


def test_a_method_sets_its_own_lr_mix_and_optimizer_over_the_protocols():
    adapt = AdaptConfig(lr=3e-4, mix=0.1, optimizer="adamw")
    assert build_method("lora", {"lr": "none"}).training_config(adapt) == adapt  # nothing of its own
    own = build_method("lora", {"lr": "1e-3", "mix": "0", "optimizer": "muon"}).training_config(adapt)
    assert (own.lr, own.mix, own.optimizer) == (1e-3, 0.0, "muon")  # mix 0 is an option, not "unset"
    assert build_method("full", {"mix": "0.3"}).own("mix", 0.1) == 0.3
    train_cfg = build_method("full", {"lr": "1e-3", "mix": "0.3"}).training_config(TrainConfig(lr=3e-4))
    assert train_cfg.lr == 1e-3 and not hasattr(train_cfg, "mix")  # a TrainConfig has no mix to set


def test_target_rules_suffix_regex_exclude():
    assert matches("transformer.h.0.mlp.c_fc", ["c_fc"]) and not matches("transformer.h.0.mlp.c_fc", ["fc"])
    assert matches("transformer.h.1.mlp", [r"transformer\.h\.1\.mlp"])
    assert not matches("transformer.h.0.mlp", [r"transformer\.h\.1\.mlp"])
    found = find_modules(ours(), ["c_proj"], [r".*attn.*"])
    assert [n for n, _ in found] == ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]
    with pytest.raises(ForgetlessError, match="match no module of GPT"):
        find_modules(ours(), ["nothing"], [])


def test_lora_uses_peft_layers_and_rank():
    adapted = attach(ours(), "lora", r=4)
    from peft.tuners.lora import LoraLayer
    layers = [m for m in adapted.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 2 * 4  # per block: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    names = [n for n, _ in adapted.trainable_parameters()]
    assert all("lora_A" in n or "lora_B" in n for n in names)
    a = dict(adapted.trainable_parameters())["transformer.h.0.mlp.c_fc.lora_A.default.weight"]
    assert a.shape == (4, 32)


def test_method_specs_make_labelled_arms():
    from forgetless.methods.base import MethodSpec, parse_method_specs
    assert parse_method_specs("full, lora[r=16;alpha=32],apn[local=true]") == [
        MethodSpec("full", {}, "full"), MethodSpec("lora", {"r": "16", "alpha": "32"}, "lora[r=16;alpha=32]"),
        MethodSpec("apn", {"local": "true"}, "apn[local=true]")]
    assert MethodSpec("lora", {"r": 16}).label == "lora[r=16]" and MethodSpec("full").label == "full"
    assert MethodSpec("lora", {"r": 16}).build({"r": 4, "alpha": 8}).cfg.r == 16  # the spec wins over defaults
    with pytest.raises(ForgetlessError, match="write NAME\\[OPTION=VALUE;...\\]"):
        parse_method_specs("lora[r]")
    with pytest.raises(ForgetlessError, match="separated by ';'"):  # a comma would end up inside r's value
        parse_method_specs("lora[r=16,lr=3e-4]")
