"""Tiny models the method tests attach to: our GPT and a random Hugging Face GPT-2."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from forgetless.models.gpt import GPT, GPTConfig


def ours(d: int = 32, n_layer: int = 2):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, d_model=d, block_size=16))


def hf_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=256))
