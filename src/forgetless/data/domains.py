"""From corpus specs to token streams: tokenizer, disjoint works, splits, fixed eval windows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forgetless.config import stable_hash
from forgetless.data.corpora import Corpus, load_corpus
from forgetless.data.splits import check_length, disjoint, eval_windows, split_all
from forgetless.data.tokenizers import ByteTokenizer, CharTokenizer, PretrainedCorpusTokenizer, tokenizer_from_dict


@dataclass
class Domain:
    spec: str
    train: torch.Tensor    # (N,) token ids
    val: torch.Tensor      # (M,) token ids
    windows: torch.Tensor  # (W, T+1) fixed held-out windows (the reported numbers)
    val_keys: list[str]    # held-out works (plays), if any
    fingerprint: str       # content hash of the corpus and its split as used
    dev_windows: torch.Tensor | None = None  # (W', T+1) validation windows from training works: choices use these
    dev_keys: list[str] | None = None         # validation works, if any
    dev: torch.Tensor | None = None           # (D,) validation token ids (the online protocol's stream on A)


def load_domains(specs: list[str], tokenizer: str | dict, block_size: int, val_fraction: float,
                 max_windows: int, dev_fraction: float = 0.1) -> tuple[list[Domain], object]:
    """Load corpora, make the first two share no work, tokenize, split (train, validation, held out) and
    window them (a work held out by one corpus is held out by all: no corpus trains on another's
    held-out works).

    `tokenizer` is "bytes", "chars" (vocabulary built from these corpora), a saved tokenizer dict, or a
    pretrained model's tokenizer (an object with `encode(text)`).
    """
    corpora = [load_corpus(s) for s in specs]
    if len(corpora) >= 2:
        corpora[0], corpora[1] = disjoint(corpora[0], corpora[1])
    splits = split_all(corpora, val_fraction, dev_fraction)
    tok = make_tokenizer(tokenizer, corpora, splits)
    domains = []
    for spec, corpus, split in zip(specs, corpora, splits):
        train = tok.encode(split.train, f"corpus {spec!r} (train split)")
        val = tok.encode(split.val, f"corpus {spec!r} (val split)")
        dev = tok.encode(split.dev, f"corpus {spec!r} (validation split)")
        for tokens, part in ((train, "train"), (val, "val"), (dev, "validation")):
            check_length(tokens, block_size, f"corpus {spec!r} {part} split")
        fingerprint = stable_hash([corpus.fingerprint(), split.val_keys, split.dev_keys, len(split.train), len(split.dev)])
        domains.append(Domain(spec, train, val, eval_windows(val, block_size, max_windows), split.val_keys,
                              fingerprint, eval_windows(dev, block_size, max_windows), split.dev_keys, dev))
    return domains, tok


def make_tokenizer(tokenizer, corpora: list[Corpus], splits):
    if not isinstance(tokenizer, (str, dict)):  # a pretrained model's tokenizer
        return PretrainedCorpusTokenizer(tokenizer)
    if isinstance(tokenizer, dict):
        return tokenizer_from_dict(tokenizer)
    if tokenizer == "chars":
        texts = [(f"corpus {c.name!r}", s.train + s.val) for c, s in zip(corpora, splits)]
        return CharTokenizer.from_texts(texts)
    return ByteTokenizer()

