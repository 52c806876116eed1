"""The method interface carries both kinds of method without special cases."""
import dataclasses
from dataclasses import dataclass, field

from forgetless.continual.two_domain import run_two_domain
from forgetless.methods import METHODS, MethodConfig
from forgetless.methods.base import Method, find_modules
from forgetless.models.gpt import FFN_KINDS, DenseFFN, FFNKind
from forgetless.presets import build_config


class NarrowFFN(DenseFFN):
    """A stand-in for an architecture-changing FFN (APN, CMS): hidden width d instead of 4d."""

    def __init__(self, cfg):
        super().__init__(type(cfg)(**{**cfg.to_dict(), "ffn": "dense", "ffn_mult": 1}))


@dataclass
class NarrowConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=lambda: ["mlp"])


class NarrowMethod(Method):
    name = "narrow"
    Config = NarrowConfig

    def base_config(self, model_cfg):
        return dataclasses.replace(model_cfg, ffn="narrow")

    def trainable_parameters(self, model):
        return [(f"{n}.{k}", p) for n, m in find_modules(model, self.cfg.target_modules, []) for k, p in m.named_parameters()]


def test_architecture_changing_method_gets_its_own_base(tmp_path, monkeypatch):
    monkeypatch.setitem(FFN_KINDS, "narrow", FFNKind(NarrowFFN))
    monkeypatch.setitem(METHODS, "narrow", NarrowMethod)
    cfg = build_config("smoke", {"data": {"domain_a": "tinyshakespeare", "domain_b": "renamed:tinyshakespeare"},
                                 "adapt": {"lr": 3e-3}})  # the smoke lr barely moves a 10-step MLP-only arm
    results = run_two_domain(cfg, ["full", "narrow"], [0], tmp_path, "smoke")
    assert set(results["bases"]) == {"dense", "narrow"}
    full, narrow = results["methods"]["full"], results["methods"]["narrow"]
    assert narrow["total_params"] < full["total_params"]
    assert narrow["ppl_a_before"]["mean"] != full["ppl_a_before"]["mean"]  # a different base
    assert narrow["ppl_b_after"]["mean"] < narrow["ppl_b_before"]["mean"]
