"""The write-ahead log of `forgetless serve`: one JSON line per accepted document, fsynced before the
document is acknowledged, so a restart can replay what the last snapshot lacks."""
from __future__ import annotations

import json
import os
from pathlib import Path


class WriteAheadLog:
    """Append-only `{"seq": n, "text": ...}` lines. A torn last line (a crash mid-write) is cut off on open."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = self.read_and_repair()
        self.file = open(self.path, "ab")

    def read_and_repair(self) -> list[dict]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        records, good = [], 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line))
            except ValueError:
                break
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return records

    def append(self, seq: int, text: str):
        """Write one record and fsync it: when this returns, the document survives a crash."""
        self.file.write(json.dumps({"seq": seq, "text": text}, ensure_ascii=False).encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def after(self, seq: int) -> list[dict]:
        """Records with a sequence number above `seq`, in order (read when the log was opened)."""
        return [r for r in self.records if r["seq"] > seq]

    def close(self):
        self.file.close()
