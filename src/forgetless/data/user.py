"""Your data, for training in your own loop or transformers' Trainer: tokenised examples with
answer-only labels, rows of old data mixed in and marked `retained`, and a padding collator.

    new = forgetless.data.load("my.jsonl", tokenizer)          # datasets.Dataset of input_ids, labels
    old = forgetless.data.load("old.txt", tokenizer)           # what the model should keep knowing
    train = forgetless.data.mix(new, old, fraction=0.2)        # + retained: True on the old rows
    loader = DataLoader(train, batch_size=8, shuffle=True, collate_fn=forgetless.data.Collator(tokenizer))

Sources: a file (.txt/.md plain text, .jsonl/.json, .csv, .parquet), a folder written by
`Dataset.save_to_disk`, a folder of data files, a `datasets` Dataset (or DatasetDict: its `split`),
a list of texts or records, or a hub name (read by `datasets.load_dataset`). Records are one of
  {"text": ...}                       every token trained (long texts cut into rows of max_length)
  {"prompt": ..., "answer": ...}      only the answer and its eos trained ("completion" for "answer" too)
  {"messages": [{"role", "content"}]} chat, through the tokenizer's chat template; assistant turns trained
"""
from __future__ import annotations

from pathlib import Path

import torch

from forgetless.data.instructions import IGNORE, Example, encode, first_line, quiet_datasets
from forgetless.data.tokenizers import TextTokenizer
from forgetless.errors import ForgetlessError, need
from forgetless.progress import progress_task

TEXT_SUFFIXES = {".txt", ".md", ".text"}
READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ANSWER_FIELDS = ("answer", "completion")


def load(source, tokenizer, max_length: int = 512, split: str = "train"):
    """A `datasets.Dataset` with input_ids and labels (-100 on tokens not trained) of `source` (see the
    module docstring), each row at most `max_length` tokens. `tokenizer`: a transformers tokenizer (or
    the one forgetless.models.hf.load_model returns)."""
    need("datasets", "data", "forgetless.data.load")
    if max_length < 2:
        raise ForgetlessError(f"max_length must be at least 2 tokens, got {max_length}")
    hf = getattr(tokenizer, "hf", tokenizer)
    if not callable(getattr(hf, "__call__", None)) or not hasattr(hf, "eos_token_id"):
        raise ForgetlessError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if isinstance(source, (str, Path)) and Path(source).suffix.lower() in TEXT_SUFFIXES and Path(source).is_file():
        return as_dataset(text_rows([read_text(Path(source))], hf, max_length))
    records = read_records(source, split)
    kind = record_kind(records, source)
    if kind == "messages":
        rows = chat_rows(records["messages"], hf, max_length)
    elif kind == "text":
        rows = text_rows(records["text"], hf, max_length)
    else:
        rows = prompt_rows(records["prompt"], records[kind], hf, max_length)
    if not rows:
        raise ForgetlessError(f"{describe(source)} holds no rows with tokens")
    return as_dataset(rows)


def record_kind(records, source) -> str:
    """Which form `records` have: messages (chat), text, or the answer field of prompt/answer records."""
    columns = set(records.column_names)
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and (answer := next((f for f in ANSWER_FIELDS if f in columns), None)):
        return answer
    if "text" in columns:
        return "text"
    raise ForgetlessError(f"{describe(source)} has fields {', '.join(sorted(columns)) or 'none'}; give records "
                          "with text, prompt and answer (or completion), or chat messages")


def check(source, flag: str) -> int | None:
    """Before a model loads: `source` (what --data or --retain names) exists where it looks like a path and holds
    records of a known form; the number of its records (None for plain text, folders and hub names: their rows are
    known once tokenised)."""
    need("datasets", "data", flag)
    path = Path(source).expanduser()
    if not path.exists() and looks_like_path(str(source)):
        raise ForgetlessError(f"{flag} {no_such(source)}")
    if not path.is_file():
        return None  # a folder or a hub dataset name: read when the data loads
    if path.suffix.lower() in TEXT_SUFFIXES:
        if not read_text(path).strip():
            raise ForgetlessError(f"{flag} {path} is empty; give a file with text or records")
        return None
    records = read_records(path, "train")
    record_kind(records, source)
    return len(records)


def no_such(source) -> str:
    return (f"{source}: no such file or folder; give an existing file (.txt, .jsonl, .json, .csv, .parquet), a saved "
            "dataset folder, or a hub dataset name (org/name)")


def looks_like_path(text: str) -> bool:
    """A data file's name (a known suffix) or a path (/, ./, ../, ~), never a hub dataset name (org/name)."""
    return Path(text).suffix.lower() in (READERS.keys() | TEXT_SUFFIXES) or text.startswith(("/", "./", "../", "~"))


def mix(new, old=None, fraction: float = 0.2, seed: int = 0):
    """`new` plus rows of `old` (both from `load`) making `fraction` of the result, shuffled, with a
    `retained` column (True on the old rows): replay, and the rows on which distillation's KL and
    Neutral's l1 term act. Old rows are drawn without replacement while they last."""
    datasets = need("datasets", "data", "forgetless.data.mix")
    with quiet_datasets(datasets):
        return mixed(datasets, new, old, fraction, seed)


def mixed(datasets, new, old, fraction: float, seed: int):
    if not 0.0 <= fraction < 1.0:
        raise ForgetlessError(f"fraction must be in [0, 1), got {fraction}")
    new = new.remove_columns([c for c in ("retained",) if c in new.column_names])
    marked = [new.add_column("retained", [False] * len(new))]
    if fraction > 0:
        if old is None or not len(old):
            raise ForgetlessError("mix: fraction > 0 needs rows of old data (old=forgetless.data.load(old_file, tokenizer))")
        n = round(fraction * len(new) / (1 - fraction))
        g = torch.Generator().manual_seed(seed)
        picks = torch.cat([torch.randperm(len(old), generator=g) for _ in range(-(-n // len(old)))])[:n].tolist()
        old = old.remove_columns([c for c in old.column_names if c not in ("input_ids", "labels")]).select(picks)
        marked.append(old.add_column("retained", [True] * len(old)))
    return datasets.concatenate_datasets(marked).shuffle(seed=seed)


class Collator:
    """Pads a list of examples on the right into tensors: input_ids and attention_mask (B, T), labels
    (B, T) with -100 on padding, and retained (B,) bools where the examples carry it."""

    def __init__(self, tokenizer=None, pad_id: int | None = None, pad_to_multiple_of: int | None = None):
        hf = getattr(tokenizer, "hf", tokenizer)
        if pad_id is None and hf is not None:
            pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
        if pad_id is None:
            raise ForgetlessError("Collator needs a tokenizer with a pad or eos token, or pad_id=")
        self.pad_id, self.multiple = pad_id, pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)      # (B, T)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)        # (B, T)
        mask = torch.zeros((len(examples), width), dtype=torch.long)                 # (B, T)
        for r, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[r, :n] = torch.as_tensor(e["input_ids"])
            labels[r, :n] = torch.as_tensor(e.get("labels", e["input_ids"]))
            mask[r, :n] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if any("retained" in e for e in examples):
            batch["retained"] = torch.tensor([bool(e.get("retained", False)) for e in examples])  # (B,)
        return batch


# ---- reading -------------------------------------------------------------------------------
def read_records(source, split: str):
    """A `datasets.Dataset` of the records of `source`."""
    datasets = need("datasets", "data", "forgetless.data.load")
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ForgetlessError(f"the DatasetDict has no split {split!r}; its splits: {', '.join(source)}")
        return source[split]
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, (list, tuple)):
        if not source:
            raise ForgetlessError("load: the list is empty")
        return datasets.Dataset.from_list([{"text": r} if isinstance(r, str) else r for r in source])
    if not isinstance(source, (str, Path)):
        raise ForgetlessError(f"load: cannot read a {type(source).__name__}; give a file, folder, dataset or list")
    path = Path(source).expanduser()
    if not path.exists() and looks_like_path(str(source)):  # not a hub name: no 30 s of trying the hub
        raise ForgetlessError(no_such(source))
    try:
        with quiet_datasets(datasets):
            if path.is_file():
                if path.suffix.lower() not in READERS:
                    raise ForgetlessError(f"{path}: unknown file type {path.suffix or '(none)'}; give .txt, .jsonl, "
                                          ".json, .csv or .parquet")
                return datasets.load_dataset(READERS[path.suffix.lower()], data_files=str(path), split="train")
            if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
                return read_records(datasets.load_from_disk(str(path)), split)
            if path.is_dir():
                return datasets.load_dataset(str(path), split=split)
            return datasets.load_dataset(str(source), split=split)  # a hub name
    except ForgetlessError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is bad input
        where = "" if path.exists() else " (no such file or folder; read as a hub dataset name)"
        raise ForgetlessError(f"cannot read {source}{where}: {first_line(e)}") from None


def read_text(path: Path) -> str:
    text = path.read_bytes().decode("utf-8", errors="replace")
    stripped = text.lstrip()
    if path.suffix.lower() in TEXT_SUFFIXES and stripped[:1] in ("{", "[") and '"' in stripped[:200]:
        raise ForgetlessError(f"{path} looks like JSON records, not plain text; name it .jsonl (or .json) so its "
                              "fields are read")
    return text


def describe(source) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"the {type(source).__name__}"


# ---- tokens --------------------------------------------------------------------------------
def text_rows(texts, hf, max_length: int) -> list[dict]:
    """Every token trained; a text longer than max_length becomes several rows (the last may be short)."""
    rows = []
    with progress_task("tokenise text", len(texts)) as advance:
        for text in texts:
            ids = hf(str(text or ""), add_special_tokens=True)["input_ids"]
            if hf.eos_token_id is not None:
                ids = ids + [hf.eos_token_id]
            rows += [{"input_ids": ids[i:i + max_length], "labels": ids[i:i + max_length]}
                     for i in range(0, len(ids), max_length) if len(ids[i:i + max_length]) >= 2]
            advance()
    return rows


def prompt_rows(prompts, answers, hf, max_length: int) -> list[dict]:
    """Prompt + answer + eos, only the answer and eos trained; a long prompt loses its beginning
    (the bench's encoding of instruction tasks, data.instructions.encode)."""
    examples = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        if prompt is None or answer is None:
            raise ForgetlessError(f"record {i} has no {'prompt' if prompt is None else 'answer'}")
        examples.append(Example(str(prompt), str(answer)))
    encoded = encode(examples, TextTokenizer(hf, hf.name_or_path), max_length - 1)  # a row feeds len - 1 inputs
    return [{"input_ids": torch.cat([x, y[-1:]]).tolist(), "labels": [IGNORE, *y.tolist()]}
            for x, y in zip(encoded.x, encoded.y)]


def chat_rows(conversations, hf, max_length: int) -> list[dict]:
    """A conversation through the chat template; the tokens of each assistant turn are trained: those
    between the conversation before it (with the generation prompt) and the conversation through it.
    A turn whose rendering is not a prefix of the whole (templates that rewrite earlier turns) is not
    trained, except the last. Rows are cut to max_length."""
    if not getattr(hf, "chat_template", None):
        raise ForgetlessError(f"the tokenizer of {hf.name_or_path} has no chat template; give prompt/answer records, "
                              "or set tokenizer.chat_template")
    rows = []
    with progress_task("tokenise chats", len(conversations)) as advance:
        for messages in conversations:
            ids = render(hf, messages)
            labels = [IGNORE] * len(ids)
            for turn, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = len(render(hf, messages[:turn], add_generation_prompt=True)) if turn else 0
                through = render(hf, messages[:turn + 1])
                if through == ids[:len(through)]:
                    labels[start:len(through)] = ids[start:len(through)]
            if any(t != IGNORE for t in labels[:max_length]):
                rows.append({"input_ids": ids[:max_length], "labels": labels[:max_length]})
            advance()
    return rows


def render(hf, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def as_dataset(rows: list[dict]):
    datasets = need("datasets", "data", "forgetless.data.load")
    return datasets.Dataset.from_list(rows)
