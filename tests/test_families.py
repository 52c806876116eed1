"""Every registered method on every common decoder family (issue 37, item 7): tiny random GPT-2, Llama, Qwen2,
Qwen3, Mistral, Gemma, Phi-3, GPT-NeoX, Falcon, OPT and Mixtral models. Each method attaches (the methods that go beside
or train the MLP find it from the model's structure: `ffn_blocks`), trains two AdamW steps through
`adapted.loss` on a batch with retained rows of old data, saves, and reloads onto a fresh base with the same
logits. The finder's own cases (a renamed MLP, OPT's fc1/fc2 span, no FFN at all) follow."""
import pytest
import torch
import torch.nn as nn
import transformers

import forgetless
from forgetless.data.splits import Batch
from forgetless.errors import ForgetlessError
from forgetless.methods.base import ffn_blocks, put_beside
from forgetless.nn.adapter import FFNSpan

V, T, L = 100, 8, 2  # vocabulary, tokens per window, layers
SMALL = dict(vocab_size=V, num_hidden_layers=L, hidden_size=16, num_attention_heads=2, max_position_embeddings=32,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
GQA = dict(SMALL, intermediate_size=32, num_key_value_heads=1)
FAMILIES = {  # family: (config class, its options)
    "gpt2": ("GPT2Config", dict(n_layer=L, n_head=2, n_embd=16, n_positions=32, vocab_size=V, bos_token_id=1,
                                eos_token_id=2)),
    "llama": ("LlamaConfig", GQA),
    "qwen2": ("Qwen2Config", GQA),
    "qwen3": ("Qwen3Config", dict(GQA, head_dim=8)),
    "mistral": ("MistralConfig", GQA),
    "gemma": ("GemmaConfig", dict(GQA, head_dim=8)),
    "phi3": ("Phi3Config", GQA),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, intermediate_size=32)),
    "falcon": ("FalconConfig", dict(SMALL, max_position_embeddings=None)),
    "opt": ("OPTConfig", dict(SMALL, ffn_dim=32, word_embed_proj_dim=16)),
    "mixtral": ("MixtralConfig", dict(GQA, num_local_experts=2, num_experts_per_tok=1)),  # experts: 3-D tensors
}
METHODS = forgetless.method_names()
SMALL_OPTIONS = {"apn": {"apn": {"n_patches": 8, "top_k": 2, "rank": 4}}}  # the apn arms: few small patches


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def build(family: str) -> nn.Module:
    """A fresh tiny random model of `family` (seeded: two calls give the same weights)."""
    name, options = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    cfg = getattr(transformers, name)(**{k: v for k, v in options.items() if v is not None})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def attach(model, method: str):
    options = SMALL_OPTIONS["apn"] if method.startswith("apn") else {}
    try:
        return forgetless.attach(model, method, **options)
    except ForgetlessError as e:  # a method that needs a forgetless GPT base of its own kind says so, and
        if "needs a forgetless GPT" in str(e) or "OSF wraps torch.nn.Linear layers only" in str(e):  # osf on Conv1D
            pytest.skip(str(e))
        raise


def windows(seed: int = 1) -> torch.Tensor:  # (4, T+1)
    return torch.randint(3, V, (4, T + 1), generator=torch.Generator().manual_seed(seed))


def batch() -> Batch:
    """Four windows, the last two retained rows of old data (so replay, KL and l1 terms act)."""
    w = windows()
    return Batch(w[:, :-1], w[:, 1:], torch.tensor([False, False, True, True]))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    return model(windows()[:, :-1]).logits


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_attaches_trains_and_reloads(family, method, tmp_path):
    model = build(family)
    before = logits(model)
    adapted = attach(model, method)
    adapted.start_task(1, previous=windows(seed=2) if adapted.method.needs_previous else None)
    opt = torch.optim.AdamW([p for _, p in adapted.trainable_parameters()], lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        adapted.train()
        loss = adapted.loss(batch())
        assert torch.isfinite(loss), loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = logits(adapted)
    assert not torch.allclose(trained, before), "two steps did not change the model's outputs"
    adapted.save_pretrained(tmp_path)
    again = forgetless.from_pretrained(build(family), tmp_path)
    torch.testing.assert_close(logits(again), trained, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_mlp_per_layer_is_found_from_the_structure(family):
    model = build(family)
    found = ffn_blocks(model)
    assert len(found) == L
    if family == "opt":  # fc1 -> activation -> fc2 sit on the layer: the FFN is their span
        assert [n for n, _ in found] == [f"model.decoder.layers.{i}" for i in range(L)]
        assert all(isinstance(m, FFNSpan) and [n for n, _ in m.named_children()] == ["fc1", "fc2"] for _, m in found)
    else:
        assert all(n.endswith(f".{i}.mlp") for i, (n, _) in enumerate(found)), found


def test_an_mlp_by_another_name_is_found_by_its_shape():
    """No per-family names: a one-input child of linears d -> ... -> d is the MLP, the attention is not."""
    model = build("llama")
    for layer in model.model.layers:
        layer.add_module("dense_block", layer.mlp)
        del layer.mlp
    assert [n for n, _ in ffn_blocks(model)] == [f"model.layers.{i}.dense_block" for i in range(L)]
    assert [n for n, _ in ffn_blocks(model, exclude=["layers.0.dense_block"])] == ["model.layers.1.dense_block"]


class Recorder(nn.Module):
    """Keeps its input and adds a constant: what is put beside the FFN sees, and where its output goes."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def forward(self, x):
        self.seen = x
        return torch.full_like(x, 0.5)


def test_beside_an_fc1_fc2_span_reads_the_ffn_input_and_adds_to_its_output():
    model = build("opt")
    layer = model.model.decoder.layers[0]
    fc1, fc2 = layer.fc1, layer.fc2
    seen = {}
    fc1.register_forward_hook(lambda m, args, out: seen.update(fc1_in=args[0]))
    fc2.register_forward_hook(lambda m, args, out: seen.update(fc2_out=out))
    name, span = ffn_blocks(model)[0]
    recorder = Recorder()
    put_beside(model, name, span, recorder)
    assert layer.fc1.base is fc1 and layer.fc2.base is fc2 and layer.fc2.adapter is recorder
    assert "model.decoder.layers.0.fc2.adapter" in dict(model.named_modules())
    layer.fc2.register_forward_hook(lambda m, args, out: seen.update(span_out=out))
    with torch.no_grad():
        model.eval()(windows()[:, :-1])
    assert recorder.seen.shape == (4, T, 16)  # the layer's (B, T, d), though OPT flattens it for fc1
    assert torch.equal(recorder.seen.flatten(0, 1), seen["fc1_in"])  # the FFN's input: final_layer_norm's output
    assert torch.equal(seen["span_out"], seen["fc2_out"] + 0.5)  # added to the FFN's output
    assert layer.fc1.x is None  # the kept activation is freed once used
    with pytest.raises(RuntimeError, match="ran before its first"):
        layer.fc2(torch.zeros(4 * T, 32))


def test_without_an_mlp_the_error_says_what_to_pass():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(2))
    model.head = nn.Linear(8, 8)
    with pytest.raises(ForgetlessError, match="found no MLP block .* pass target_modules"):
        ffn_blocks(model)
    with pytest.raises(ForgetlessError, match="target_modules"):
        forgetless.attach(model, "adapter")
    with pytest.raises(ForgetlessError, match="found no MLP block"):
        ffn_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
