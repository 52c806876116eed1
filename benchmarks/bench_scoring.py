"""Label scoring: one prompt pass with its KV cache shared by the labels vs one full forward per label.

Task: the first N dbpedia test prompts from cl500 (real length) and its 14 labels, tokenized with a
byte-level BPE trained here on 300 dbpedia training prompts (nothing is downloaded); model: a random
Llama (4 layers, hidden 256). Baseline: a full forward of prompt + label per (prompt, label), as a
plain implementation does; also shown: the K labels of one prompt in one padded batch (the prompt
still runs K times). Candidate: `forgetless.continual.scoring.label_scores`. All run in this process,
alternating within each repeat; medians are compared, and the scores must agree.

    python benchmarks/bench_scoring.py [--examples 32] [--repeats 3] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _timing import provenance
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from forgetless.continual.scoring import label_scores
from forgetless.data.instructions import load_task, prompt_ids, text_ids


class BenchTokenizer:
    def __init__(self, hf: PreTrainedTokenizerFast):
        self.hf, self.eos_id, self.pad_id, self.bos_id = hf, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def bpe(lines: list[str], vocab_size: int) -> BenchTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return BenchTokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                  eos_token="</s>"))


@torch.no_grad()
def per_candidate(model, tok, prompts, labels) -> torch.Tensor:  # (N, K)
    out = torch.zeros(len(prompts), len(labels))
    for i, prompt in enumerate(prompts):
        p = prompt_ids(tok, prompt)
        for k, label in enumerate(labels):
            c = text_ids(tok, label) + [tok.eos_id]
            logp = model(torch.tensor([p + c[:-1]])).logits[0, len(p) - 1:].log_softmax(-1)  # (len(c), V)
            out[i, k] = logp.gather(-1, torch.tensor(c)[:, None]).sum()
    return out


@torch.no_grad()
def per_prompt_batch(model, tok, prompts, labels) -> torch.Tensor:  # (N, K)
    cands = [text_ids(tok, label) + [tok.eos_id] for label in labels]
    out = torch.zeros(len(prompts), len(labels))
    for i, prompt in enumerate(prompts):
        p = prompt_ids(tok, prompt)
        rows = [p + c[:-1] for c in cands]
        width = max(map(len, rows))
        ids = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])  # (K, T) right-padded
        logp = model(ids).logits.log_softmax(-1)                                 # (K, T, V)
        for k, c in enumerate(cands):
            out[i, k] = logp[k, len(p) - 1:len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).sum()
    return out


def timed(fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    scores = fn()
    return time.perf_counter() - t0, scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    task = load_task("dbpedia")
    tok = bpe([ex.prompt for ex in task.train[:300]] + task.labels, args.vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok.hf),
                                         bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                         pad_token_id=tok.pad_id)).eval()
    prompts, labels = [ex.prompt for ex in task.test[:args.examples]], task.labels
    runs = {"per_candidate": lambda: per_candidate(model, tok, prompts, labels),
            "per_prompt_batch": lambda: per_prompt_batch(model, tok, prompts, labels),
            "fast": lambda: label_scores(model, tok, prompts, labels, batch_size=args.batch_size)}
    label_scores(model, tok, prompts[:2], labels)  # warm up
    times = {name: [] for name in runs}
    scores = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            seconds, scores[name] = timed(fn)
            times[name].append(seconds)
    t = {name: statistics.median(v) for name, v in times.items()}
    baselines = ("per_candidate", "per_prompt_batch")
    diff = max((scores["fast"] - scores[name]).abs().max().item() for name in baselines)
    same = all(torch.equal(scores["fast"].argmax(1), scores[name].argmax(1)) for name in baselines)
    lengths = [len(prompt_ids(tok, p)) for p in prompts]
    print(f"{len(prompts)} dbpedia prompts (mean {statistics.mean(lengths):.0f} tokens) x {len(labels)} labels: "
          f"per candidate {t['per_candidate']:.2f} s, per-prompt batch {t['per_prompt_batch']:.2f} s, "
          f"fast {t['fast']:.2f} s; max |diff| {diff:.1e}, same choices: {same}")
    print(json.dumps({"bench": "scoring", "provenance": provenance(), "ratio": round(t["per_candidate"] / t["fast"], 2),
                      "ratio_vs_per_prompt_batch": round(t["per_prompt_batch"] / t["fast"], 2),
                      "baseline_s": round(t["per_candidate"], 3), "per_prompt_batch_s": round(t["per_prompt_batch"], 3),
                      "fast_s": round(t["fast"], 3), "max_abs_diff": diff, "same_choices": same,
                      "config": {"examples": len(prompts), "labels": len(labels), "mean_prompt_tokens":
                                 round(statistics.mean(lengths), 1), "vocab": len(tok.hf), "layers": 4, "hidden": 256,
                                 "batch_size": args.batch_size, "threads": torch.get_num_threads(),
                                 "repeats": args.repeats}}))


if __name__ == "__main__":
    main()
