"""The durable state folder of `forgetless serve`: its lock (one server per folder) and the write-ahead log,
one checksummed JSON line per accepted document (and per rollback or snapshot an operator asked for), written
and fsynced before it is acknowledged, so a restart can replay what the last snapshot lacks.

An append that fails (a full disk, an I/O error) is cut off again, so the log ends at its last good record and
no sequence number is used twice; where even that fails, or the file was deleted, replaced or changed in size
under the server, the log is `broken` and nothing more is acknowledged. Records before the oldest kept state
are moved out of the log after each snapshot (`compact`: to wal-archive/, or dropped); every read streams."""
from __future__ import annotations

import fcntl
import json
import os
import zlib
from pathlib import Path

from forgetless.errors import ForgetlessError

LOCK, QUARANTINE, ARCHIVE = "lock", "wal.quarantine", "wal-archive"
PRIVATE_FILE, PRIVATE_FOLDER = 0o600, 0o700
MAX_BAD = 100  # damaged lines named at most (the count goes on)


class Unavailable(ForgetlessError):
    """Learning cannot go on now (HTTP 503): an append failed and was undone, or the log is broken."""


def private_open(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    return fd


def check_folder(folder: Path):
    if folder.exists() and not folder.is_dir():
        raise ForgetlessError(f"--state-dir {folder} is a file; give a folder (it is created if missing)")


def lock_folder(folder: Path):
    """Create `folder` (private: 0700) and hold an exclusive lock on it (an open file; closing it releases the
    lock)."""
    folder = Path(folder)
    check_folder(folder)
    try:
        folder.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
        os.chmod(folder, PRIVATE_FOLDER)
        file = open(private_open(folder / LOCK, os.O_RDWR | os.O_CREAT), "a+")
    except OSError as e:
        raise ForgetlessError(f"--state-dir {folder} cannot be made or written ({e.strerror or e}); give a folder "
                              "this user can write") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        owner = file.read().strip() or "unknown"
        file.close()
        raise ForgetlessError(f"--state-dir {folder} is in use by another forgetless serve (pid {owner}); stop it "
                              "or give another --state-dir") from None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


def checksum(record: dict) -> str:
    return f"{zlib.crc32(json.dumps(record, ensure_ascii=False, sort_keys=True).encode()):08x}"


def parse(line: bytes, legacy: bool) -> tuple[dict, bool]:
    """The record on `line` and whether it holds a checksum, or ValueError saying what is wrong with it: a
    document {seq, text, [key]} or an operation {op: rollback | check, at: seq, n: its number, [to: seq]}.
    `legacy`: a document without a checksum (the format before checksums, so only before the first checksummed
    line) is accepted."""
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    crc = record.pop("crc", None)
    if "op" in record:
        if record["op"] not in ("rollback", "check") or not set(record) <= {"op", "at", "n", "to"} or \
                any(type(record.get(k, 0)) is not int for k in ("at", "n", "to")) or "at" not in record or "n" not in record:
            raise ValueError("not an {op, at, n, to} record")
        legacy = False
    elif type(record.get("seq")) is not int or not isinstance(record.get("text"), str) or \
            not set(record) <= {"seq", "text", "key", "format"} or not isinstance(record.get("key", ""), str) or \
            record.get("format", "prompt") not in ("prompt", "chat"):
        raise ValueError("not a {seq, text, key, format} record")
    if crc is None and not legacy:
        raise ValueError("no checksum")
    try:
        if crc is not None and crc != checksum(record):
            raise ValueError
    except ValueError:  # a mismatch, or text that is not Unicode
        raise ValueError("checksum mismatch") from None
    return record, crc is not None


def position(record: dict) -> tuple[int, int, int]:
    """Where a record stands in the stream: a document at (seq, 0, 0), an operation after the document it
    follows, in their order: (at, 1, n)."""
    return (record["seq"], 0, 0) if "seq" in record else (record["at"], 1, record["n"])


TORN = "torn last line"


def entries(path: Path):
    """The lines of the log at `path`, streamed, as (number, offset, line, record or None, why it is bad). A last
    line without its newline that does not parse is TORN (a write that never finished; a whole record there
    only lost its newline, and is good). A document whose sequence number repeats the one just before it
    supersedes it: only a write that failed, never acknowledged, is written again under its number."""
    held, last, n, legacy, offset = None, 0, 0, True, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                record, checked = parse(line, legacy)
                if "seq" in record:
                    if held and held[3] is not None and "seq" in held[3] and record["seq"] == last:
                        held = (*held[:3], None, f"sequence number {last} written again at line {number} (a failed "
                                                 "write, never acknowledged)")
                    elif record["seq"] <= last:
                        raise ValueError(f"sequence number {record['seq']} after {last}")
                elif record["at"] != last or record["n"] <= n:
                    raise ValueError(f"operation {record['n']} at document {record['at']} after operation {n} at "
                                     f"document {last}")
            except ValueError as e:
                if held:
                    yield held
                held = (number, offset, line, None, str(e) if line.endswith(b"\n") else TORN)
                offset += len(line)
                continue
            if held:
                yield held
            legacy = legacy and not checked
            last, n = record.get("seq", last), record.get("n", n)
            held = (number, offset, line, record, "")
            offset += len(line)
    if held:
        yield held


class WriteAheadLog:
    """Append-only records (`parse`), each one write() and fsync. On open a torn last line (a crash mid-write,
    never acknowledged) is cut off; any other bad line stops the start with a one-line error naming it and
    `forgetless serve --repair`, changing nothing. `archive`: where `compact` moves old records (else they
    are dropped)."""

    def __init__(self, path: Path, archive: bool = True):
        self.path, self.archive = Path(path), archive
        for stale in (self.path.with_name(f".{self.path.name}.tmp"), self.path.parent / ARCHIVE / ".segment.tmp"):
            stale.unlink(missing_ok=True)  # a compaction a kill interrupted (the log was not replaced yet)
        bad, count, torn, whole, self.first, self.seq, self.n = 0, 0, None, True, None, 0, 0
        first_bad = None
        for number, offset, line, record, why in entries(self.path) if self.path.exists() else ():
            whole = line.endswith(b"\n")
            if why == TORN:
                torn = offset
            elif record is None:
                first_bad, bad = first_bad or (number, why), bad + 1
            else:
                count += 1
                self.first = position(record) if self.first is None else self.first
                self.seq, self.n = record.get("seq", self.seq), record.get("n", self.n)
        if first_bad:
            number, reason = first_bad
            more = f" (and {bad - 1} more)" if bad > 1 else ""
            raise ForgetlessError(f"{self.path} line {number} is damaged ({reason}){more}; run forgetless serve "
                                  f"--repair --state-dir {self.path.parent} to move the damaged lines to "
                                  f"{self.path.parent / QUARANTINE} and keep the {count} good ones")
        self.broken: str | None = None
        self.open()
        if torn is not None:
            os.ftruncate(self.fd, torn)
        elif not whole:
            os.write(self.fd, b"\n")
        os.fsync(self.fd)
        self.size = os.fstat(self.fd).st_size

    def open(self):
        self.fd = private_open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        stat = os.fstat(self.fd)
        self.identity, self.size = (stat.st_dev, stat.st_ino), stat.st_size

    # ---- appending -------------------------------------------------------------------------------
    def append(self, seq: int, text: str, key: str | None = None, form: str = "text") -> int:
        """Write one document (of `form`: text, or prompt / chat with `text` its JSON record) and fsync it: when
        this returns, it survives a crash. Returns the log's size before it (`undo`)."""
        return self.write({"seq": seq, "text": text, **({"key": key} if key is not None else {}),
                           **({"format": form} if form != "text" else {})})

    def append_op(self, op: str, at: int, n: int, to: int | None = None) -> int:
        """Write one operation (a rollback to `to`, or the last good state; a check) after document `at`."""
        return self.write({"op": op, "at": at, "n": n, **({"to": to} if to is not None else {})})

    def write(self, record: dict) -> int:
        """Append `record`, or Unavailable with nothing left of it in the file (cut back to the last good record;
        where that fails too, or the file is no longer the log, the log is broken: nothing more is written)."""
        self.verify()
        data = (json.dumps({**record, "crc": checksum(record)}, ensure_ascii=False) + "\n").encode()
        before = self.size
        try:
            written = 0
            while written < len(data):
                written += os.write(self.fd, data[written:])
            os.fsync(self.fd)
        except OSError as e:
            self.undo(before, f"could not be written ({e.strerror or e})")
            raise Unavailable(f"the log {self.path} could not be written ({e.strerror or e}); nothing was learned "
                              "or changed: free space (or fix the disk) and retry") from None
        self.size = before + len(data)
        self.verify()
        self.seq, self.n = record.get("seq", self.seq), record.get("n", self.n)
        self.first = position(record) if self.first is None else self.first
        return before

    def undo(self, size: int, what: str = "was undone"):
        """Cut the log back to `size` bytes (the last good record), or mark it broken when that fails."""
        try:
            os.ftruncate(self.fd, size)
            os.fsync(self.fd)
            self.size = size
        except OSError as e:
            self.broken = (f"the log {self.path} {what} and could not be cut back to its last good record "
                           f"({e.strerror or e}); learning stopped: restart the server once the disk is fixed")
            raise Unavailable(self.broken) from None

    def problem(self) -> str | None:
        """Why the file at the log's path is no longer the log this server writes (deleted, replaced, changed in
        size by someone else), or None."""
        if self.broken:
            return self.broken
        try:
            there, mine = os.stat(self.path), os.fstat(self.fd)
        except FileNotFoundError:
            return f"the log {self.path} was deleted while the server ran"
        if (there.st_dev, there.st_ino) != self.identity:
            return f"the log {self.path} was replaced by another file while the server ran"
        if mine.st_size != self.size:
            return f"the log {self.path} changed size under the server ({self.size} -> {mine.st_size} bytes)"
        return None

    def verify(self):
        """Unavailable (and broken for good) when the log is not the file this server writes."""
        problem = self.problem()
        if problem:
            if not self.broken:
                self.broken = (f"{problem}; learning stopped, nothing more is acknowledged: put the log back and "
                               "restart the server (it replays the log)")
            raise Unavailable(self.broken)

    # ---- reading ---------------------------------------------------------------------------------
    def replay(self, seq: int = 0):
        """The records after document `seq` (and the operations after it), in order, streamed: the archive's
        segments, then the log."""
        last = (seq, 0, 0)
        segments = sorted((self.path.parent / ARCHIVE).glob("*.jsonl")) if self.archive else []
        for path in [s for s in segments if int(s.stem.split("-")[1]) >= seq] + [self.path]:
            for *_, record, _ in entries(path) if path.exists() else ():
                if record is not None and position(record) > last:
                    last = position(record)
                    yield record

    @property
    def records(self) -> list[dict]:
        """The documents the log (and its archive) holds, in order."""
        return [r for r in self.replay() if "seq" in r]

    def after(self, seq: int) -> list[dict]:
        """Documents with a sequence number above `seq`, in order."""
        return [r for r in self.replay(seq) if "seq" in r]

    # ---- compaction ------------------------------------------------------------------------------
    def compact(self, floor: int):
        """Move the documents up to `floor` and the operations before it out of the log: to
        wal-archive/FIRST-LAST.jsonl (or nowhere, without `archive`); the log is rewritten and renamed into
        place. A failure leaves the log as it was."""
        if self.broken or self.first is None or self.first > (floor, 0, 0):
            return
        tmp, folder = self.path.with_name(f".{self.path.name}.tmp"), self.path.parent / ARCHIVE
        moved, first, rest = [0, 0], None, None
        try:
            folder.mkdir(mode=PRIVATE_FOLDER, exist_ok=True)
            gone_tmp = folder / ".segment.tmp"
            with open(self.path, "rb") as f, open(private_open(tmp), "wb") as keep, \
                    open(private_open(gone_tmp), "wb") as gone:
                for line in f:
                    where = position(json.loads(line))
                    if rest is None and where <= (floor, 0, 0):
                        gone.write(line) if self.archive else None
                        first = where if first is None else first
                        moved = [first[0], where[0]]
                    else:
                        rest = where if rest is None else rest
                        keep.write(line)
                for out in (keep, gone):
                    out.flush()
                    os.fsync(out.fileno())
            if self.archive:
                os.replace(gone_tmp, folder / f"{moved[0]:09d}-{moved[1]:09d}.jsonl")
                fsync_path(folder)
            os.replace(tmp, self.path)
            fsync_path(self.path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise Unavailable(f"the log {self.path} could not be compacted ({e.strerror or e}); it is unchanged") \
                from None
        finally:
            (folder / ".segment.tmp").unlink(missing_ok=True)
        os.close(self.fd)
        self.open()
        self.first = rest

    def close(self):
        os.close(self.fd)


def fsync_path(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair(path: Path) -> str:
    """Move the bad lines of the log at `path` (and a torn last line) to the quarantine file beside it, keep
    every good line as it was; returns what was done, in words. Streams."""
    path = Path(path)
    quarantine, fresh = path.with_name(QUARANTINE), path.with_name(path.name + ".tmp")
    good, bad, existed = 0, [], quarantine.exists()
    with open(private_open(fresh), "wb") as keep, \
            open(private_open(quarantine, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as moved:
        for number, _, line, record, why in entries(path) if path.exists() else ():
            if record is None:
                moved.write(line if line.endswith(b"\n") else line + b"\n")
                bad.append((number, why))
            else:
                keep.write(line if line.endswith(b"\n") else line + b"\n")
                good += 1
        for out in (moved, keep):
            out.flush()
            os.fsync(out.fileno())
    if not bad:
        fresh.unlink()
        if not existed:
            quarantine.unlink()
        return f"{path}: all {good} records are good; nothing to repair"
    os.replace(fresh, path)  # the bad bytes are in the quarantine (fsynced) before the log is rewritten
    fsync_path(path.parent)
    lines = ", ".join(f"{number} ({reason})" for number, reason in bad[:MAX_BAD])
    more = f" and {len(bad) - MAX_BAD} more" if len(bad) > MAX_BAD else ""
    return f"{path}: moved line(s) {lines}{more} to {quarantine}; kept {good} good records"
