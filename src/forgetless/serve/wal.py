"""The durable state folder of `forgetless serve`: its lock (one server per folder) and the write-ahead log,
one checksummed JSON line per accepted document, fsynced before the document is acknowledged, so a restart
can replay what the last snapshot lacks."""
from __future__ import annotations

import fcntl
import json
import os
import zlib
from pathlib import Path

from forgetless.errors import ForgetlessError

LOCK, QUARANTINE = "lock", "wal.quarantine"


def check_folder(folder: Path):
    if folder.exists() and not folder.is_dir():
        raise ForgetlessError(f"--state-dir {folder} is a file; give a folder (it is created if missing)")


def lock_folder(folder: Path):
    """Create `folder` and hold an exclusive lock on it (an open file; closing it releases the lock)."""
    folder = Path(folder)
    check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    file = open(folder / LOCK, "a+")
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
    """The record on `line` and whether it holds a checksum, or ValueError saying what is wrong with it.
    `legacy`: a line without a checksum (the format before checksums, so only before the first checksummed
    line) is accepted."""
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    crc = record.pop("crc", None)
    if type(record.get("seq")) is not int or not isinstance(record.get("text"), str) or \
            not set(record) <= {"seq", "text", "key"} or not isinstance(record.get("key", ""), str):
        raise ValueError("not a {seq, text, key} record")
    if crc is None and not legacy:
        raise ValueError("no checksum")
    try:
        if crc is not None and crc != checksum(record):
            raise ValueError
    except ValueError:  # a mismatch, or text that is not Unicode
        raise ValueError("checksum mismatch") from None
    return record, crc is not None


def scan(data: bytes) -> tuple[list[tuple[int, bytes, dict]], list[tuple[int, bytes, str]], bytes]:
    """The log's good records (line number, line with its newline, record), its bad lines (number, line,
    reason) and the torn tail: an unreadable rest after the last newline (a write that never finished; a
    whole record there only lost its newline, and is good)."""
    *lines, tail = data.split(b"\n")
    good, bad, torn, last, legacy = [], [], b"", 0, True
    for number, line in enumerate(lines + [tail] if tail else lines, 1):
        try:
            record, checked = parse(line, legacy)
            if record["seq"] <= last:
                raise ValueError(f"sequence number {record['seq']} after {last}")
        except ValueError as e:
            if number > len(lines):
                torn = line
            else:
                bad.append((number, line + b"\n", str(e)))
            continue
        legacy, last = legacy and not checked, record["seq"]
        good.append((number, line + b"\n", record))
    return good, bad, torn


class WriteAheadLog:
    """Append-only `{"seq", "text", ["key",] "crc"}` lines. On open a torn last line (a crash mid-write,
    never acknowledged) is cut off; any other bad line stops the start with a one-line error naming it
    and `forgetless serve --repair`, changing nothing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data = self.path.read_bytes() if self.path.exists() else b""
        good, bad, torn = scan(data)
        if bad:
            number, _, reason = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ForgetlessError(f"{self.path} line {number} is damaged ({reason}){more}; run forgetless serve "
                                  f"--repair --state-dir {self.path.parent} to move the damaged lines to "
                                  f"{self.path.parent / QUARANTINE} and keep the {len(good)} good ones")
        self.records = [record for _, _, record in good]
        self.file = open(self.path, "ab")
        if torn:
            self.file.truncate(len(data) - len(torn))
        elif not data.endswith(b"\n") and data:
            self.file.write(b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def append(self, seq: int, text: str, key: str | None = None):
        """Write one record and fsync it: when this returns, the document survives a crash."""
        record = {"seq": seq, "text": text, **({"key": key} if key is not None else {})}
        line = json.dumps({**record, "crc": checksum(record)}, ensure_ascii=False)
        self.file.write(line.encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def after(self, seq: int) -> list[dict]:
        """Records with a sequence number above `seq`, in order (read when the log was opened)."""
        return [r for r in self.records if r["seq"] > seq]

    def close(self):
        self.file.close()


def repair(path: Path) -> str:
    """Move the bad lines of the log at `path` (and a torn last line) to the quarantine file beside it, keep
    every good line as it was; returns what was done, in words."""
    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    good, bad, torn = scan(data)
    if torn:
        bad.append((len(good) + len(bad) + 1, torn, "torn last line"))
    if not bad:
        return f"{path}: all {len(good)} records are good; nothing to repair"
    quarantine = path.with_name(QUARANTINE)
    with open(quarantine, "ab") as f:  # first keep the bad bytes, then rewrite the log
        f.write(b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line, _ in bad))
        os.fsync(f.fileno())
    fresh = path.with_name(path.name + ".tmp")
    with open(fresh, "wb") as f:
        f.write(b"".join(line for _, line, _ in good))
        os.fsync(f.fileno())
    os.replace(fresh, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    lines = ", ".join(f"{number} ({reason})" for number, _, reason in bad)
    return f"{path}: moved line(s) {lines} to {quarantine}; kept {len(good)} good records"
