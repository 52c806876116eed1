"""Deterministic train/val splits, fixed evaluation windows, batch samplers and mixing."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forgetless.data.corpora import Corpus, Document
from forgetless.errors import ForgetlessError

SEPARATOR = b"\n\n"


@dataclass
class Split:
    train: bytes
    val: bytes                 # held out for the reported numbers (test)
    val_keys: list[str]
    train_keys: list[str] = field(default_factory=list)  # works in train (empty for a tail split)
    dev: bytes = b""           # validation, carved from the training works: every choice is made on it
    dev_keys: list[str] = field(default_factory=list)


def split_all(corpora: list[Corpus], val_fraction: float = 0.1, dev_fraction: float = 0.1) -> list[Split]:
    """Split every corpus; a work held out by one corpus is held out by every corpus that has it (e.g.
    modern, Folio and renamed versions of one play), so no corpus trains on another's held-out works;
    likewise a validation work of one corpus is validation (or held out) in all."""
    held = {key for c in corpora for key in split_corpus(c, val_fraction, dev_fraction=dev_fraction).val_keys}
    dev = {key for c in corpora for key in split_corpus(c, val_fraction, held, dev_fraction).dev_keys} - held
    return [split_corpus(c, val_fraction, held, dev_fraction, dev) for c in corpora]


def split_corpus(corpus: Corpus, val_fraction: float = 0.1, also_held: set[str] = frozenset(),
                 dev_fraction: float = 0.1, also_dev: set[str] = frozenset()) -> Split:
    """Hold out whole documents (plays) when there are >= 4, else the tail of the text; documents whose
    key is in `also_held` are held out too. The validation split takes whole training documents the same
    way (>= 4 left, plus those in `also_dev`), else the tail of the training text."""
    if not 0.0 < val_fraction < 1.0 or not 0.0 < dev_fraction < 1.0 or val_fraction + dev_fraction >= 1.0:
        raise ForgetlessError(f"data.val_fraction and data.dev_fraction must be in (0, 1) with a sum below 1, "
                              f"got {val_fraction} and {dev_fraction}")
    docs = sorted(corpus.docs, key=lambda d: d.key)
    if len(docs) < 4:
        data = join(docs)
        cut_dev, cut = int(len(data) * (1 - val_fraction - dev_fraction)), int(len(data) * (1 - val_fraction))
        return Split(data[:cut_dev], data[cut:], [], dev=data[cut_dev:cut])
    val, train = pick(docs, val_fraction * len(docs), also_held)
    if not train:
        raise ForgetlessError(f"corpus {corpus.name!r}: every work is held out by this or another corpus "
                              "of the run; give it works of its own")
    if len(train) >= 4:
        dev, train = pick(train, dev_fraction * len(docs), also_dev)
        train_data, dev_data = join(train), join(dev)
    else:  # too few works to spare one: the tail of the training text
        text, dev = join(train), []
        cut = int(len(text) * (1 - dev_fraction / (1 - val_fraction)))
        train_data, dev_data = text[:cut], text[cut:]
    return Split(train_data, join(val), [d.key for d in val], [d.key for d in train], dev_data, [d.key for d in dev])


def pick(docs: list[Document], share: float, also: set[str]) -> tuple[list[Document], list[Document]]:
    """(picked, rest): max(1, round(share)) documents evenly spread over `docs` (sorted by key), plus those
    whose key is in `also`."""
    n = max(1, round(share))
    picks = {int((j + 0.5) * len(docs) / n) for j in range(n)}
    chosen = [i in picks or d.key in also for i, d in enumerate(docs)]
    return [d for d, c in zip(docs, chosen) if c], [d for d, c in zip(docs, chosen) if not c]


def join(docs: list[Document]) -> bytes:
    return SEPARATOR.join(d.data for d in docs)


def disjoint(a: Corpus, b: Corpus) -> tuple[Corpus, Corpus]:
    """Give works present in both corpora (same key) alternately to A and B, so they share none.

    Single-work corpora (e.g. tinyshakespeare -> renamed:tinyshakespeare) are left as they are:
    their shift is the whole text, as in the APN source.
    """
    shared = sorted({d.key for d in a.docs} & {d.key for d in b.docs})
    if len(shared) < 2:
        return a, b
    to_b = set(shared[1::2])
    to_a = set(shared) - to_b
    return (Corpus(a.name, [d for d in a.docs if d.key not in to_b]),
            Corpus(b.name, [d for d in b.docs if d.key not in to_a]))


def check_length(tokens: torch.Tensor, block_size: int, where: str):
    if len(tokens) < block_size + 1:
        raise ForgetlessError(
            f"{where} has {len(tokens)} tokens, fewer than context + 1 = {block_size + 1}; "
            "give more text or a smaller --model-block-size")


def eval_windows(tokens: torch.Tensor, block_size: int, max_windows: int) -> torch.Tensor:
    """Fixed, evenly spaced, non-overlapping windows of block_size + 1 tokens: (W, T+1)."""
    n_all = (len(tokens) - 1) // block_size
    n = min(n_all, max_windows)
    starts = [int(i * n_all / n) * block_size for i in range(n)]
    return torch.stack([tokens[s:s + block_size + 1] for s in starts])


@dataclass
class Batch:
    x: torch.Tensor         # (B, T) inputs
    y: torch.Tensor         # (B, T) next-token targets; -100 = not scored (e.g. prompt tokens)
    from_other: torch.Tensor  # (B,) bool: row drawn from the mixed-in (original) corpus: a user's `retained` rows
    mask: torch.Tensor | None = None  # (B, T) attention mask of x (1 = token, 0 = padding); None: all tokens

    def to(self, device: torch.device) -> "Batch":
        mask = None if self.mask is None else self.mask.to(device)
        return Batch(self.x.to(device), self.y.to(device), self.from_other.to(device), mask)

    @staticmethod
    def of(data) -> "Batch":
        """A Batch from a Batch, a (B, T+1) tensor of token windows, or a dict with `input_ids` and
        optional `attention_mask`, `labels` (Hugging Face style: aligned with input_ids, -100 = ignored;
        default: input_ids where the mask is 1) and `retained` ((B,) bool: rows of old data)."""
        if isinstance(data, Batch):
            return data
        if torch.is_tensor(data):
            if data.dim() != 2 or data.shape[1] < 2:
                raise ForgetlessError(f"a batch tensor holds token windows (B, T+1), got shape {tuple(data.shape)}")
            return Batch(data[:, :-1], data[:, 1:], torch.zeros(len(data), dtype=torch.bool, device=data.device))
        if isinstance(data, dict) and "input_ids" in data:
            return Batch.of_hf(data["input_ids"], data.get("attention_mask"), data.get("labels"),
                               data.get("retained", data.get("from_other")))
        raise ForgetlessError(f"cannot make a batch of {type(data).__name__}: give a Batch, a (B, T+1) "
                              "LongTensor of windows, or a dict with input_ids (and labels)")

    @staticmethod
    def of_hf(input_ids: torch.Tensor, attention_mask=None, labels=None, retained=None) -> "Batch":
        """The model reads all of input_ids (B, T); position t is scored against labels[:, t + 1] (the
        shift of transformers' causal-LM loss), the last position against nothing."""
        if input_ids.dim() != 2:
            raise ForgetlessError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        if labels is None:
            labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        if labels.shape != input_ids.shape:
            raise ForgetlessError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        y = torch.cat([labels[:, 1:], labels.new_full((len(labels), 1), -100)], 1)      # (B, T)
        if retained is None:
            retained = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        return Batch(input_ids, y, torch.as_tensor(retained, device=input_ids.device).bool().view(-1), attention_mask)


class Sampler:
    """Random windows from one token stream, or a fraction `p` of every batch from another.

    The other corpus supplies floor(p * B) rows of each batch, plus one more with probability
    frac(p * B) (stochastic rounding: the mean share is exactly p, even when p * B < 1); all
    randomness comes from one torch.Generator, whose state is saved in checkpoints (exact resume).
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int,
                 other: torch.Tensor | None = None, p: float = 0.0):
        if batch_size <= 0:
            raise ForgetlessError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= p <= 1.0:
            raise ForgetlessError(f"mixing fraction p must be in [0, 1], got {p}")
        if p > 0 and other is None:
            raise ForgetlessError("mixing fraction p > 0 needs another corpus to draw from")
        self.tokens, self.other = tokens, other
        self.batch_size, self.block_size = batch_size, block_size
        share = p * batch_size if other is not None else 0.0
        self.n_other, self.extra_chance = int(share), share - int(share)
        self.generator = torch.Generator().manual_seed(seed)

    def _rows(self, tokens: torch.Tensor, n: int) -> torch.Tensor:  # (n, T+1)
        starts = torch.randint(len(tokens) - self.block_size, (n,), generator=self.generator)
        return torch.stack([tokens[s:s + self.block_size + 1] for s in starts.tolist()])

    def next(self) -> Batch:
        n_other = self.n_other
        if self.extra_chance:  # no draw at all when p * B is whole (same stream as without mixing)
            n_other += int(torch.rand((), generator=self.generator) < self.extra_chance)
        n_main = self.batch_size - n_other
        rows = [self._rows(self.tokens, n_main)] if n_main else []
        if n_other:
            rows.append(self._rows(self.other, n_other))
        data = torch.cat(rows)  # (B, T+1)
        from_other = torch.arange(self.batch_size) >= n_main
        return Batch(data[:, :-1], data[:, 1:], from_other)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor):
        self.generator.set_state(state)
