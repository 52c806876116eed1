"""Batched generation for `forgetless serve`: one scheduler thread runs every active sequence of every request
together, one forward per step for the sequences that share a published model (per-step batching: a request
that arrives joins at the next step; one that ends or is abandoned leaves).

- **KV cache** (Hugging Face bases): a new sequence's prompt runs once (prefill, batch 1) and keeps its own
  cache, (1, H, L, D) keys and values per layer; each step the caches are left-padded to the longest,
  stacked into one DynamicCache with an attention mask (0 on the padding) and each row's position, the
  batch's last tokens run in one forward, and each row's cache (its L + 1 real positions) is taken back.
- **Without a cache**: forgetless's byte GPT has no KV cache, and a sequence longer than the context slides its
  window (as the model saw it before, without a cache); those run the whole window again each step, batched
  too, padded on the right (a causal model's logits at a row's last real token do not see the padding).
- Sampling stays per sequence (its temperature, top_p and seeded generator: `pick`). A batched forward adds
  floating-point rounding of its own (other kernels' summation order, masked padding), so a token can differ
  from a one-at-a-time run only where two logits are within that rounding (tests: greedy outputs equal).
- The models are the engine's published copies, never trained: the learner's thread cannot tear them.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.models.gpt import GPT, logits_of, takes_logits_to_keep

log = logging.getLogger("forgetless.serve")
DONE = None  # what a sequence's queue receives after its last token


@dataclass
class Sequence:
    """One request's sampled choice: `ids` (prompt then new tokens), `left` tokens still to sample."""
    model: torch.nn.Module
    ids: list[int]
    left: int
    temperature: float
    top_p: float
    generator: torch.Generator
    out: queue.Queue = field(default_factory=queue.Queue)  # token ids, then DONE (or an exception)
    cache: list | None = None  # per layer (keys, values), each (1, H, len(ids) - 1, D), once prefilled
    abandoned: bool = False


class Batcher:
    """The scheduler: `submit` a Sequence, read its tokens from `sequence.out`; `block_size`: the context."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.incoming: queue.Queue = queue.Queue()
        self.steps = self.rows = 0  # forwards run and sequences they carried (rows / steps: the mean batch)
        self.thread = threading.Thread(target=self.run, name="forgetless-batcher", daemon=True)
        self.thread.start()

    def submit(self, sequence: Sequence) -> Sequence:
        if sequence.left > 0:
            self.incoming.put(sequence)
        else:
            sequence.out.put(DONE)
        return sequence

    def close(self):
        if self.thread.is_alive():
            self.incoming.put(DONE)
            self.thread.join()

    def run(self):
        active: list[Sequence] = []
        while True:
            new = []
            try:  # wait only when nothing is running
                new.append(self.incoming.get(block=not active))
                while True:
                    new.append(self.incoming.get_nowait())
            except queue.Empty:
                pass
            if DONE in new:
                for s in active:
                    s.out.put(DONE)
                return
            active = [s for s in active + new if not s.abandoned]
            by_model: dict[int, list[Sequence]] = {}
            for s in active:
                by_model.setdefault(id(s.model), []).append(s)
            for group in by_model.values():
                try:
                    self.step(group)
                except Exception as e:  # a failed forward ends its requests, not the server
                    log.exception("generation step failed")
                    for s in group:
                        s.out.put(e)
                        s.left = 0
            active = [s for s in active if s.left > 0 and not s.abandoned]

    @torch.no_grad()
    def step(self, group: list[Sequence]):
        """Sample one token for each sequence of `group` (one published model)."""
        model = group[0].model
        cached = not isinstance(model, GPT)
        fresh = [s for s in group if cached and s.cache is None and len(s.ids) <= self.block_size]
        decode = [s for s in group if cached and s.cache is not None and len(s.ids) <= self.block_size]
        whole = [s for s in group if s not in fresh and s not in decode]
        rows = [(s, self.prefill(model, s)) for s in fresh]
        if decode:
            rows += zip(decode, self.decode(model, decode))
        if whole:
            rows += zip(whole, self.windows(model, whole))
        self.steps += bool(decode) + bool(whole) + len(fresh)
        self.rows += len(group)
        for s, logits in rows:
            token = int(pick(logits[None].float(), s.temperature, s.top_p, s.generator))
            s.ids.append(token)
            s.left -= 1
            s.out.put(token)
            if s.left == 0:
                s.out.put(DONE)

    def prefill(self, model, s: Sequence) -> torch.Tensor:  # (V,) logits of the next token
        device = next(model.parameters()).device
        keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
        out = model(input_ids=torch.tensor([s.ids], device=device), use_cache=True, **keep)
        s.cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out.logits[0, -1]

    def decode(self, model, seqs: list[Sequence]) -> torch.Tensor:  # (B, V)
        from transformers import DynamicCache
        device = next(model.parameters()).device
        lengths = [len(s.ids) - 1 for s in seqs]  # cached positions per row
        longest = max(lengths)
        mask = torch.zeros(len(seqs), longest + 1, dtype=torch.long, device=device)  # (B, L + 1)
        for i, n in enumerate(lengths):
            mask[i, longest - n:] = 1
        layers = []
        for keys_values in zip(*(s.cache for s in seqs)):  # one layer: B x ((1, H, n, D), (1, H, n, D))
            layers.append(tuple(torch.cat([F.pad(t, (0, 0, longest - n, 0)) for t, n in zip(kv, lengths)])
                                for kv in zip(*keys_values)))                # (B, H, L, D) keys, values
        cache = DynamicCache(layers)
        ids = torch.tensor([[s.ids[-1]] for s in seqs], device=device)                      # (B, 1)
        positions = torch.tensor([[n] for n in lengths], device=device)                     # (B, 1)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        for i, (s, n) in enumerate(zip(seqs, lengths)):  # each row's n + 1 real positions, padding dropped
            s.cache = [(layer.keys[i:i + 1, :, longest - n:], layer.values[i:i + 1, :, longest - n:])
                       for layer in out.past_key_values.layers]
        return out.logits[:, -1]

    def windows(self, model, seqs: list[Sequence]) -> torch.Tensor:  # (B, V)
        device = next(model.parameters()).device
        rows = [s.ids[-self.block_size:] for s in seqs]
        longest = max(map(len, rows))
        ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows], device=device)    # (B, T) right-padded
        last = torch.tensor([len(r) - 1 for r in rows], device=device)
        return logits_of(model, ids)[torch.arange(len(rows), device=device), last]


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """(1, V) float logits -> (1, 1) token: greedy at temperature 0 (or one so small the scaled logits overflow),
    else sampled from the nucleus of mass `top_p`."""
    scaled = logits / temperature if temperature else logits                     # (1, V)
    if temperature == 0 or not torch.isfinite(scaled).all():
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(nucleus(F.softmax(scaled, -1), top_p), 1, generator=generator)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:  # (1, V) -> (1, V)
    """`probs` kept on the fewest most likely tokens whose mass reaches `top_p` (the rest 0)."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)                      # (1, V)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p                     # (1, V): mass before it reached
    drop[:, 0] = False  # the most likely token stays (a top_p below float32's least number is 0 there)
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
