"""Instruction tasks (prompt -> answer): loading, a validation split, encoding with answer-only
targets, and a batch sampler with replay mixing.

A task spec is one of
  - a cl500 task name, e.g. `dbpedia` (the folder is $FORGETLESS_CL500, else ../shared/data/cl500
    beside the repository);
  - a folder with train and test files (.json, .jsonl or .csv) and, for classification, labels.json
    (without it, training answers of at most 20 distinct values covering the test answers are the labels);
  - one .json/.jsonl/.csv file, whose test part is split off deterministically.
Records need the fields `prompt` and `answer`. A task's eval.json is never read: in cl500 it
usually equals test.json, so choices use `validation_split` of the training examples instead.

Tokenizers are any object with `encode(text) -> list[int]` (no special tokens), `decode(ids)`,
`eos_id`, `pad_id` and `bos_id` (may be None; when set, every prompt starts with it).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from forgetless.data.splits import Batch, Sampler
from forgetless.errors import ForgetlessError, need
from forgetless.progress import console

CL500_ENV = "FORGETLESS_CL500"
REPO_CL500 = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "cl500"
FIELDS = ("prompt", "answer")
SUFFIXES = (".json", ".jsonl", ".csv")
IGNORE = -100  # target not scored
MAX_INFERRED_LABELS = 20  # a task without labels.json whose training answers take at most this many values is classification


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


@dataclass
class InstructionTask:
    name: str
    train: list[Example]
    test: list[Example]
    labels: list[str] | None = None  # the answer set of a classification task
    first_line: bool = False  # scored by the answer's first line (e.g. ScienceQA's letter before its reasoning)


# ---- loading -------------------------------------------------------------------------------
def load_task(spec: str | Path, test_fraction: float = 0.1) -> InstructionTask:
    """A cl500 task name, a folder with train/test files, or one file (its test part: `test_fraction`
    of the records, picked by a fixed seed)."""
    path = Path(spec)
    if path.is_file():
        train, test = split_off(read_examples(path), test_fraction, seed=0, what=str(path))
        return checked_task(path.stem, train, test, None)
    if path.is_dir():
        return load_folder(path, path.name, test_fraction)
    if len(path.parts) == 1 and path.suffix not in SUFFIXES:
        root = cl500_root(str(spec))
        if not (root / str(spec)).is_dir():
            names = sorted(p.name for p in root.iterdir() if p.is_dir())
            raise ForgetlessError(f"no cl500 task {str(spec)!r} in {root}; valid: {', '.join(names)}")
        return load_folder(root / str(spec), str(spec), test_fraction)
    raise ForgetlessError(f"no task {str(spec)!r}: give a cl500 task name, a folder with train and test files, "
                          "or a .json/.jsonl/.csv file of prompt/answer records")


def is_task_spec(spec: str) -> bool:
    """Whether `spec` names an instruction task (a prompt/answer file, a folder of them, or a cl500 task)
    rather than a text corpus."""
    path = Path(spec)
    if path.is_file():
        return path.suffix in SUFFIXES
    if path.is_dir():
        return data_file(path, "train") is not None
    try:
        return len(path.parts) == 1 and (cl500_root(spec) / spec).is_dir()
    except ForgetlessError:
        return False


def cl500_root(task: str = "") -> Path:
    """$FORGETLESS_CL500, else ../shared/data/cl500 beside the repository."""
    env = os.environ.get(CL500_ENV)
    if env:
        if not Path(env).is_dir():
            raise ForgetlessError(f"{CL500_ENV} points to {env}, which is not a folder; fix or unset it")
        return Path(env)
    if REPO_CL500.is_dir():
        return REPO_CL500
    raise ForgetlessError(f"cl500 task {task!r} needs the cl500 folder: set {CL500_ENV} to it "
                          f"(not found at {REPO_CL500})")


def load_folder(folder: Path, name: str, test_fraction: float) -> InstructionTask:
    """train.* and test.* (test split off train when absent) and the optional labels.json."""
    train_file, test_file = (data_file(folder, part) for part in ("train", "test"))
    if train_file is None:
        raise ForgetlessError(f"{folder} has no train.json, train.jsonl or train.csv")
    if test_file is None:
        train, test = split_off(read_examples(train_file), test_fraction, seed=0, what=str(train_file))
    else:
        train, test = read_examples(train_file), read_examples(test_file)
    labels = read_labels(folder / "labels.json") if (folder / "labels.json").is_file() else None
    if labels is not None:
        known = set(labels)
        missing = next((ex.answer for ex in test if ex.answer not in known), None)
        if missing is not None:
            raise ForgetlessError(f"{name}: test answer {missing!r} is not in {folder / 'labels.json'} "
                                  f"({len(labels)} labels); add it there or remove labels.json")
    return checked_task(name, train, test, labels)


def checked_task(name: str, train: list[Example], test: list[Example], labels: list[str] | None) -> InstructionTask:
    """The task without test rows whose prompt is also a training prompt (left out, with a warning: cl500's
    NumGLUE-ds has 6 of 100), and with labels inferred when it has none but its training answers are a
    small closed set covering every test answer (e.g. FOMC's A / B / C): then it is scored by label
    likelihood, not by exact match of a free greedy answer. A task whose answers run over several lines
    while their first lines form such a set (ScienceQA: the choice's letter, then the reasoning) is scored
    on the first line only, as TRACE scores ScienceQA by its letter."""
    seen = {" ".join(ex.prompt.split()) for ex in train}
    clean = [ex for ex in test if " ".join(ex.prompt.split()) not in seen]
    if len(clean) < len(test):
        console.print(f"[yellow]warning:[/yellow] {name}: {len(test) - len(clean)} of {len(test)} test prompts are "
                      "also training prompts; they are left out of its test rows", highlight=False, soft_wrap=True)
    if not clean:
        raise ForgetlessError(f"{name}: every test prompt is also a training prompt; give test rows of their own")
    answers = sorted({ex.answer for ex in train})
    if labels is None and 2 <= len(answers) <= MAX_INFERRED_LABELS and {ex.answer for ex in clean} <= set(answers):
        labels = answers
    heads = {head(ex.answer) for ex in train}
    first_line = (labels is None and any("\n" in ex.answer.strip() for ex in train)
                  and 2 <= len(heads) <= MAX_INFERRED_LABELS and {head(ex.answer) for ex in clean} <= heads)
    return InstructionTask(name, train, clean, labels, first_line)


def head(text: str) -> str:
    """The first line of `text` after leading whitespace."""
    return text.strip().split("\n")[0]


def data_file(folder: Path, part: str) -> Path | None:
    return next((folder / f"{part}{s}" for s in SUFFIXES if (folder / f"{part}{s}").is_file()), None)


def read_examples(path: Path) -> list[Example]:
    """prompt/answer records of a JSON (list or lines), JSONL or CSV file, read with `datasets`;
    every value is kept as text (a CSV answer "4" or "NA" stays "4" or "NA")."""
    datasets = need("datasets", "data", "reading prompt/answer files")

    csv = path.suffix == ".csv"
    options = {"converters": {f: str for f in FIELDS}, "na_filter": False} if csv else {}
    try:
        with quiet_datasets(datasets):
            rows = datasets.load_dataset("csv" if csv else "json", data_files=str(path), split="train", **options)
    except Exception as e:  # noqa: BLE001 - any reader failure is bad input
        raise ForgetlessError(f"cannot read {path}: {first_line(e)}") from None
    absent = [f for f in FIELDS if f not in rows.column_names]
    if absent:
        raise ForgetlessError(f"{path} has no {' or '.join(absent)} field (its fields: "
                              f"{', '.join(rows.column_names) or 'none'}); give records with prompt and answer")
    if not len(rows):
        raise ForgetlessError(f"{path} holds no records")
    examples = []
    for i, (prompt, answer) in enumerate(zip(rows["prompt"], rows["answer"])):
        if prompt is None or answer is None:
            raise ForgetlessError(f"{path}: record {i} has no {'prompt' if prompt is None else 'answer'}")
        examples.append(Example(str(prompt), str(answer)))
    return examples


def read_labels(path: Path) -> list[str]:
    try:
        labels = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ForgetlessError(f"cannot read {path}: {first_line(e)}") from None
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        raise ForgetlessError(f"{path} must be a JSON list of label strings")
    return labels


@contextlib.contextmanager
def quiet_datasets(datasets):
    """No "Generating train split" bars while reading small files."""
    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---- splits --------------------------------------------------------------------------------
def validation_split(task: InstructionTask, fraction: float = 0.1,
                     seed: int = 0) -> tuple[list[Example], list[Example]]:
    """(train, validation) carved from the task's training examples by a seeded permutation."""
    return split_off(task.train, fraction, seed, what=f"{task.name} train")


def split_off(examples: list[Example], fraction: float, seed: int, what: str) -> tuple[list[Example], list[Example]]:
    """(rest, part): round(fraction * n) examples (at least 1) picked by a seeded permutation; both keep
    the original order."""
    if not 0.0 < fraction < 1.0:
        raise ForgetlessError(f"a split fraction must be in (0, 1), got {fraction}")
    if len(examples) < 2:
        raise ForgetlessError(f"{what} has {len(examples)} example(s); splitting it needs at least 2")
    n = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    picked = set(torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))[:n].tolist())
    return ([ex for i, ex in enumerate(examples) if i not in picked],
            [ex for i, ex in enumerate(examples) if i in picked])


# ---- tokens --------------------------------------------------------------------------------
def text_ids(tokenizer, text: str) -> list[int]:
    """The tokens of `text`, without a leading bos (added to prompts only)."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_id", None)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """bos (when the tokenizer has one) + the prompt's tokens."""
    bos = getattr(tokenizer, "bos_id", None)
    return ([bos] if bos is not None else []) + text_ids(tokenizer, prompt)


def keep_end(prompt: list[int], keep: int | None, bos: int | None) -> list[int]:
    """The last `keep` tokens of a prompt (None: all), its bos kept in front when there is room."""
    if keep is None or len(prompt) <= keep:
        return prompt
    if bos is not None and prompt[:1] == [bos] and keep > 1:
        return [bos] + prompt[len(prompt) - keep + 1:]
    return prompt[len(prompt) - keep:]


@dataclass
class Encoded:
    """Examples as model rows: x[i] (T_i,) input ids and y[i] (T_i,) next-token targets, -100 on the
    prompt (the loss covers the answer and its eos only)."""
    x: list[torch.Tensor]
    y: list[torch.Tensor]
    pad_id: int
    truncated: int = 0       # prompts that lost their beginning to fit
    answers_cut: int = 0     # answers that alone did not fit and lost their end

    def __len__(self) -> int:
        return len(self.x)


def encode(examples: list[Example], tokenizer, max_len: int) -> Encoded:
    """Rows of prompt + answer + eos, each feeding the model at most `max_len` tokens. A longer prompt
    loses its beginning (left truncation: its end and the whole answer stay); an answer longer than
    what is left when its prompt keeps half the row (or all of a shorter prompt) loses its end, so the
    question is never cut away for the sake of an answer's tail (e.g. ScienceQA's reasoning). Both are
    counted and reported in one warning line."""
    if max_len < 2:
        raise ForgetlessError(f"max_len must be at least 2 tokens, got {max_len}")
    if not examples:
        raise ForgetlessError("no examples to encode")
    bos = getattr(tokenizer, "bos_id", None)
    room = max_len + 1  # a row of L tokens feeds L - 1 inputs
    xs, ys, cut, answers_cut = [], [], 0, 0
    for ex in examples:
        prompt, answer = prompt_ids(tokenizer, ex.prompt), text_ids(tokenizer, ex.answer) + [tokenizer.eos_id]
        if not prompt:
            raise ForgetlessError(f"prompt {ex.prompt!r} has no tokens and the tokenizer no bos; "
                                  "give a non-empty prompt")
        if len(prompt) + len(answer) > room:
            answer_room = room - min(len(prompt), room // 2)  # the prompt keeps at least half the row
            if len(answer) > answer_room:
                answer, answers_cut = answer[:answer_room], answers_cut + 1
            kept = keep_end(prompt, room - len(answer), bos)
            cut, prompt = cut + (len(kept) < len(prompt)), kept
        row = torch.tensor(prompt + answer)                                      # (L,)
        targets = torch.tensor([IGNORE] * len(prompt) + answer)                  # (L,)
        xs.append(row[:-1])
        ys.append(targets[1:])
    if cut or answers_cut:
        also = f"; {answers_cut} answers lost their end" if answers_cut else ""
        console.print(f"[yellow]warning:[/yellow] {cut} of {len(examples)} prompts were cut from the left to fit "
                      f"max_len {max_len}{also}", highlight=False, soft_wrap=True)
    pad = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else tokenizer.eos_id
    return Encoded(xs, ys, pad, cut, answers_cut)


# ---- batches -------------------------------------------------------------------------------
class InstructionSampler:
    """Random encoded examples per batch, right-padded to the batch's longest row (x with pad_id, y with
    -100); a fraction `p` of the rows comes from `other` (replay of earlier tasks or general data).

    The draws are a `data.splits.Sampler` over example indices (windows of 2 tokens of 0..n: the first
    is uniform in 0..n-1), so the mixing uses its stochastic rounding and its one generator, whose
    state `get_state`/`set_state` save and restore (exact resume).

    `group` > 1 (`adapt.group_by_length`): `group` batches are drawn at once and their rows regrouped by length
    (each set's rows longest first), every batch keeping its drawn count of `other` rows, then served in a random
    order: the same rows and mix, less padding (like transformers' group_by_length). The state is then the
    generator's at the group's start and the batches served of it.
    """

    def __init__(self, encoded: Encoded, batch_size: int, seed: int, other: Encoded | None = None,
                 p: float = 0.0, pad_id: int | None = None, group: int = 1):
        if not len(encoded) or other is not None and not len(other):
            raise ForgetlessError("an instruction sampler needs at least one encoded example in each set")
        self.encoded, self.other = encoded, other
        self.pad_id = encoded.pad_id if pad_id is None else pad_id
        self.indices = Sampler(torch.arange(len(encoded) + 1), batch_size, 1, seed,
                               None if other is None else torch.arange(len(other) + 1), p)
        self.group, self.queue, self.group_start = max(1, group), [], self.indices.get_state()

    def next(self) -> Batch:
        if self.group == 1:
            return self.padded(self.draw())
        if not self.queue:
            self.group_start, self.queue = self.indices.get_state(), self.grouped()
        return self.queue.pop(0)

    def draw(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """One batch's rows: (x (L,), y (L,), from other) each."""
        picks = self.indices.next()  # x (B, 1): example indices; from_other (B,)
        sets = [(self.other if o else self.encoded, o) for o in picks.from_other.tolist()]
        return [(s.x[i], s.y[i], o) for (s, o), i in zip(sets, picks.x[:, 0].tolist())]

    def grouped(self) -> list[Batch]:
        """`group` batches' rows regrouped by length, each batch keeping its drawn count of `other` rows (a method's
        term on those rows sees the same counts), served in a random order."""
        drawn = [self.draw() for _ in range(self.group)]
        main, other = (iter(sorted((row for rows in drawn for row in rows if row[2] == o), key=lambda r: -len(r[0])))
                       for o in (False, True))
        batches = [self.padded([next(main) if not o else next(other) for _, _, o in rows]) for rows in drawn]
        return [batches[i] for i in torch.randperm(len(batches), generator=self.indices.generator).tolist()]

    def padded(self, rows: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> Batch:
        width = max(len(x) for x, _, _ in rows)
        x = torch.full((len(rows), width), self.pad_id, dtype=torch.long)       # (B, T)
        y = torch.full((len(rows), width), IGNORE, dtype=torch.long)            # (B, T)
        for r, (xi, yi, _) in enumerate(rows):
            x[r, :len(xi)], y[r, :len(yi)] = xi, yi
        return Batch(x, y, torch.tensor([o for _, _, o in rows], dtype=torch.bool))

    def get_state(self) -> torch.Tensor:
        if self.group == 1:
            return self.indices.get_state()
        served = torch.tensor([self.group - len(self.queue) if self.queue else 0], dtype=torch.int32)
        return torch.cat([self.group_start if self.queue else self.indices.get_state(), served.view(torch.uint8)])

    def set_state(self, state: torch.Tensor):
        if self.group == 1:
            return self.indices.set_state(state)
        self.indices.set_state(state[:-4].clone())
        served = int(state[-4:].clone().view(torch.int32))
        self.group_start, self.queue = self.indices.get_state(), self.grouped() if served else []
        del self.queue[:served]
