"""Tiny models the method tests attach to: our GPT, a random Hugging Face GPT-2 and a random Llama.
Every builder seeds torch, so two calls give the same weights (in another process too)."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from forgetless.models.gpt import GPT, GPTConfig


def ours(d: int = 32, n_layer: int = 2, method=None):
    """Our GPT; with a built `method`, the base it asks for (`method.base_config`, e.g. an APN GPT)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_head=2, d_model=d, block_size=16)
    return GPT(method.base_config(cfg) if method is not None else cfg)


def hf_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=256))


def hf_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                                        max_position_embeddings=32))


def tiny(kind: str, method=None):
    """A fresh tiny model of `kind` (gpt, gpt2, llama); for our GPT, the base `method` asks for."""
    if kind == "gpt":
        return ours(method=method)
    return {"gpt2": hf_gpt2, "llama": hf_llama}[kind]()
