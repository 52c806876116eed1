"""A new method is one file and no edit elsewhere: a file in a folder on `forgetless.methods.__path__`
registers itself, shows in the CLI, passes the attach contract, runs in a benchmark and draws its
own figure; what it declares (its traits) sets its lr on a pretrained model and its export form."""
import importlib
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import forgetless.methods
from forgetless.cli import app
from forgetless.continual.two_domain import run_two_domain
from forgetless.methods import METHODS, method_names
from forgetless.presets import build_config
from forgetless.report import write_report
from forgetless.report.diagnostics import DRAWERS
from test_contract import (attached, check_one_step, check_other_architecture, check_output_neutral,
                           check_pretrained_lr, check_reloaded, check_trainable, logits, save_and_reload, start,
                           train_step)

NAME, MODULE = "scaled-bias", "forgetless.methods.scaled_bias"
SOURCE = '''
"""scaled-bias: a learned per-channel bias (times a fixed `scale`) added after every MLP, starting at zero."""
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from forgetless.methods import Method, MethodConfig, register_method
from forgetless.methods.base import find_modules, replace_module
from forgetless.nn.adapter import input_width
from forgetless.report.diagnostics import draws
from forgetless.report.figures import plt, reported, save


class BiasAfter(nn.Module):
    def __init__(self, base: nn.Module, d: int, scale: float):
        super().__init__()
        self.base, self.scale = base, scale
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x, *args, **kwargs):
        return self.base(x, *args, **kwargs) + self.scale * self.shift


@dataclass
class ScaledBiasConfig(MethodConfig):
    target_modules: list[str] = field(default_factory=lambda: ["mlp"], metadata={"help": "modules to shift"})
    scale: float = field(default=1.0, metadata={"help": "factor on the learned bias"})
    lr: float | None = field(default=1e-2, metadata={"help": "learning rate"})


@register_method("scaled-bias")
class ScaledBias(Method):
    """A learned per-channel bias after every MLP, starting at zero."""
    Config = ScaledBiasConfig

    def attach(self, model):
        for name, module in find_modules(model, self.cfg.target_modules, self.cfg.exclude_modules):
            replace_module(model, name, BiasAfter(module, input_width(module), self.cfg.scale))
        return model

    def trainable_parameters(self, model):
        return [(n, p) for n, p in model.named_parameters() if n.endswith(".shift")]

    def report(self, model, windows_a, windows_b):
        return {"shift_norm": [m.shift.norm().item() for m in model.modules() if isinstance(m, BiasAfter)]}


@draws("scaled-bias")
def shift_norms(results, labels, folder):
    """The norm of every layer's shift after adaptation, one line per arm."""
    arms = reported(results, labels, "shift_norm")
    if not arms:
        return []
    fig, ax = plt.subplots(figsize=(4, 3))
    for label, report in arms.items():
        ax.plot(report["shift_norm"], marker="o", label=label)
    ax.set(xlabel="layer", ylabel="||shift||")
    ax.legend()
    save(fig, folder / "shift_norm.png")
    return [folder / "shift_norm.png"]
'''


EVERY_NAME, EVERY_MODULE = "every-weight", "forgetless.methods.every_weight"
EVERY_SOURCE = '''
"""every-weight: fine-tunes every weight of the model in place (nothing injected), like full."""
from forgetless.methods import Method, register_method
from forgetless.methods.base import ALL


@register_method("every-weight")
class EveryWeight(Method):
    """Every weight trains; nothing is injected."""
    trains, injects = ALL, False

    def trainable_parameters(self, model):
        return list(model.named_parameters())
'''


def install(folder, monkeypatch, name: str, module: str, source: str):
    """The method's file in `folder`, imported as `module`; the registries, the package path and its attribute
    are restored after the test (the fixture drops it from sys.modules)."""
    attribute = module.rsplit(".", 1)[1]
    folder.mkdir(exist_ok=True)
    (folder / f"{attribute}.py").write_text(source)
    assert name not in METHODS
    monkeypatch.setattr(forgetless.methods, "__path__", [*forgetless.methods.__path__, str(folder)])
    monkeypatch.setitem(METHODS, name, None)  # removed again after the test; the import registers the class
    monkeypatch.setitem(DRAWERS, name, [])  # likewise its figures
    monkeypatch.setattr(forgetless.methods, attribute, None, raising=False)  # likewise the import's attribute
    importlib.import_module(module)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """scaled_bias.py in a folder of its own, imported as forgetless.methods.scaled_bias."""
    install(tmp_path / "plugins", monkeypatch, NAME, MODULE, SOURCE)
    yield tmp_path / "plugins"
    sys.modules.pop(MODULE, None)


@pytest.fixture
def every_weight(tmp_path, monkeypatch):
    """every_weight.py in a folder of its own, imported as forgetless.methods.every_weight."""
    install(tmp_path / "plugins", monkeypatch, EVERY_NAME, EVERY_MODULE, EVERY_SOURCE)
    yield tmp_path / "plugins"
    sys.modules.pop(EVERY_MODULE, None)


def test_a_method_in_its_own_file_is_registered_and_listed(plugin, monkeypatch):
    from forgetless.cliutil import out_console
    assert METHODS[NAME].__module__ == MODULE
    assert method_names()[-1] == NAME  # after the methods of the design's table
    monkeypatch.setattr(out_console, "_width", 250)  # a wide terminal: options unfolded
    result = CliRunner().invoke(app, ["methods"])
    assert result.exit_code == 0, result.output
    assert NAME in result.output and "scale=1.0" in result.output


@pytest.mark.parametrize("kind", ["gpt", "gpt2"])
def test_a_method_in_its_own_file_passes_the_contract(plugin, kind, tmp_path):
    check_output_neutral(kind, NAME)
    check_trainable(kind, NAME, everything=False)
    check_one_step(kind, NAME)
    check_other_architecture(kind, NAME, tmp_path / "other")


def test_a_method_in_its_own_file_reloads_in_a_fresh_process(plugin, tmp_path):
    for result in save_and_reload(["gpt", "gpt2"], [NAME], tmp_path, plugins=(str(plugin),)).values():
        check_reloaded(*result)


def test_a_method_in_its_own_file_runs_in_a_benchmark_and_draws_its_figure(plugin, tmp_path):
    cfg = build_config("smoke", {"data": {"domain_a": "tinyshakespeare", "domain_b": "renamed:tinyshakespeare"}})
    results = run_two_domain(cfg, ["full", NAME], [0], tmp_path / "run", "smoke")
    arm = results["methods"][NAME]
    assert arm["ppl_b_after"]["mean"] != arm["ppl_b_before"]["mean"]  # its trained shifts reach the outputs
    assert 0 < arm["trainable_params"] < results["methods"]["full"]["trainable_params"]
    assert all(norm > 0 for norm in arm["report"]["after"]["shift_norm"])
    written = write_report(results, tmp_path / "report")
    figure = tmp_path / "report" / "shift_norm.png"
    assert figure in written and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_method_training_every_weight_gets_the_fine_tuning_lr_and_exports_merged(every_weight, tmp_path):
    """Declaring `trains = ALL` (and `injects = False`) is all it takes: the real presets start it at the
    fine-tuning lr, the contract finds every weight trainable and nothing to merge, and export writes the
    plain model, which transformers loads alone."""
    check_pretrained_lr([EVERY_NAME])
    check_trainable("llama", EVERY_NAME, everything=True)
    adapted = train_step(start(attached("llama", EVERY_NAME)))
    assert not adapted.injected()
    form, folder = adapted.export(tmp_path / "export")
    assert form == "merged"
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits, logits(adapted, ids))
