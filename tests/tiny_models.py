"""Tiny models the tests attach to: our GPT, a random Hugging Face GPT-2 and Llama, and a Llama with a
byte-level BPE tokenizer to save as a transformers folder or write as a GGUF file. Every builder seeds
torch, so two calls give the same weights (in another process too)."""
import json

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from forgetless.models.gpt import GPT, GPTConfig

SENTENCES = ["The capital of France is Paris.", "O speak again, bright angel.", "Romeo and Juliet go to Verona.",
             "To be, or not to be: that is the question."]
EOS = "<|endoftext|>"


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


def bpe_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained on four sentences; token 0 is the end-of-text token, which
    also starts every text encoded with special tokens (as Llama's BOS does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def gguf_llama(vocab_size: int) -> LlamaForCausalLM:
    """2 layers, d 32, 4 query heads over 2 key/value heads (GQA), tied embeddings, like SmolLM2."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=2 ** -16, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)  # rms_norm_eps exact in float32, as GGUF stores it
    return LlamaForCausalLM(cfg).eval()


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_gguf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path, qtype=None):
    """Write `model` and `tokenizer` as llama.cpp's converter does: llama metadata, a gpt2 (byte-level BPE)
    tokenizer, q/k rows permuted to llama.cpp's rope layout, 2-D weights quantized to `qtype` if given."""
    import gguf
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(True)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp stores no output.weight for tied embeddings
        data = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = rope_permute(data, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = rope_permute(data, cfg.num_key_value_heads)
        if qtype is not None and data.ndim == 2:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_name(name: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> blk.0.attn_q.weight (GGUF's standard names)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, *rest = name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # (n_head * head_dim, d)
    """llama.cpp's `permute`: each head's rotary halves interleaved (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantizable_llama(vocab_size: int = 256) -> LlamaForCausalLM:
    """A tiny Llama whose linears bitsandbytes quantizes and runs on a CPU (inputs of at least its 64-wide blocks)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab_size,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
