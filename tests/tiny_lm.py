"""A real small tokenizer (byte-level BPE trained on cl500 prompts, wrapped in PreTrainedTokenizerFast)
and tiny random Hugging Face causal LMs for the instruction tests; nothing is downloaded."""
import json
from functools import lru_cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from forgetless.data.instructions import cl500_root


class TinyTokenizer:
    """The interface forgetless's instruction code takes: encode, decode, eos_id, pad_id, bos_id."""

    def __init__(self, hf: PreTrainedTokenizerFast, bos: bool = True):
        self.hf = hf
        self.eos_id, self.pad_id = hf.eos_token_id, hf.pad_token_id
        self.bos_id = hf.bos_token_id if bos else None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


@lru_cache(maxsize=None)
def trained_bpe(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    lines = []
    for task in ("dbpedia", "agnews"):
        records = json.loads((cl500_root() / task / "train.json").read_text())[:150]
        lines += [r["prompt"] for r in records] + [r["answer"] for r in records]
        lines += json.loads((cl500_root() / task / "labels.json").read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_tokenizer(bos: bool = True) -> TinyTokenizer:
    return TinyTokenizer(trained_bpe(), bos)


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


def tiny_gpt2(vocab_size: int, seed: int = 0, n_positions: int = 1024) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=n_positions, vocab_size=vocab_size,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
