"""Batched generation for `forgetless serve`: one scheduler thread runs every active sequence of every request
together, one forward per step for the sequences that share a published model (per-step batching: a request
that arrives joins at the next step; one that ends or is abandoned leaves).

- **KV cache** (Hugging Face bases): the prompts that join in a step run in one forward (prefill), right-padded
  with an attention mask (positions 0..n-1 for each row; a padded query still sees its row's real keys, so no
  row is all masked); each keeps its own cache, (1, H, n, D) keys and values per layer, and its first token is
  sent before the step's decode forward, so a new request waits for one prefill, not one per prompt that joined
  with it. Each decode step the caches are left-padded to the longest, stacked into one DynamicCache with an
  attention mask (0 on the padding) and each row's position, the batch's last tokens run in one forward, and
  each row's cache (its L + 1 real positions) is taken back.
- **Without a cache**: forgetless's byte GPT has no KV cache, and a sequence longer than the context slides its
  window (as the model saw it before, without a cache); those run the whole window again each step, batched
  too, padded on the right (a causal model's logits at a row's last real token do not see the padding).
- Sampling stays per sequence (its temperature, top_p and seeded generator: `pick`). A batched forward adds
  floating-point rounding of its own (other kernels' summation order, masked padding), so a token can differ
  from a one-at-a-time run only where two logits are within that rounding (tests: greedy outputs equal).
- `live` counts the sequences waiting or decoding; the learner waits for it to reach 0 between its steps
  (`wait_idle`: generation has priority over learning, engine.py).
- The models are the engine's published copies, never trained: the learner's thread cannot tear them.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forgetless.models.gpt import GPT, cache_arg, cache_of, logits_of, takes_logits_to_keep

log = logging.getLogger("forgetless.serve")
DONE = None  # what a sequence's queue receives after its last token


@dataclass(eq=False)  # compared by identity
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
        self.live = 0  # sequences submitted and not yet ended (waiting or decoding)
        self.idle = threading.Condition()  # notified when `live` falls to 0
        self.thread = threading.Thread(target=self.run, name="forgetless-batcher", daemon=True)
        self.thread.start()

    def submit(self, sequence: Sequence) -> Sequence:
        if sequence.left > 0:
            with self.idle:
                self.live += 1
            self.incoming.put(sequence)
        else:
            sequence.out.put(DONE)
        return sequence

    def close(self):
        if self.thread.is_alive():
            self.incoming.put(DONE)
            self.thread.join()

    def busy(self) -> bool:
        """Whether a sequence is waiting or decoding."""
        return self.live > 0

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no sequence is waiting or decoding, at most `timeout` seconds; whether none is."""
        with self.idle:
            return self.idle.wait_for(lambda: self.live == 0, timeout)

    def ended(self, n: int):
        """`n` sequences left (done, failed or abandoned)."""
        if n:
            with self.idle:
                self.live -= n
                if self.live == 0:
                    self.idle.notify_all()

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
            if DONE in new:  # closed: every sequence still here ends
                ending = [s for s in active + new if s is not DONE]
                for s in ending:
                    s.out.put(DONE)
                self.ended(len(ending))
                return
            joined = active + new
            active = [s for s in joined if not s.abandoned]
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
            self.ended(len(joined) - len(active))

    @torch.no_grad()
    def step(self, group: list[Sequence]):
        """Sample one token for each sequence of `group` (one published model): the prompts that joined in one
        prefill forward (their tokens sent first), the cached sequences in one decode forward, the rest (no
        cache, or past the context) in one forward of their windows."""
        model = group[0].model
        cached = [s for s in group if not isinstance(model, GPT) and len(s.ids) <= self.block_size]
        fresh = [s for s in cached if s.cache is None]
        decode = [s for s in cached if s.cache is not None]
        whole = [s for s in group if s not in cached]
        for seqs, forward in ((fresh, self.prefill), (decode, self.decode), (whole, self.windows)):
            if seqs:
                self.emit(seqs, forward(model, seqs))
                self.steps += 1
                self.rows += len(seqs)

    def emit(self, seqs: list[Sequence], logits: torch.Tensor):
        """Sample and send each sequence's next token from its row of `logits` (B, V)."""
        for s, row in zip(seqs, logits):
            token = int(pick(row[None].float(), s.temperature, s.top_p, s.generator))
            s.ids.append(token)
            s.left -= 1
            s.out.put(token)
            if s.left == 0:
                s.out.put(DONE)

    def prefill(self, model, seqs: list[Sequence]) -> torch.Tensor:  # (B, V) logits of each next token
        """The prompts of `seqs` in one forward, right-padded; each keeps its (1, H, n, D) cache per layer."""
        device = next(model.parameters()).device
        lengths = [len(s.ids) for s in seqs]
        longest = max(lengths)
        ids = torch.tensor([s.ids + [0] * (longest - len(s.ids)) for s in seqs], device=device)    # (B, T)
        mask = (torch.arange(longest, device=device) < torch.tensor(lengths, device=device)[:, None]).long()  # (B, T)
        positions = torch.arange(longest, device=device).expand(len(seqs), -1)                     # (B, T)
        last = sorted({n - 1 for n in lengths})  # the positions whose logits are needed
        keep = {"logits_to_keep": torch.tensor(last, device=device)} if takes_logits_to_keep(model) else {}
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **keep)
        for i, (s, n) in enumerate(zip(seqs, lengths)):  # each row's n real positions, padding dropped
            s.cache = [(layer.keys[i:i + 1, :, :n], layer.values[i:i + 1, :, :n])
                       for layer in cache_of(out).layers]
        at = [last.index(n - 1) if keep else n - 1 for n in lengths]
        return out.logits[torch.arange(len(seqs), device=device), torch.tensor(at, device=device)]

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
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_arg(model): cache})
        for i, (s, n) in enumerate(zip(seqs, lengths)):  # each row's n + 1 real positions, padding dropped
            s.cache = [(layer.keys[i:i + 1, :, longest - n:], layer.values[i:i + 1, :, longest - n:])
                       for layer in cache_of(out).layers]
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
