"""Fault suite of `forgetless serve` (issue 38): kill -9 at random points of a learn stream, corrupt bytes in
the write-ahead log, two servers on one state folder, and a poison stream (garbage documents among clean ones).

Model: the smoke preset's byte GPT (2 layers, width 32, context 32), pretrained `--steps` AdamW steps on the
first 33 plays of shakespeare-modern; clean documents are 1,000-character pieces of plays 34-35, the canary 16
windows of play 36, the probe 64 windows of play 37. The serve engine (`serve.engine.Engine`, the code behind
`forgetless serve` without HTTP) runs with the server's defaults except `canary_every` 4 and `snapshot_every` 8
(a short stream), on one torch thread.

- kills: one uninterrupted run of a stream (clean documents with random-byte ones among them, each sent with an
  idempotency key); then per trial a forked child runs the same stream on a fresh state folder and the parent
  sends it SIGKILL after a random delay (uniform over the uninterrupted run's time). The parent then restarts the
  engine on that folder, checks that every document the child had acknowledged is in the log, sends the stream
  again from the first unanswered document (same keys: one that was logged but not acknowledged is answered
  from the log, not learned twice) and compares every weight with the uninterrupted run's (torch.equal).
- sweep (`--sweep N`, off by default): the same, but the forked server dies (`os._exit`: no buffer flushed, as
  abrupt as kill -9) at every Nth of its crash points, deterministically: before and after each fsync, rename,
  link and unlink, the log append, the snapshot file, and each step of the engine's learn, check, rollback,
  snapshot and kept-link path (`crash_points`). The restart must also keep the same kept states and leave no
  temporary file.
- corruptions: the uninterrupted run's log in a fresh folder with one byte changed at a random place: the start
  replays it whole (then the weights equal the uninterrupted run's), or refuses with one line naming the line
  that holds the byte; then `repair` moves the damaged line(s) to the quarantine and the start replays the rest.
- two servers: a second engine on a folder a first one holds.
- poison: `--warm` clean documents, then the other clean documents with `--garbage` garbage documents (random
  bytes, random printable ASCII, one repeated character, shuffled characters of a clean document, in turn) at
  random places; arms: `guarded` (the defaults: the screen on), `canary-only` (the screen off: the canary and
  rollback alone, then an operator rollback to the kept pre-poison state), `clean` (the clean documents alone).
  Probe loss at the end against the pre-poison one; a figure of the canary over the stream.

    python benchmarks/serve_faults.py [--kills 20] [--sweep 0] [--corruptions 10] [--seed 0] [--figure PNG] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from forgetless.continual.evaluate import evaluate
from forgetless.continual.learner import chunk_windows
from forgetless.data.corpora import load_corpus
from forgetless.data.tokenizers import ByteTokenizer
from forgetless.errors import ForgetlessError
from forgetless.models.gpt import GPT
from forgetless.presets import build_config
from forgetless.serve import wal
from forgetless.serve.engine import KEPT, WAL, Engine, Screened, ServeConfig, kept_name

CORPUS = "shakespeare-modern"
SERVE = {"canary_every": 4, "snapshot_every": 8}  # else the server's defaults
# the kill and corruption streams: a tight canary, so the replay has rollbacks; the entropy screen off, so their
# random-byte documents reach the learner (in the warm-up) as before it existed
KILL = {"method": "full", "lr": 3e-3, "max_canary_rise": 0.02, "screen_max_entropy": 8.0}


class Setup:
    """The pretrained base, the canary, the probe and the clean documents."""

    def __init__(self, steps: int, seed: int, n_docs: int = 64, doc_chars: int = 1000):
        self.doc_chars = doc_chars
        plays = [d.data.decode("utf-8", "ignore") for d in load_corpus(CORPUS).docs]
        tok = ByteTokenizer()
        self.cfg = build_config("smoke").model
        self.block = self.cfg.block_size
        self.canary = chunk_windows(tok.encode(plays[35].encode()), self.block)[:16]
        self.probe = chunk_windows(tok.encode(plays[36].encode()), self.block)[:64]
        held = plays[33] + plays[34]
        self.docs = [held[i * doc_chars:(i + 1) * doc_chars] for i in range(n_docs)]
        torch.manual_seed(seed)
        model = GPT(self.cfg)
        train = chunk_windows(tok.encode("".join(plays[:33]).encode()), self.block)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            batch = train[torch.randint(len(train), (32,), generator=g)]
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def engine(self, state_dir: Path, **options) -> Engine:
        model = GPT(self.cfg)
        model.load_state_dict(self.base)
        return Engine(model, ByteTokenizer(), self.canary, self.block, ServeConfig(**{**SERVE, **options}), state_dir)

    def probe_loss(self, engine: Engine) -> float:
        return evaluate(engine.learner.model, self.probe)["loss"]


def garbage(kind: int, rng: random.Random, clean: str, n: int) -> str:
    if kind == 0:
        return "".join(chr(rng.randrange(256)) for _ in range(n))          # random bytes (as code points)
    if kind == 1:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(n))      # random printable ASCII
    if kind == 2:
        return rng.choice("aeZ!.") * n                                     # one repeated character
    chars = list(clean)
    rng.shuffle(chars)                                                     # a clean document's characters, shuffled
    return "".join(chars)


def weights(engine: Engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.learner.model.state_dict().items()}


def send(engine: Engine, stream: list[str], start: int = 0, answered=None) -> list:
    """Learn stream[start:] with keys d0, d1, ...; returns the answers (the screen's refusals as their reason).
    `answered(i, answer)` is called after each one (the client's side: what was acknowledged)."""
    out = []
    for i in range(start, len(stream)):
        try:
            answer = engine.learn(stream[i], key=f"d{i}")
        except Screened as e:
            answer = {"refused": e.reason}
        out.append(answer)
        if answered:
            answered(i, answer)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_stream(setup: Setup, rng: random.Random) -> list[str]:
    docs = list(setup.docs[:8])
    for at in (2, 3, 4, 9):  # random bytes among them: in the screen's warm-up (learned) and after (refused)
        docs.insert(at, garbage(0, rng, "", setup.doc_chars))
    return docs


def serve_in_child(setup: Setup, stream: list[str], folder: Path, acks: Path, die_at: int = 0,
                   points: Path | None = None) -> int:
    """Fork a server that runs `stream` on `folder`, appending "i seq" to `acks` after each answer (what its
    client saw acknowledged; seq -1: refused); returns its pid. `die_at` k > 0: it dies (os._exit, as abruptly
    as kill -9: no buffer flushed) at its k-th crash point (`crash_points`); `points`: append their names there."""
    fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            point = crash_points(die_at, points) if die_at or points else lambda name: None
            engine = setup.engine(folder, **KILL)

            def answered(i, a):
                os.write(fd, f"{i} {a.get('seq', -1)}\n".encode())
                point(f"acknowledged {i}")
            send(engine, stream, answered=answered)
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    os.close(fd)
    return pid


DIED = 9  # the exit status of a child that died at its crash point


def crash_points(die_at: int, points: Path | None):
    """In a forked child: count the crash points (before and after each file system call that makes state
    durable, and each step of the engine's learn, snapshot and rollback paths) and die at the `die_at`-th;
    returns the function that marks one (the caller's own points)."""
    import forgetless.serve.store as store
    from forgetless.continual.learner import Learner
    count = [0]
    names = open(points, "a") if points else None

    def point(name: str):
        count[0] += 1
        if names:
            names.write(f"{count[0]} {name}\n")
            names.flush()
        if count[0] == die_at:
            os._exit(DIED)

    def wrap(owner, attr: str, label: str):
        inner = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            point(f"before {label}")
            out = inner(*args, **kwargs)
            point(f"after {label}")
            return out
        setattr(owner, attr, wrapped)

    for attr in ("fsync", "replace", "link", "unlink", "truncate", "ftruncate"):
        wrap(os, attr, f"os.{attr}")
    wrap(store, "save_file", "save_file")
    wrap(store.Store, "write_manifest", "Store.write_manifest")
    wrap(wal.WriteAheadLog, "append", "wal.append")
    wrap(wal.WriteAheadLog, "compact", "wal.compact")
    wrap(Learner, "learn", "Learner.learn")
    for attr in ("apply", "check", "rollback", "write_snapshot", "publish", "remember"):
        wrap(Engine, attr, f"Engine.{attr}")
    return point


def recover(setup: Setup, stream: list[str], folder: Path, acks: Path, whole: dict, trial: dict) -> dict:
    """Restart on the folder a killed server left, check that every document it acknowledged (`acks`) is in the
    log, send the stream again from the first unacknowledged document (same keys) and compare the weights, the
    answers and the kept states with the uninterrupted run's (`whole`: weights, answers, kept); no unfinished
    file may be left. The trial's record (`ok`: all held)."""
    expected, answers = whole["weights"], whole["answers"]
    acked = [tuple(map(int, line.split())) for line in acks.read_text().splitlines()]
    log = (folder / WAL).read_bytes() if (folder / WAL).exists() else b""
    trial = {**trial, "acknowledged": len(acked), "torn_tail": bool(log) and not log.endswith(b"\n")}
    try:
        engine = setup.engine(folder, **KILL)
    except ForgetlessError as e:
        return {**trial, "ok": False, "error": str(e)}
    logged = {r["seq"]: r["text"] for r in engine.wal.records}
    trial["lost"] = [i for i, seq in acked if seq >= 0 and logged.get(seq) != stream[i]]
    trial["logged_unacknowledged"] = len(logged) - sum(seq >= 0 for _, seq in acked)
    trial["replayed"] = engine.counters["replayed"]
    resent = send(engine, stream, start=len(acked))
    trial["same_weights"] = same(weights(engine), expected)
    trial["same_answers"] = answers[len(acked):] == resent
    if not trial["same_answers"]:
        trial["answers"] = [answers[len(acked):], resent]
    trial["same_kept"] = sorted(engine.kept) == whole["kept"] and sorted(
        p.name for p in (folder / KEPT).iterdir()) == [kept_name(seq) for seq in whole["kept"]]
    trial["leftovers"] = sorted(str(p.relative_to(folder)) for p in folder.rglob(".*tmp*"))
    trial["ok"] = not trial["lost"] and trial["same_weights"] and trial["same_answers"] and trial["same_kept"] and \
        not trial["leftovers"]
    engine.close()
    shutil.rmtree(folder)
    return trial


def kills(setup: Setup, n: int, seed: int, root: Path) -> dict:
    """kill -9 at `n` random points of a learn stream; each restart must end in the uninterrupted weights."""
    rng = random.Random(seed)
    stream = kill_stream(setup, rng)
    t0 = time.perf_counter()
    whole = setup.engine(root / "whole", **KILL)
    answers = send(whole, stream)
    seconds = time.perf_counter() - t0
    reference = {"weights": weights(whole), "answers": answers, "kept": sorted(whole.kept)}
    whole.close()
    t0 = time.perf_counter()
    _, status = os.waitpid(serve_in_child(setup, stream, root / "timed", root / "timed.acks"), 0)
    child = time.perf_counter() - t0  # a forked server's run: the kills fall within it
    assert status == 0, "the timed run failed (its traceback is above)"
    summary = {"rollbacks": whole.counters["rollbacks"], "refused": sum("refused" in a for a in answers),
               "documents": len(stream), "uninterrupted_s": round(seconds, 3), "child_s": round(child, 3)}
    trials, attempts = [], 0
    while len(trials) < n and attempts < 3 * n:
        attempts += 1
        folder, acks = root / f"kill{attempts}", root / f"kill{attempts}.acks"
        delay = rng.uniform(0, child)
        pid = serve_in_child(setup, stream, folder, acks)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not os.WIFSIGNALED(status):
            if os.WEXITSTATUS(status):
                raise AssertionError("the killed run failed on its own (its traceback is above)")
            child = min(child, delay)  # it ran faster than the timed run: aim the next kills earlier
            continue  # it finished before the kill: not a trial
        trials.append(recover(setup, stream, folder, acks, reference, {"delay_s": round(delay, 3)}))
    survived = sum(t["ok"] for t in trials)
    return {**summary, "kills": len(trials), "survived": survived, "attempts": attempts, "trials": trials}


def disk_faults(setup: Setup, n: int, seed: int, root: Path) -> dict:
    """A full disk at `n` random points of the kill stream: the k-th write or fsync of the log, or the k-th
    snapshot file, fails with ENOSPC (k drawn uniformly over the uninterrupted run's calls after its start). The client resends a document
    answered 503 (same key); the stream must end in the uninterrupted weights and answers, every sequence number
    used once, and a restart must replay to the same weights."""
    import errno

    from forgetless.serve import store
    rng = random.Random(seed)
    stream = kill_stream(setup, random.Random(seed))
    whole = setup.engine(root / "whole", **KILL)
    answers, expected = send(whole, stream), weights(whole)
    accepted = len(whole.wal.records)  # the log's writes and fsyncs; its snapshots: one per snapshot_every
    whole.close()
    trials = []
    for trial in range(n):
        kind = ("write", "fsync", "save_file")[trial % 3]
        calls, owner = [0], store if kind == "save_file" else os
        at = rng.randint(1, accepted if kind != "save_file" else max(1, accepted // SERVE["snapshot_every"]))
        folder, real = root / f"disk{trial}", getattr(owner, kind)
        engine = setup.engine(folder, **KILL)

        def failing(*args, kind=kind, at=at, real=real, engine=engine, **kwargs):
            if kind == "save_file" or args[0] == engine.wal.fd:  # the log's calls, or any snapshot
                calls[0] += 1
                if calls[0] == at:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)
        setattr(owner, kind, failing)
        got, unavailable = [], 0
        try:
            for i, doc in enumerate(stream):
                for _ in range(2):  # a 503 is resent once (the disk has room again)
                    try:
                        got.append(engine.learn(doc, key=f"d{i}"))
                    except Screened as e:
                        got.append({"refused": e.reason})
                    except wal.Unavailable:
                        unavailable += 1
                        continue
                    break
        finally:
            setattr(owner, kind, real)
        seqs = [r["seq"] for r in engine.wal.records]
        trial = {"kind": kind, "at": at, "failed": calls[0] >= at, "answered_503": unavailable,
                 "same_answers": got == answers, "same_weights": same(weights(engine), expected),
                 "seqs_once": seqs == list(range(1, len(seqs) + 1))}
        engine.close()
        again = setup.engine(folder, **KILL)
        trial["restart_same_weights"] = same(weights(again), expected)
        trial["ok"] = all(trial[k] for k in ("same_answers", "same_weights", "seqs_once", "restart_same_weights"))
        trials.append(trial)
        again.close()
        shutil.rmtree(folder)
    return {"trials": trials, "faults": sum(t["failed"] for t in trials), "survived": sum(t["ok"] for t in trials),
            "answered_503": sum(t["answered_503"] for t in trials), "documents": len(stream)}


def sweep(setup: Setup, root: Path, every: int = 1) -> dict:
    """Die at every `every`-th crash point of the kill stream (deterministic, unlike the timed kills); each
    restart must lose no acknowledged document and end in the uninterrupted weights and answers."""
    stream = kill_stream(setup, random.Random(0))
    whole = setup.engine(root / "whole", **KILL)
    reference = {"answers": send(whole, stream), "weights": weights(whole), "kept": sorted(whole.kept)}
    whole.close()
    names = root / "points"
    _, status = os.waitpid(serve_in_child(setup, stream, root / "count", root / "count.acks", points=names), 0)
    assert status == 0, "the counting run failed (its traceback is above)"
    listed = [line.split(" ", 1) for line in names.read_text().splitlines()]
    trials = []
    for k, name in listed[::every]:
        folder, acks = root / f"point{k}", root / f"point{k}.acks"
        _, status = os.waitpid(serve_in_child(setup, stream, folder, acks, die_at=int(k)), 0)
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == DIED):
            raise AssertionError(f"the run meant to die at point {k} ({name}) ended otherwise: status {status}")
        trials.append(recover(setup, stream, folder, acks, reference, {"point": int(k), "at": name}))
    return {"points": len(listed), "tried": len(trials), "survived": sum(t["ok"] for t in trials),
            "failed": [t for t in trials if not t["ok"]], "trials": trials}


def corruptions(setup: Setup, n: int, seed: int, root: Path) -> dict:
    """One byte changed at `n` random places of a real log: loads whole with the same weights, or a one-line
    refusal naming the line; repair keeps every other record and the start replays them."""
    rng = random.Random(seed)
    stream = kill_stream(setup, random.Random(seed))
    first = setup.engine(root / "log", **KILL)
    send(first, stream)
    expected = weights(first)
    first.close()
    lines = (root / "log" / WAL).read_bytes().splitlines(keepends=True)
    trials = []
    for trial in range(n):
        folder = root / f"corrupt{trial}"
        folder.mkdir()
        data = bytearray(b"".join(lines))
        at = rng.randrange(len(data))
        hit = sum(len(b"".join(lines[:i + 1])) <= at for i in range(len(lines))) + 1  # line holding byte `at`
        damaged = {hit, hit + 1} if data[at] == ord("\n") and hit < len(lines) else {hit}
        data[at] = (data[at] + rng.randrange(1, 256)) % 256
        (folder / WAL).write_bytes(bytes(data))
        result = {"byte": at, "line": hit}
        try:
            engine = setup.engine(folder, **KILL)
            result["outcome"] = "loaded whole"
            result["ok"] = len(engine.wal.records) == len(lines) and same(weights(engine), expected)
        except ForgetlessError as e:
            message = str(e)
            result["outcome"] = "refused"
            result["message"] = message
            named = f"line {hit} is damaged" in message and "--repair" in message and "\n" not in message
            wal.repair(folder / WAL)
            quarantined = (folder / wal.QUARANTINE).read_bytes()
            engine = setup.engine(folder, **KILL)
            kept = [r["seq"] for r in engine.wal.records]
            originals = [json.loads(line)["seq"] for line in lines]
            result["lost_records"] = sorted(damaged)  # the damaged line(s), now in the quarantine
            result["ok"] = named and bool(quarantined) and \
                kept == [s for i, s in enumerate(originals, 1) if i not in damaged]
        engine.close()
        trials.append(result)
    return {"corruptions": n, "handled": sum(t["ok"] for t in trials),
            "refused": sum(t["outcome"] == "refused" for t in trials), "trials": trials}


def two_servers(setup: Setup, root: Path) -> dict:
    first = setup.engine(root / "shared")
    try:
        setup.engine(root / "shared").close()
        return {"refused": False}
    except ForgetlessError as e:
        return {"refused": "in use by another forgetless serve" in str(e), "message": str(e)}
    finally:
        first.close()


def poison(setup: Setup, seed: int, warm: int, n_garbage: int, root: Path) -> dict:
    """Clean documents with garbage among them, three arms; canary over the stream, probe at the end."""
    rng = random.Random(seed)
    clean = setup.docs
    tail = [("clean", d) for d in clean[warm:]]
    for i in range(n_garbage):
        tail.insert(rng.randrange(len(tail) + 1), ("garbage", garbage(i % 4, rng, clean[rng.randrange(warm)], setup.doc_chars)))
    stream = [("clean", d) for d in clean[:warm]] + tail
    arms = {"guarded": ({}, stream),
            "canary-only": ({"screen_k": 0.0, "screen_low_k": 0.0, "screen_max_symbol_share": 1.0,
                             "screen_min_entropy": 0.0, "screen_max_entropy": 8.0, "screen_min_compression": 0.0},
                            stream),
            "clean": ({}, [s for s in stream if s[0] == "clean"])}
    out = {"documents": len(stream), "garbage": n_garbage, "warm": warm, "keep_states": 16}
    for name, (options, docs) in arms.items():
        engine = setup.engine(root / name, keep_states=16, **options)  # the pre-poison snapshot stays kept
        send(engine, [d for _, d in docs[:warm]])
        pre = {"seq": engine.seq, "probe": setup.probe_loss(engine), "canary": engine.canary_loss()}
        canary, refused, learned_garbage = [], [], 0
        for i, (kind, doc) in enumerate(docs[warm:], warm):
            try:
                answer = engine.learn(doc, key=f"d{i}")
                learned_garbage += kind == "garbage"
                canary.append([i, kind, engine.canary_loss(), answer["rolled_back"]])
            except Screened as e:
                refused.append([i, kind, e.reason])
                canary.append([i, kind, engine.canary_loss(), False])
        arm = {"pre": pre, "end_probe": setup.probe_loss(engine), "end_canary": engine.canary_loss(),
               "reference": engine.reference_loss(), "limit": engine.limit(),
               "rollbacks": [list(r) for r in engine.history["rollbacks"]], "refused": refused,
               "refused_garbage": sum(k == "garbage" for _, k, _ in refused),
               "refused_clean": sum(k == "clean" for _, k, _ in refused), "learned_garbage": learned_garbage,
               "canary": canary, "kept": sorted(engine.kept)}
        if name == "canary-only":  # the operator rolls back to the kept pre-poison state
            back = engine.manual_rollback(pre["seq"])
            arm["operator_rollback"] = {**back, "probe": setup.probe_loss(engine)}
        out[name] = arm
        engine.close()
    out["guarded_vs_pre"] = out["guarded"]["end_probe"] - out["guarded"]["pre"]["probe"]
    out["guarded_vs_clean"] = out["guarded"]["end_probe"] - out["clean"]["end_probe"]
    return out


def figure(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = result["poison"]
    fig, ax = plt.subplots(figsize=(7.5, 3.4), dpi=100)
    colors = {"guarded": "tab:blue", "canary-only": "tab:red", "clean": "tab:green"}
    style = {"guarded": {"lw": 3.0, "alpha": 0.5}, "canary-only": {"lw": 1.2}, "clean": {"lw": 1.0, "ls": "--"}}
    for name in ("canary-only", "guarded", "clean"):
        arm = p[name]
        xs = [c[0] for c in arm["canary"]] if name != "clean" else None
        ys = [c[2] for c in arm["canary"]]
        if name == "clean":  # its stream lacks the garbage: place its points at the clean documents' positions
            xs = [c[0] for c in p["guarded"]["canary"] if c[1] == "clean"]
        ax.plot(xs, ys, color=colors[name], label=name, **style[name])
        rolls = [c[0] for c in arm["canary"] if c[3]]
        if rolls:
            ax.scatter(rolls, [c[2] for c in arm["canary"] if c[3]], color=colors[name], marker="v", s=25, zorder=3,
                       label=f"{name}: rollback")
    o, last = p["canary-only"], p["canary-only"]["canary"][-1][0]
    ax.scatter([last + 1], [o["operator_rollback"]["canary_loss"]], color=colors["canary-only"], marker="*", s=60,
               zorder=3, label=f"canary-only after /v1/rollback to kept {o['operator_rollback']['restored_seq']}")
    g = p["guarded"]
    ax.axhline(g["reference"], color="gray", lw=0.8, ls=":", label="reference (first start)")
    ax.axhline(g["limit"], color="gray", lw=0.8, ls="--", label="rollback limit")
    for c in g["canary"]:
        if c[1] == "garbage":
            ax.axvline(c[0], color="black", alpha=0.12, lw=2)
    ax.set_xlabel("document of the stream (gray bars: garbage)")
    ax.set_ylabel("canary loss (nats/token)")
    ax.set_title("serve poison stream: canary after each document", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--corruptions", type=int, default=10)
    parser.add_argument("--disk", type=int, default=12, help="random full-disk faults (log write, log fsync, snapshot)")
    parser.add_argument("--sweep", type=int, default=0, help="also die at every Nth crash point of the kill stream "
                        "(1: all of them; 0: no sweep)")
    parser.add_argument("--poison", action=argparse.BooleanOptionalAction, default=True, help="run the poison stream")
    parser.add_argument("--garbage", type=int, default=16, help="garbage documents in the poison stream")
    parser.add_argument("--warm", type=int, default=16, help="clean documents before the poison (a snapshot multiple)")
    parser.add_argument("--clean", type=int, default=64, help="clean documents (the poison stream's; the kill "
                        "stream takes the first 8)")
    parser.add_argument("--doc-chars", type=int, default=1000, help="characters of each document")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps of the base")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", type=Path, help="PNG of the poison stream")
    parser.add_argument("--json", type=Path, help="write the whole result here")
    args = parser.parse_args(argv)
    if args.warm % SERVE["snapshot_every"] or not 0 < args.warm < args.clean or args.clean < 8:
        parser.error(f"--warm must be a positive multiple of {SERVE['snapshot_every']} (a kept snapshot) below "
                     "--clean, and --clean at least 8")
    torch.set_num_threads(1)  # also keeps fork safe (no OpenMP pool in the parent)
    logging.getLogger("forgetless.serve").setLevel(logging.ERROR)  # the refusals and rollbacks are in the result
    t0 = time.perf_counter()
    setup = Setup(args.steps, args.seed, args.clean, args.doc_chars)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "serve": {**SERVE, "method": ServeConfig().method}, "kill_serve": KILL}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        timings = {"setup_s": time.perf_counter() - t0}
        for name, run in (("kills", lambda: kills(setup, args.kills, args.seed, root / "k")),
                          ("sweep", lambda: sweep(setup, root / "s", args.sweep)),
                          ("corruptions", lambda: corruptions(setup, args.corruptions, args.seed, root / "c")),
                          ("disk", lambda: disk_faults(setup, args.disk, args.seed, root / "d")),
                          ("two_servers", lambda: two_servers(setup, root / "t")),
                          ("poison", lambda: poison(setup, args.seed, args.warm, args.garbage, root / "p"))):
            if (name == "kills" and not args.kills) or (name == "sweep" and not args.sweep) or (name == "corruptions" and not args.corruptions) or \
                    (name == "disk" and not args.disk) or \
                    (name == "poison" and not args.poison):
                continue
            (root / name[0]).mkdir(exist_ok=True)
            t = time.perf_counter()
            result[name] = run()
            timings[f"{name}_s"] = time.perf_counter() - t
    result["timings"] = {k: round(v, 2) for k, v in timings.items()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.figure and "poison" in result:
        figure(result, args.figure)
    report(result)
    return result


def report(r: dict):
    if "kills" in r:
        k = r["kills"]
        print(f"kills: {k['survived']}/{k['kills']} survived (same weights as the uninterrupted run; stream of "
              f"{k['documents']} documents, {k['rollbacks']} rollback(s), {k['refused']} refused; "
              f"{k['attempts'] - k['kills']} child(ren) finished before the kill); acknowledged at the kill: "
              f"{sorted(t['acknowledged'] for t in k['trials'])}; logged but unacknowledged: "
              f"{sum(t.get('logged_unacknowledged', 0) > 0 for t in k['trials'])}; torn tails cut: "
              f"{sum(t['torn_tail'] for t in k['trials'])}")
    if "sweep" in r:
        w = r["sweep"]
        print(f"crash points: {w['survived']}/{w['tried']} survived (of {w['points']} points); failed at: "
              f"{[t['at'] for t in w['failed']]}")
    if "corruptions" in r:
        c = r["corruptions"]
        print(f"corruptions: {c['handled']}/{c['corruptions']} handled ({c['refused']} refused naming the line, "
              f"repaired; {c['corruptions'] - c['refused']} loaded whole with the same weights)")
    if "disk" in r:
        d = r["disk"]
        print(f"full disk: {d['survived']}/{len(d['trials'])} survived ({d['faults']} faults hit: "
              f"{sum(t['failed'] and t['kind'] != 'save_file' for t in d['trials'])} log writes/fsyncs, "
              f"{sum(t['failed'] and t['kind'] == 'save_file' for t in d['trials'])} snapshots; {d['answered_503']} "
              "answered 503 and resent)")
    if "two_servers" in r:
        print(f"two servers on one folder: {'refused' if r['two_servers']['refused'] else 'NOT refused'}: "
              f"{r['two_servers'].get('message', '')}")
    if "poison" in r:
        p = r["poison"]
        print(f"poison: {p['garbage']} garbage among {p['documents'] - p['garbage']} clean documents")
        for name in ("guarded", "canary-only", "clean"):
            a = p[name]
            print(f"  {name:12s} probe pre {a['pre']['probe']:.4f} end {a['end_probe']:.4f} "
                  f"({a['end_probe'] - a['pre']['probe']:+.4f}); canary pre {a['pre']['canary']:.4f} end "
                  f"{a['end_canary']:.4f} max {max(c[2] for c in a['canary']):.4f} (limit {a['limit']:.4f}); "
                  f"refused {a['refused_garbage']} garbage, {a['refused_clean']} clean; learned garbage "
                  f"{a['learned_garbage']}; rollbacks [seq, undone] {a['rollbacks']}")
        o = p["canary-only"]["operator_rollback"]
        print(f"  canary-only, then /v1/rollback to the kept pre-poison state {o['restored_seq']}: probe "
              f"{o['probe']:.4f} (pre-poison {p['canary-only']['pre']['probe']:.4f})")
        print(f"  guarded: end probe - pre-poison {p['guarded_vs_pre']:+.4f} nats; - clean-only end "
              f"{p['guarded_vs_clean']:+.4f}")
    print("timings (s):", r["timings"])


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
