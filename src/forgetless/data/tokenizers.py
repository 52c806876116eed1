"""Tokenizers: UTF-8 bytes (default, vocabulary 256), a char vocabulary, or a pretrained model's own."""
from __future__ import annotations

import torch

from forgetless.errors import ForgetlessError


class ByteTokenizer:
    kind = "bytes"
    vocab_size = 256

    def encode(self, data: bytes, source: str = "text") -> torch.Tensor:  # (N,) int64
        if not data:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind}


class PretrainedCorpusTokenizer:
    """A pretrained model's tokenizer (`encode(text) -> ids`, e.g. a TextTokenizer) over corpus bytes."""
    kind = "pretrained"

    def __init__(self, text_tokenizer):
        self.text = text_tokenizer
        self.vocab_size = text_tokenizer.vocab_size

    def encode(self, data: bytes, source: str = "text") -> torch.Tensor:  # (N,) int64
        return torch.tensor(self.text.encode(decode_utf8(data, source)), dtype=torch.long)

    def decode(self, ids) -> str:
        return self.text.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        record = self.text.to_dict() if hasattr(self.text, "to_dict") else {}
        return {**record, "kind": self.kind}


class TextTokenizer:
    """A transformers tokenizer with the byte tokenizer's names (`kind`, `vocab_size`, `decode`, `to_dict`)."""
    kind = "hf"

    def __init__(self, hf, spec: str):
        self.hf, self.spec = hf, spec
        self.vocab_size = len(hf)
        self.eos_id = hf.eos_token_id
        self.bos_id = hf.bos_token_id  # may be None
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": self.spec, "name_or_path": self.hf.name_or_path}


class CharTokenizer:
    """One id per Unicode character seen in the texts it was built from."""
    kind = "chars"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    @classmethod
    def from_texts(cls, texts: list[tuple[str, bytes]]) -> "CharTokenizer":
        return cls("".join("".join(set(decode_utf8(data, source))) for source, data in texts))

    def encode(self, data: bytes, source: str = "text") -> torch.Tensor:  # (N,) int64
        text = decode_utf8(data, source)
        unseen = sorted(set(text) - self.index.keys())
        if unseen:
            shown = ", ".join(repr(c) for c in unseen[:5])
            raise ForgetlessError(
                f"{source} has {len(unseen)} character(s) not in the char vocabulary ({shown}); "
                "use --tokenizer bytes, or build the vocabulary from this text too")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


def decode_utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ForgetlessError(
            f"{source} is not valid UTF-8 (byte {e.start}); char mode needs UTF-8 text: "
            "convert it, or use --tokenizer bytes") from None


def tokenizer_from_dict(d: dict):
    if d.get("kind") == "bytes":
        return ByteTokenizer()
    if d.get("kind") == "chars":
        return CharTokenizer(d["chars"])
    raise ForgetlessError(f"unknown tokenizer {d.get('kind')!r}; valid: bytes, chars")


TOKENIZERS = ("bytes", "chars")
