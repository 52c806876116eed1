import pytest
import torch

from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT, GPTConfig


def tiny(**kw):
    return GPT(GPTConfig(**{**dict(n_layer=2, n_head=2, d_model=32, block_size=16), **kw}))


def test_forward_shapes_and_gpt2_names():
    model = tiny(vocab_size=65)
    logits = model(torch.randint(0, 65, (3, 10)))
    assert logits.shape == (3, 10, 65)
    names = dict(model.named_modules())
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_proj"} <= set(names)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_causal():
    model = tiny().eval()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)


def test_context_too_long():
    with pytest.raises(ForgetlessError, match="exceeds the context length 16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("field,value,msg", [
    ("n_layer", 0, "model.n_layer must be positive"), ("d_model", -8, "model.d_model must be positive"),
    ("n_head", 3, "divisible by model.n_head"), ("dropout", 1.5, "dropout must be in"),
    ("ffn", "nope", "unknown FFN kind 'nope'; valid: apn, cms, dense")])
def test_bad_sizes(field, value, msg):
    with pytest.raises(ForgetlessError, match=msg):
        tiny(**{field: value})
