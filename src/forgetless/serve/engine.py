"""The model behind `forgetless serve`: it scores and generates with published weights while a method
learns from accepted documents (docs/DESIGN.md §3.6).

- **No torn reads.** The learner trains its own copy; after each accepted document a fresh copy of its
  weights is published (copy-on-write). A request takes the copy published when it starts and keeps it
  to the end, so it never sees a half-applied update. Learning, snapshots and rollbacks hold one lock.
- **Generation first.** Before its steps (updates, the screen's and canary's forwards, the publish) learning
  waits while the batcher has requests waiting or decoding (`yield_to_generation`), and a step already running
  pauses at its next layer boundary, forward or backward, when requests arrive (`pause_points`): at most
  `learn_wait_max` seconds a step in all. A step is never cut (a paused step goes on where it stopped).
- **Guardrails.** Before a document is logged it is screened (`screen`), on both sides: refused when its bytes
  are mostly one symbol (the most frequent byte over `screen_max_symbol_share` of them), nearly constant (byte
  entropy under `screen_min_entropy` bits), random characters (byte entropy over `screen_max_entropy` bits) or
  dominated by repeated n-grams (zlib shrinks it below `screen_min_compression` of its size), or when its loss
  under the current weights is an outlier against the documents accepted last: above median + `screen_k` x
  spread or below median - `screen_low_k` x spread (memorised or repeated text) of the last `screen_window`
  accepted losses, spread = max(1.4826 x MAD, `screen_min_spread` x median), once `screen_warmup` documents
  have been accepted. Refused
  documents are not logged, not learned and do not enter the window, so poison cannot move the median.
  Every `canary_every` accepted documents the canary (held-out windows of the original text) is scored; a
  loss more than `max_canary_rise` nats/token above the reference (the canary loss at first start, or the
  operator's `canary_reference`; never the last good state, so damage below the limit cannot ratchet the
  limit up) rolls the learner back to the last good state (logged with the documents undone); otherwise the
  state becomes the last good one. Every snapshot is also kept (`kept/`, the last `keep_states` and the first
  start's; each its own file, hashed in a manifest: `store.py`): `/v1/rollback` can restore any of them.
- **Durability.** One server holds the state folder (an OS lock). A document is appended to the
  write-ahead log (checksummed, fsync) before it is learned and acknowledged; an append that fails is undone
  and answered 503 (`wal.Unavailable`). An operator's rollback or snapshot is a transaction: logged, its
  snapshot written, and only then applied in memory; a start from a damaged snapshot falls back to the newest
  intact kept state and replays the log (documents and operations) after it. Every `snapshot_every`
  documents, a good state (weights, optimizer, hook state, RNG) is written as safetensors. A restart
  loads the snapshot and replays the log after it: the same updates, checks and rollbacks, so the same
  weights bit for bit. A document sent with a key is learned once: a retry gets the first answer.
"""
from __future__ import annotations

import collections
import copy
import hashlib
import json
import logging
import math
import statistics
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from forgetless.checkpoint import load_optimizer, optimizer_tensors
from forgetless.continual.evaluate import evaluate
from forgetless.continual.learner import Learner, chunk_windows
from forgetless.continual.protocol import refuse_joint
from forgetless.data.splits import Batch, Sampler
from forgetless.data.user import chat_rows, prompt_rows, render
from forgetless.errors import ForgetlessError
from forgetless.methods import Method, MethodSpec
from forgetless.methods.base import as_specs
from forgetless.models.gpt import logits_of
from forgetless.serve.batch import DONE, Batcher, Sequence
from forgetless.serve.publish import PUBLISH, write_version
from forgetless.serve.store import KEPT, SNAPSHOT, Damaged, Store, kept_name
from forgetless.serve.wal import Unavailable, WriteAheadLog, lock_folder
from forgetless.train import TrainConfig, TrainingDiverged

log = logging.getLogger("forgetless.serve")
WAL = "wal.jsonl"
__all__ = ["KEPT", "SNAPSHOT", "WAL", "Engine", "ServeConfig", "Unavailable", "kept_name"]
HISTORY = 2000  # points of each dashboard curve kept (the latest)
KEYS = 1000  # idempotency keys remembered (the latest), with their first answers


class KeyReused(ForgetlessError):
    """An idempotency key sent again with another text."""


class Screened(ForgetlessError):
    """A document the screen refused; `reason` is its short name (the metrics' label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class ServeConfig:
    method: str = field(default="lora", metadata={"help": "method that learns from /v1/learn: a name or spec as in "
                                                           "bench --methods, e.g. lora, full, dynamic-eval"})
    lr: float = field(default=1e-3, metadata={"help": "learning rate (a method's own lr option wins)"})
    mix: float = field(default=0.0, metadata={
        "help": "share of retained rows (--retain FILE) mixed into each learning batch: round(mix x rows), at least "
                "one; 0: none, or 0.2 with --retain (a method's own mix option wins)"})
    steps_per_doc: int = field(default=1, metadata={"help": "updates on each accepted document"})
    canary_every: int = field(default=8, metadata={"help": "score the canary every N accepted documents"})
    max_canary_rise: float = field(default=0.05, metadata={
        "help": "roll back when the canary loss rises more than this (nats/token) above its value at first start"})
    snapshot_every: int = field(default=32, metadata={
        "help": "write a safetensors snapshot every N accepted documents (a multiple of canary_every)"})
    canary_reference: float = field(default=0.0, metadata={
        "help": "canary loss (nats/token) the rollback limit is measured from; 0: the canary loss at first start"})
    keep_states: int = field(default=8, metadata={
        "help": "snapshots kept in STATE_DIR/kept as /v1/rollback targets (the latest N, and the first start's)"})
    screen_k: float = field(default=5.0, metadata={
        "help": "refuse a document whose loss is above median + K x spread of the recently accepted ones (0: off)"})
    screen_window: int = field(default=64, metadata={"help": "accepted documents whose losses the screen compares"})
    screen_warmup: int = field(default=8, metadata={
        "help": "accepted documents before the loss screen starts (the byte screen always runs)"})
    screen_min_spread: float = field(default=0.02, metadata={
        "help": "least spread of the loss screen, as a share of the median (1.4826 x MAD when larger)"})
    screen_max_symbol_share: float = field(default=0.5, metadata={
        "help": "refuse a document whose most frequent byte is more than this share of its bytes (1: off)"})
    screen_min_entropy: float = field(default=1.0, metadata={
        "help": "refuse a document whose byte entropy is below this many bits per byte (0: off)"})
    screen_max_entropy: float = field(default=5.5, metadata={
        "help": "refuse a document whose byte entropy is above this many bits per byte: random characters (8: off; "
                "raise it for scripts with many letters, e.g. CJK)"})
    screen_min_compression: float = field(default=0.2, metadata={
        "help": "refuse a document zlib compresses below this share of its size: repeated n-grams (0: off)"})
    screen_low_k: float = field(default=5.0, metadata={
        "help": "refuse a document whose loss is below median - K x spread of the recently accepted ones: "
                "memorised or repeated text (0: off)"})
    max_doc_bytes: int = field(default=65536, metadata={"help": "largest document /v1/learn and /v1/score accept"})
    learn_per_minute: int = field(default=120, metadata={"help": "rate limit of /v1/learn (0: none)"})
    max_new_tokens: int = field(default=512, metadata={"help": "most tokens /v1/generate produces per request"})
    learn_wait_max: float = field(default=30.0, metadata={
        "help": "seconds a learning step waits at most, before it starts and paused at its layer boundaries, while "
                "generation runs (requests waiting or decoding), before it runs beside it, so a steady load cannot "
                "starve learning; 0: learning never waits"})
    max_queued: int = field(default=8, metadata={
        "help": "learn, snapshot and rollback requests waiting for the learner; more are answered 503 + Retry-After"})
    log_retention: str = field(default="archive", metadata={
        "help": "records before the oldest kept state, moved out of the log after a snapshot: archive (to "
                "STATE_DIR/wal-archive) or drop"})
    seed: int = field(default=0, metadata={"help": "seed of the method's initialisation and mixed rows"})

    def __post_init__(self):
        for name in ("steps_per_doc", "canary_every", "snapshot_every", "max_doc_bytes", "max_new_tokens", "keep_states",
                     "screen_window", "screen_warmup", "max_queued"):
            if getattr(self, name) <= 0:
                raise ForgetlessError(f"serve.{name} must be positive, got {getattr(self, name)}")
        if self.snapshot_every % self.canary_every:
            raise ForgetlessError(f"serve.snapshot_every ({self.snapshot_every}) must be a multiple of serve.canary_every "
                                  f"({self.canary_every}): a snapshot is a checked state")
        if self.learn_per_minute < 0 or not self.max_canary_rise >= 0:
            raise ForgetlessError("serve.learn_per_minute and serve.max_canary_rise must not be negative")
        for name in ("canary_reference", "screen_k", "screen_low_k", "screen_min_spread", "screen_min_entropy",
                     "screen_max_entropy", "screen_min_compression", "learn_wait_max"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ForgetlessError(f"serve.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 < self.screen_max_symbol_share <= 1:
            raise ForgetlessError(f"serve.screen_max_symbol_share must be in (0, 1] (1: off), got "
                                  f"{self.screen_max_symbol_share}")
        if self.log_retention not in ("archive", "drop"):
            raise ForgetlessError(f"serve.log_retention must be archive or drop, got {self.log_retention!r}")
        if not 0 <= self.mix < 1:
            raise ForgetlessError(f"serve.mix must be in [0, 1), got {self.mix}")
        online_method(self.method)
        if self.screen_warmup > self.screen_window:
            raise ForgetlessError(f"serve.screen_warmup ({self.screen_warmup}) must not exceed serve.screen_window "
                                  f"({self.screen_window})")


def online_method(text: str) -> MethodSpec:
    """The one method spec of `text` (composed terms included: lora+ewc), or a one-line ForgetlessError where the
    method cannot learn from a stream: several specs, a joint arm, or a method that acts at the end of a task (a
    stream has none)."""
    specs = as_specs([text])
    if len(specs) != 1:
        raise ForgetlessError(f"--serve-method takes one method spec, got {len(specs)} in {text!r}; serve one, e.g. "
                              "lora or lora+ewc")
    method = specs[0].build()
    refuse_joint(specs[0].label, method, "serve it without joint")
    core = getattr(method, "base", method)  # a composition acts through its method
    if type(core).on_task_end is not Method.on_task_end:
        raise ForgetlessError(f"{specs[0].label} acts at the end of a task ({type(core).__name__}.on_task_end), which a "
                              "served stream never reaches, so it cannot learn online; serve full or lora instead")
    return specs[0]


class Engine:
    """`model` (on its device) with `cfg.method` attached, `tokenizer` (encode(bytes) -> (N,) ids, decode(ids)),
    `canary` (W, T+1) windows of the original text, state (snapshots, log) in `state_dir`."""

    def __init__(self, model, tokenizer, canary: torch.Tensor, block_size: int, cfg: ServeConfig, state_dir: Path,
                 mix_from: torch.Tensor | None = None):
        self.cfg, self.tokenizer, self.canary, self.block_size = cfg, tokenizer, canary, block_size
        self.state_dir = Path(state_dir)
        self.folder_lock = lock_folder(self.state_dir)
        try:
            self.wal = WriteAheadLog(self.state_dir / WAL, archive=cfg.log_retention == "archive")
            self.store = Store(self.state_dir, cfg.keep_states)
        except ForgetlessError:
            self.close()
            raise
        torch.manual_seed(cfg.seed)
        self.learner = Learner(model, online_method(cfg.method).build(), TrainConfig(lr=cfg.lr, warmup=0), canary,
                               mix_from, cfg.seed, cfg.mix)
        # the rows mixed in, by hash: a restart must mix the same ones to replay the same updates
        self.mixed = hashlib.sha256(mix_from.cpu().numpy().tobytes()).hexdigest()[:16] if self.learner.mix > 0 else None
        self.device = self.learner.device
        self.lock = threading.Lock()
        self.seq, self.snapshot_seq, self.good, self.ops = 0, 0, None, 0
        self.undone: list[list[int]] = []  # [first, last] seq of the documents each rollback undid, in order
        self.recovered: str | None = None  # how a start from a damaged snapshot recovered, in words
        self.counters = {"accepted": 0, "rollbacks": 0, "undone": 0, "score": 0, "generate": 0, "replayed": 0,
                         "yielded": 0, "paused": 0}  # learning steps that waited for generation before they began;
        # pauses of running steps at a layer boundary
        self.yield_seconds = 0.0  # how long they waited, in all
        self.deadline = 0.0  # monotonic time until which the current learning step may wait for generation
        self.rejected: dict[str, int] = {}
        self.recent: collections.deque = collections.deque(maxlen=cfg.screen_window)  # losses of accepted documents
        self.answers: collections.OrderedDict = collections.OrderedDict()  # key -> (text checksum, first answer)
        self.last_prequential, self.prequential_sum = float("nan"), 0.0
        # the dashboard's curves: (seq, prequential loss), (seq, canary loss), (seq, documents undone)
        self.history = {k: collections.deque(maxlen=HISTORY) for k in ("prequential", "canary", "rollbacks")}
        self.live: dict = {}  # the method's live_stats of the last document (Method.live_stats; APN: usage)
        self.started = time.time()
        self.batcher = Batcher(block_size)
        self.pause_handles = pause_points(self.learner.model, self.pause)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self):
        """Resume from the snapshot (or the newest intact kept state) and replay the log after it: the same
        updates, checks and rollbacks; a first start writes the first snapshot."""
        snapshot = self.starting_state()
        if snapshot is not None:
            self.restore(snapshot)
            self.ops = snapshot["meta"].get("ops", 0)
            for key, crc, answer in snapshot["meta"].get("answers", []):
                self.answers[key] = (crc, answer)
            self.recent.extend(snapshot["meta"].get("recent", []))
        else:
            self.reference = self.canary_loss()
            self.canary_last = self.reference
            self.good = self.capture()
            self.write_snapshot()
        for record in self.wal.replay(self.seq):  # streamed
            if "op" in record:
                if record["n"] > self.ops:
                    self.operate(record["op"], record.get("to"), record["n"])
                continue
            self.apply(record["seq"], record["text"], record.get("key"), form=record.get("format", "text"))
            self.counters["replayed"] += 1
        if self.recovered:
            self.write_snapshot(keep=False)
        self.publish()

    def starting_state(self) -> dict | None:
        """The snapshot; when it is missing or damaged, the newest intact kept state (said in one line:
        `recovered`); None on a first start."""
        if not (self.state_dir / SNAPSHOT).exists() and not self.store.kept:
            return None
        try:
            return self.checked(self.store.read_snapshot())
        except Damaged as e:
            problem, damaged = str(e), []
        for seq in sorted(self.store.kept, reverse=True):
            try:
                state = self.checked(self.store.read_kept(seq))
            except Damaged as e:
                damaged.append(str(e))
                self.store.drop_kept(seq)
                continue
            also = f" (also damaged, renamed *.damaged: {'; '.join(damaged)})" if damaged else ""
            self.recovered = (f"{problem}: started from the kept state {self.store.kept_folder / kept_name(seq)} and "
                              f"replayed the log after it{also}")
            log.warning("%s", self.recovered)
            return state
        raise ForgetlessError(f"{problem}, and no kept state is intact{': ' + '; '.join(damaged) if damaged else ''}; "
                              f"move {self.state_dir} away to start afresh from the base")

    @property
    def kept(self) -> dict[int, float]:
        """Seq of each kept state -> its canary loss."""
        return {seq: entry["canary"] for seq, entry in self.store.kept.items()}

    # ---- reading ---------------------------------------------------------------------------------
    def encode(self, text: str) -> torch.Tensor:  # (N,) ids
        return self.tokenizer.encode(text.encode())

    def windows(self, text: str) -> torch.Tensor:
        """(W, T+1) windows of a document (one shorter window when it holds less than a context)."""
        ids = self.encode(text)
        if len(ids) < 2:
            raise ForgetlessError("the text needs at least 2 tokens; send a longer text")
        return chunk_windows(ids, min(self.block_size, len(ids) - 1))

    @property
    def hf(self):
        """The transformers tokenizer of a pretrained base (None for a forgetless GPT's byte tokenizer)."""
        return getattr(getattr(self.tokenizer, "text", None), "hf", None)

    def template(self):
        """The transformers tokenizer when it has a chat template, else a one-line ForgetlessError."""
        if not getattr(self.hf, "chat_template", None):
            raise ForgetlessError("this base has no chat template (a forgetless GPT or a tokenizer without one); use "
                                  "/v1/completions with a plain prompt, or serve a model whose tokenizer has one")
        return self.hf

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` through the tokenizer's chat template, with the assistant's turn opened."""
        return render(self.template(), messages, add_generation_prompt=True)

    def example(self, text: str, form: str = "text"):
        """What a document trains: (W, T+1) windows of a text, or a Batch (1, T) of a prompt/answer or chat
        record (`text`: its JSON) with the prompt's labels -100 (answer-only loss; forgetless.data's readers)."""
        if form == "text":
            return self.windows(text)
        record, hf, room = json.loads(text), self.hf, self.block_size  # a row's tokens, all read by the model
        if form == "chat":
            rows = chat_rows([record["messages"]], self.template(), room)
            if not rows:
                raise ForgetlessError(f"the conversation has no assistant turn within its first {room} tokens (the "
                                      "context); end it with the answer, or shorten it")
        elif hf is not None:
            rows = prompt_rows([record["prompt"]], [record["answer"]], hf, room)
        else:  # the byte tokenizer: the rule of data.instructions.encode (the prompt keeps half a long row)
            prompt, answer = self.encode(record["prompt"]).tolist(), self.encode(record["answer"]).tolist()
            if not prompt or not answer:
                raise ForgetlessError("the prompt and the answer must not be empty; send some text in each")
            answer = answer[:room - min(len(prompt), room // 2)]
            prompt = prompt[len(prompt) + len(answer) - room:] if len(prompt) + len(answer) > room else prompt
            rows = [{"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}]
        row = rows[0]
        return Batch.of({"input_ids": torch.tensor([row["input_ids"]]), "labels": torch.tensor([row["labels"]])})

    def example_loss(self, model, example) -> float:
        """Loss (nats/token) of `model` on a document's trained tokens."""
        if torch.is_tensor(example):
            return evaluate(model, example)["loss"]
        return answer_loss(model, example.to(self.device))

    def score(self, text: str) -> dict:
        """Loss (nats/token) of `text` under the weights published when the call starts."""
        version, model = self.serving
        self.counters["score"] += 1
        result = evaluate(model, self.windows(text))
        return {"loss": result["loss"], "ppl": result["ppl"], "tokens": len(self.encode(text)), "version": version}

    def generate(self, prompt: str | list[int], max_tokens: int, temperature: float, seed: int, top_p: float = 1.0,
                 usage: dict | None = None):
        """Yield the text of up to `max_tokens` sampled tokens (greedy at temperature 0; nucleus sampling
        below `top_p`), one piece per token that completes a character, all from one published set of weights,
        sampled by the batcher with every other request's sequences (serve/batch.py). `prompt`: text, or token
        ids. With `usage` (a dict), also stop at the end-of-text token and count there the prompt and completion
        tokens and why it ended ("length" or "stop")."""
        _, model = self.serving
        self.counters["generate"] += 1
        ids = self.encode(prompt).tolist() if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ForgetlessError("the prompt is empty; send at least one character")
        eos = getattr(getattr(self.tokenizer, "text", None), "eos_id", None) if usage is not None else None
        if usage is not None:
            usage.update(prompt_tokens=len(ids), completion_tokens=0, finish_reason="length")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        sequence = self.batcher.submit(Sequence(model, ids, min(max_tokens, self.cfg.max_new_tokens), temperature,
                                                top_p, generator))
        new, sent = [], ""
        try:
            while (token := sequence.out.get()) is not DONE:
                if isinstance(token, Exception):
                    raise token
                if usage is not None:
                    usage["completion_tokens"] += 1
                    if eos is not None and token == eos:
                        usage["finish_reason"] = "stop"
                        return
                new.append(token)
                text = self.tokenizer.decode(new)
                if not text.endswith("\ufffd"):  # a character split across tokens waits for its last byte
                    yield text[len(sent):]
                    sent = text
        finally:  # ended, stopped or dropped by its client: the batcher stops sampling it
            sequence.abandoned = True

    # ---- learning --------------------------------------------------------------------------------
    def learn(self, text: str, key: str | None = None, form: str = "text") -> dict:
        """Screen document `text` of `form` (text; prompt or chat: `text` is the record's JSON; Screened when
        refused), log it (fsync), learn it, check the canary when due; returns what happened. A `key` seen before
        returns the first answer instead (KeyReused when it came with another text)."""
        windows = self.example(text, form)
        with self.lock:
            if key is not None and key in self.answers:
                return self.answered(key, text)
            self.yield_to_generation()  # the screen's forward is a learning step's too
            prequential = self.screen(text if form == "text" else self.tokenizer.decode(windows.x[0]), windows)
            seq = self.seq + 1
            self.wal.append(seq, text, key, form)
            result = self.apply(seq, text, key, windows, prequential, form)
            self.yield_to_generation()  # the copy for the readers too
            self.publish()
        return result

    def answered(self, key: str, text: str) -> dict:
        """The first answer to `key`, which must have come with the same `text`."""
        crc, answer = self.answers[key]
        if crc != text_checksum(text):
            raise KeyReused(f"key {key!r} was already sent with another text; send a new key for each document")
        return answer

    def screen(self, text: str, windows) -> float:
        """The document's loss under the current weights (of its trained tokens), or Screened (logged and counted
        by reason) when the bytes of `text` (what the model reads) are mostly one symbol or nearly constant, or its
        loss is an outlier against the last accepted ones."""
        cfg = self.cfg
        refusal = byte_screen(text.encode(), cfg)
        loss = math.nan
        if refusal is None:
            loss = self.example_loss(self.learner.model, windows)
            refusal = loss_screen(loss, list(self.recent), cfg)
        if refusal is not None:
            reason, why = refusal
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            log.warning("refused a document (%s): %s", reason, why)
            raise Screened(reason, f"document refused by the screen: {why}")
        return loss

    def remember(self, key: str | None, text: str, answer: dict):
        if key is not None:
            self.answers[key] = (text_checksum(text), answer)
            while len(self.answers) > KEYS:
                self.answers.popitem(last=False)

    def apply(self, seq: int, text: str, key: str | None = None, windows=None, prequential: float | None = None,
              form: str = "text") -> dict:
        """Learn document `seq` (also on replay): prequential loss (given when the screen measured it: the same
        number), updates, the canary when due; remember the answer under `key`, then write the snapshot when one
        is due (so it holds this document's answer: a restart from it answers a retry of the document, which the
        log after the snapshot no longer holds)."""
        windows = self.example(text, form) if windows is None else windows
        if prequential is None:
            prequential = self.example_loss(self.learner.model, windows)  # before it is learned
        if math.isfinite(prequential):
            self.recent.append(prequential)
        if self.learner.method.live_stats is not None and torch.is_tensor(windows):
            self.live = self.learner.method.live_stats(self.learner.model, windows)
        self.seq = seq
        self.counters["accepted"] += 1
        self.last_prequential = prequential
        self.prequential_sum += prequential
        self.history["prequential"].append((seq, prequential))
        rolled_back = False
        try:
            for _ in range(self.cfg.steps_per_doc):  # one update at a time: generation goes first between them
                self.yield_to_generation()
                self.learner.learn(windows, 1)
        except TrainingDiverged as e:
            log.warning("document %d: %s", seq, e)
            rolled_back = self.rollback(f"a non-finite loss on document {seq}")
        if not rolled_back and seq % self.cfg.canary_every == 0:
            self.yield_to_generation()
            rolled_back = not self.check()
        result = {"seq": seq, "prequential_loss": prequential, "updates": self.learner.steps,
                  "rolled_back": rolled_back, "canary_loss": self.canary_last}
        self.remember(key, text, result)
        if not rolled_back and seq % self.cfg.snapshot_every == 0:  # a passed check (a multiple of canary_every)
            try:
                self.write_snapshot()
            except (OSError, Unavailable) as e:  # the log holds the document: the next snapshot will do
                log.warning("the snapshot at document %d was not written (%s); the log holds the documents", seq, e)
        return result

    def yield_to_generation(self):
        """Generation has priority: before a learning step (an update, the screen's or the canary's forward, the copy
        published to the readers), wait while requests are waiting or decoding, at most `learn_wait_max` seconds
        (then the step runs beside them), a budget the step's pauses (`pause`) share. A step is never cut, and a
        document is acknowledged only once learned (it waits in the log, which a restart replays), so nothing
        acknowledged is lost."""
        self.deadline = time.monotonic() + self.cfg.learn_wait_max
        if self.cfg.learn_wait_max and self.batcher.busy():
            self.counters["yielded"] += 1
            self.wait_for_generation()

    def pause(self):
        """At a layer boundary of a learning step (`pause_points`): wait while requests are waiting or decoding,
        until the step's deadline."""
        if self.batcher.busy() and self.deadline > time.monotonic():
            self.counters["paused"] += 1
            self.wait_for_generation()

    def wait_for_generation(self):
        t0 = time.monotonic()
        self.batcher.wait_idle(max(0.0, self.deadline - t0))
        self.yield_seconds += time.monotonic() - t0

    def check(self) -> bool:
        """Score the canary: too far above the reference rolls back (False); else the state is the last good
        one (True). The caller writes the snapshot when one is due."""
        loss = self.canary_loss()
        self.canary_last = loss
        self.history["canary"].append((self.seq, loss))
        if not loss <= self.limit():  # NaN fails too
            self.rollback(f"canary loss {loss:.4f} > reference {self.reference_loss():.4f} + {self.cfg.max_canary_rise}")
            return False
        self.good = self.capture()
        return True

    def rollback(self, why: str) -> bool:
        undone = f"documents {self.good['meta']['seq'] + 1}..{self.seq}" if self.seq > self.good["meta"]["seq"] else "none"
        log.warning("rollback to document %d (%s; undone: %s)", self.good["meta"]["seq"], why, undone)
        self.restore(self.good, keep_seq=True)
        self.counters["rollbacks"] += 1
        before = sum(b - a + 1 for a, b in self.undone)
        self.undone = self.undone_ranges(self.good["meta"]["seq"])
        undone = sum(b - a + 1 for a, b in self.undone) - before  # not counting those undone before
        self.counters["undone"] += undone
        self.history["rollbacks"].append((self.seq, undone))
        self.canary_last = self.canary_loss()
        self.history["canary"].append((self.seq, self.canary_last))
        return True

    def undone_ranges(self, good_seq: int) -> list[list[int]]:
        """The undone ranges after a rollback to the state of document `good_seq` now: those before, plus the
        documents after it not undone already."""
        new, start = [], good_seq + 1
        for first, last in self.undone:  # in order, disjoint
            if first > start:
                new.append([start, min(first - 1, self.seq)])
            start = max(start, last + 1)
        new.append([start, self.seq])
        return sorted([*self.undone, *(r for r in new if r[0] <= r[1])])

    def canary_loss(self) -> float:
        return evaluate(self.learner.model, self.canary)["loss"]

    def reference_loss(self) -> float:
        """What the rollback limit is measured from: the operator's `canary_reference`, else the canary loss at
        first start (never the last good state's)."""
        return self.cfg.canary_reference or self.reference

    def limit(self) -> float:
        return self.reference_loss() + self.cfg.max_canary_rise

    def publish(self):
        """Copy the learner's weights for serving (copy-on-write: requests in flight keep the older copy)."""
        model = copy.deepcopy(self.learner.model, graph_free(self.learner.model)).eval()
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.serving = (self.seq, model)

    def release(self, name: str | None = None) -> dict:
        """Publish the last good state as the next version under STATE_DIR/publish (serve/publish.py); `name`: the
        base's, for the manifest. Returns the manifest."""
        with self.lock:
            good = self.good
            twin = detached(self.learner.adapted, good["tensors"])
        tokenizer = self.hf if self.hf is not None else self.tokenizer
        return write_version(self.state_dir / PUBLISH, twin, good["meta"], tokenizer, None, name)

    # ---- manual snapshot and rollback ------------------------------------------------------------
    def snapshot(self) -> dict:
        """Check the canary now (rolling back if it fails), then write the state to disk."""
        with self.lock:
            passed = self.operate("check")
        return {"seq": self.seq, "rolled_back": not passed, "path": str(self.state_dir / SNAPSHOT)}

    def manual_rollback(self, target: int | None = None) -> dict:
        """Restore the last good state, or the kept snapshot of document `target` (`states()`), now; it becomes
        the last good state and is written to disk (so a restart replays from it)."""
        with self.lock:
            restored = self.good["meta"]["seq"] if target is None else target
            self.operate("rollback", target)
        return {"seq": self.seq, "restored_seq": restored, "good_seq": self.good["meta"]["seq"],
                "canary_loss": self.canary_last}

    def operate(self, op: str, target: int | None = None, replayed: int | None = None) -> bool:
        """An operator's rollback (to kept state `target`, or the last good state) or check-and-snapshot, as a
        transaction: logged, then (a rollback) its snapshot written, and only then applied in memory; a failed
        write undoes the log record and changes nothing (503). `replayed`: the number of a logged one being
        replayed at start (not logged again). Returns whether a check passed."""
        state = None
        if op == "rollback":
            state = self.good if target is None else self.kept_state(target)
        n = replayed or self.ops + 1
        undo = None if replayed else self.wal.append_op(op, self.seq, n, target)
        self.ops, passed = n, True
        try:
            if op == "rollback":
                self.write_snapshot({"tensors": state["tensors"], "meta": {
                    **state["meta"], "seq": self.seq, "undone": self.undone_ranges(state["meta"]["seq"])}}, keep=False)
                why = "asked for by /v1/rollback" if target is None else \
                    f"to the kept state of document {target}, asked for by /v1/rollback"
                self.good = state
                self.rollback(why)
                self.good = self.capture()
            else:
                passed = self.check()  # applied in memory and logged: a restart does the same
                self.write_snapshot()
        except OSError as e:
            if op == "rollback":
                self.ops = n - 1
                if undo is not None:
                    self.wal.undo(undo, "holds a rollback whose snapshot could not be written")
            raise Unavailable(f"the snapshot could not be written ({e.strerror or e}); "
                              f"{'nothing changed' if op == 'rollback' else 'the check is applied and logged'}: "
                              "free space (or fix the disk) and retry") from None
        finally:
            self.publish()
        return passed

    def kept_state(self, target: int) -> dict:
        """The kept state of document `target`, its hash checked (a damaged one is dropped from the targets)."""
        if target not in self.store.kept:
            raise ForgetlessError(f"no kept state at document {target}; kept: "
                                  f"{', '.join(map(str, sorted(self.store.kept))) or 'none'} (GET /v1/states)")
        try:
            return self.checked(self.store.read_kept(target))
        except Damaged as e:
            self.store.drop_kept(target)
            raise ForgetlessError(f"{e}; it is no longer a rollback target (renamed *.damaged)") from None

    def states(self) -> dict:
        """The rollback targets: the last good state and the kept snapshots (seq, canary loss), oldest first."""
        return {"seq": self.seq, "good_seq": self.good["meta"]["seq"], "canary_reference": self.reference_loss(),
                "canary_limit": self.limit(),
                "kept": [{"seq": seq, "canary_loss": loss} for seq, loss in sorted(self.kept.items())],
                "learning": self.learning()}

    def learning(self) -> str:
        """"on", or why nothing more is acknowledged (the log is broken, or the file is no longer the log)."""
        return self.wal.problem() or "on"

    # ---- state -----------------------------------------------------------------------------------
    def capture(self) -> dict:
        """The learner's whole state, copied to the CPU: weights, optimizer, hook state, RNG."""
        learner = self.learner
        optim, groups = optimizer_tensors(learner.opt)
        tensors = {**{f"model.{k}": v for k, v in learner.model.state_dict().items()}, **optim,
                   **{f"hooks.{k}": v for k, v in learner.hooks.hook_state().items()}, "rng.torch": torch.get_rng_state()}
        if learner.sampler is not None:
            tensors["rng.sampler"] = learner.sampler.get_state()
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        meta = {"kind": "serve", "seq": self.seq, "steps": learner.steps, "optim_groups": groups,
                "reference": self.reference, "canary": self.canary_last, "method": self.cfg.method,
                "undone": [list(r) for r in self.undone], "mixed": self.mixed,
                "sampler": [learner.sampler.batch_size, learner.sampler.block_size] if learner.sampler else None}
        return {"tensors": tensors, "meta": meta}

    def restore(self, state: dict, keep_seq: bool = False):
        tensors, meta, learner = state["tensors"], state["meta"], self.learner
        try:
            learner.model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
        except RuntimeError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            detail = next((line for line in lines if "mismatch" in line or "key" in line.lower()), lines[0])[:200]
            raise ForgetlessError(f"the state in {self.state_dir} was written for another base ({detail}); serve it "
                                  "with the base it was made with, or give another --state-dir") from None
        load_optimizer(learner.opt, tensors, meta["optim_groups"])
        learner.hooks.load_hook_state({k[len("hooks."):]: v for k, v in tensors.items() if k.startswith("hooks.")})
        torch.set_rng_state(tensors["rng.torch"])
        learner.sampler = None
        if "rng.sampler" in tensors:
            rows, block = meta["sampler"]
            learner.sampler = Sampler(learner.mix_from, rows, block, learner.seed)
            learner.sampler.set_state(tensors["rng.sampler"])
        learner.steps = meta["steps"]
        self.reference, self.canary_last = meta["reference"], meta["canary"]
        if not keep_seq:
            self.seq = self.snapshot_seq = meta["seq"]
            self.undone = [list(r) for r in meta.get("undone", [])]
            self.good = state

    def write_snapshot(self, state: dict | None = None, keep: bool = True):
        """Write `state` (default: the learner's, now) as the snapshot, kept (`keep`) unless a kept state of
        this seq exists; then move the log's records before the oldest kept state out of it."""
        state = state or self.capture()
        answers = [[key, crc, answer] for key, (crc, answer) in self.answers.items()]
        self.store.save(state["tensors"], {**state["meta"], "answers": answers, "recent": list(self.recent),
                                           "ops": self.ops, "keep": keep}, keep)
        self.snapshot_seq = self.seq
        floor = min((s for s in self.store.kept if s), default=None)
        if floor is not None:
            try:
                self.wal.compact(floor)
            except Unavailable as e:
                log.warning("%s", e)

    def checked(self, state: tuple[dict, dict]) -> dict:
        tensors, meta = state
        if meta.get("kind") != "serve" or meta.get("method") != self.cfg.method:
            raise ForgetlessError(f"{self.state_dir} holds a snapshot of another method ({meta.get('method')} vs "
                                  f"{self.cfg.method}); give another --state-dir or the same --serve-method")
        if meta.get("mixed", self.mixed) != self.mixed:
            raise ForgetlessError(f"{self.state_dir} was learned with other mixed rows (--retain, --serve-mix); give the "
                                  "same ones, or another --state-dir")
        return {"tensors": tensors, "meta": meta}

    def close(self):
        """Close the log and release the state folder."""
        if hasattr(self, "wal"):
            self.wal.close()
        if hasattr(self, "batcher"):
            self.batcher.close()
        self.folder_lock.close()

    def prequential_mean(self) -> float:
        """Mean prequential loss of the accepted documents (NaN before the first)."""
        return self.prequential_sum / self.counters["accepted"] if self.counters["accepted"] else math.nan

    def metrics(self) -> dict:
        """Name -> (kind, help, value or {label: value}) for /v1/metrics."""
        mean = self.prequential_mean()
        return {
            "learn_accepted_total": ("counter", "documents accepted by /v1/learn (and replayed)", self.counters["accepted"]),
            "learn_rejected_total": ("counter", "documents refused by /v1/learn, by reason", dict(self.rejected)),
            "rollbacks_total": ("counter", "rollbacks to the last good state", self.counters["rollbacks"]),
            "replayed_total": ("counter", "documents replayed from the write-ahead log at start", self.counters["replayed"]),
            "updates_total": ("counter", "optimizer updates", self.learner.steps),
            "score_requests_total": ("counter", "/v1/score requests", self.counters["score"]),
            "generate_requests_total": ("counter", "generation requests (each choice of the OpenAI endpoints too)",
                                        self.counters["generate"]),
            "generation_forwards_total": ("counter", "forwards run by the generation batcher", self.batcher.steps),
            "generation_rows_total": ("counter", "sequences those forwards carried (rows / forwards: the mean batch)",
                                      self.batcher.rows),
            "learn_yields_total": ("counter", "learning steps that waited for generation", self.counters["yielded"]),
            "learn_pauses_total": ("counter", "pauses of running learning steps at a layer boundary for generation",
                                   self.counters["paused"]),
            "learn_yield_seconds_total": ("counter", "seconds learning steps waited for generation", self.yield_seconds),
            "canary_loss": ("gauge", "last canary loss (nats/token)", self.canary_last),
            "canary_reference_loss": ("gauge", "canary loss the rollback limit is measured from (nats/token)",
                                      self.reference_loss()),
            "prequential_loss_last": ("gauge", "loss of the last accepted document before it was learned", self.last_prequential),
            "prequential_loss_mean": ("gauge", "mean prequential loss of the accepted documents", mean),
            "sequence": ("gauge", "sequence number of the last accepted document", self.seq),
            "snapshot_sequence": ("gauge", "sequence number of the last snapshot on disk", self.snapshot_seq),
            "uptime_seconds": ("gauge", "seconds since the server started", time.time() - self.started),
        }

    def stats(self) -> dict:
        """What the dashboard draws (GET /v1/stats): counters, the curves, the method's live_stats (APN: its patch
        usage; null for others)."""
        mean = self.prequential_mean()
        return {"method": self.cfg.method, "seq": self.seq, "snapshot_seq": self.snapshot_seq,
                "updates": self.learner.steps, "counters": dict(self.counters), "rejected": dict(self.rejected),
                "canary_reference": self.reference_loss(), "canary_limit": self.limit(),
                "canary_loss": self.canary_last, "prequential_mean": mean, "uptime_seconds": time.time() - self.started,
                **{k: [list(p) for p in list(v)] for k, v in self.history.items()},  # list(deque): one C call
                "usage": None, **self.live}


def byte_screen(data: bytes, cfg: ServeConfig) -> tuple[str, str] | None:
    """(reason, why) when `data` is mostly one byte (its most frequent byte over `screen_max_symbol_share` of it),
    nearly constant or random (Shannon entropy of its bytes under `screen_min_entropy` or over
    `screen_max_entropy` bits per byte) or dominated by repeats (zlib at level 9 shrinks it below
    `screen_min_compression` of its size); else None."""
    counts = collections.Counter(data)
    if not counts:
        return None
    top, count = counts.most_common(1)[0]
    if count / len(data) > cfg.screen_max_symbol_share:
        return ("repetitive", f"byte {bytes([top])!r} is {count / len(data):.0%} of its {len(data)} bytes (more than "
                              f"{cfg.screen_max_symbol_share:.0%}: --serve-screen-max-symbol-share)")
    entropy = -sum(c / len(data) * math.log2(c / len(data)) for c in counts.values())
    if entropy < cfg.screen_min_entropy:
        return ("low-entropy", f"its bytes carry {entropy:.2f} bits each (less than {cfg.screen_min_entropy}: "
                               "--serve-screen-min-entropy)")
    if entropy > cfg.screen_max_entropy:
        return ("random", f"its bytes carry {entropy:.2f} bits each, like random characters (more than "
                          f"{cfg.screen_max_entropy}: --serve-screen-max-entropy)")
    share = len(zlib.compress(data, 9)) / len(data)
    if share < cfg.screen_min_compression:
        return ("repeated", f"it compresses to {share:.1%} of its {len(data)} bytes: mostly repeated text (less than "
                            f"{cfg.screen_min_compression:.0%}: --serve-screen-min-compression)")
    return None


def loss_screen(loss: float, recent: list[float], cfg: ServeConfig) -> tuple[str, str] | None:
    """("outlier", why) when `loss` is above median + k x spread of `recent` (the losses of the last accepted
    documents), ("memorised", why) when it is below median - low_k x spread; spread = max(1.4826 x MAD,
    min_spread x median); None before `screen_warmup` of them. A non-finite loss is an outlier."""
    if len(recent) < cfg.screen_warmup:
        return None
    median = statistics.median(recent)
    spread = max(1.4826 * statistics.median(abs(x - median) for x in recent), cfg.screen_min_spread * abs(median))
    high, low = median + cfg.screen_k * spread, median - cfg.screen_low_k * spread
    if cfg.screen_k and not loss <= high:
        return ("outlier", f"its loss {loss:.3f} nats/token is above {high:.3f} = median {median:.3f} + "
                           f"{cfg.screen_k:g} x spread {spread:.3f} of the last {len(recent)} accepted documents; if "
                           "it is good data, raise --serve-screen-k (0: no loss screen)")
    if cfg.screen_low_k and loss < low:
        return ("memorised", f"its loss {loss:.3f} nats/token is below {low:.3f} = median {median:.3f} - "
                             f"{cfg.screen_low_k:g} x spread {spread:.3f} of the last {len(recent)} accepted documents "
                             "(text the model already knows, or repeated); if it is good data, raise "
                             "--serve-screen-low-k (0: off)")
    return None


@torch.no_grad()
def answer_loss(model, batch: Batch) -> float:
    """Mean cross-entropy (nats/token) of `model` on the tokens of `batch` whose labels are not -100."""
    was_training = model.training
    model.eval()
    logits = logits_of(model, batch.x).float()                                   # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.y.flatten(), ignore_index=-100).item()
    model.train(was_training)
    return loss


def text_checksum(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def detached(adapted, tensors: dict[str, torch.Tensor]):
    """A copy of `adapted` (its model and method) holding the weights `tensors` ("model.NAME": a state's keys), so
    exporting it (a merge folds modules away) leaves the learner as it is."""
    memo = graph_free(adapted.model)
    twin = copy.deepcopy(adapted, memo)
    twin._base = {id(memo[i]) for i in adapted._base if i in memo}  # what the base owns, by the copies' ids
    twin._base_modules = {id(memo[i]) for i in adapted._base_modules if i in memo}
    twin.model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    return twin


def pause_points(model: nn.Module, pause) -> list:
    """Hooks that call `pause()` at every layer boundary of `model`'s forwards and backwards (its layers: the
    modules its ModuleLists hold): before a layer's forward, and when the gradient of a layer's output arrives.
    Only `model`'s own layers pause: the readers' copies of it carry the hooks, not the layers' identity."""
    layers = weakref.WeakSet(m for held in model.modules() if isinstance(held, nn.ModuleList) for m in held)

    def before(module, args):
        if module in layers:
            pause()

    def after(module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
        if module in layers and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: pause())

    return [h for m in layers for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]


def graph_free(model) -> dict:
    """A `copy.deepcopy` memo that copies the tensors some modules keep from their last training forward
    (APN's routing weights and auxiliary loss: not leaves, so not copyable) as None."""
    kept = [t for m in model.modules() for v in vars(m).values()
            for t in (v if isinstance(v, (tuple, list)) else (v,)) if torch.is_tensor(t) and t.grad_fn is not None]
    return {id(t): None for t in kept}
