"""The snapshots of `forgetless serve`: `snapshot.safetensors` (the state a restart resumes from) and the kept
states (`kept/SEQ.safetensors`, each its own file: /v1/rollback targets and fallbacks), with their SHA-256
recorded in `manifest.json`. A state is written whole and fsynced, the manifest naming it is written next, and
only then is it renamed into place: the file under each name always matches a hash the manifest lists, so a
file that does not is damaged, never half-written. Every file is private (0600) in a private folder (0700)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from forgetless.checkpoint import FORMAT, load_checkpoint, private_folder, remove_unfinished, shared
from forgetless.errors import ForgetlessError
from forgetless.serve.wal import fsync_path

log = logging.getLogger("forgetless.serve")
SNAPSHOT, KEPT, MANIFEST = "snapshot.safetensors", "kept", "manifest.json"
PRIVATE_FILE = 0o600


class Damaged(ForgetlessError):
    """A snapshot or kept state whose bytes do not match the manifest, or that cannot be read."""


def kept_name(seq: int) -> str:
    return f"{seq:09d}.safetensors"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def durable_copy(source: Path, target: Path):
    """Copy `source` to `target` (a new private file, fsynced)."""
    with open(source, "rb") as src, open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())


class Store:
    """The snapshot, the kept states and the manifest of one state folder: {"snapshots": [sha256, ...] (the
    snapshot file matches one of them: the last two written), "kept": {seq: {"sha256", "canary"}}}."""

    def __init__(self, folder: Path, keep_states: int):
        self.folder, self.keep_states = Path(folder), keep_states
        self.kept_folder = self.folder / KEPT
        self.kept_folder.mkdir(mode=0o700, exist_ok=True)
        for stale in [*self.folder.glob(f".{SNAPSHOT}.tmp-*"), *self.kept_folder.glob(".*.tmp"),
                      self.folder / f".{MANIFEST}.tmp"]:
            remove_unfinished(stale)  # what a kill left unfinished (never renamed: never read)
        path = self.folder / MANIFEST
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
                self.snapshots = list(manifest["snapshots"])
                self.kept = {int(seq): dict(entry) for seq, entry in manifest["kept"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ForgetlessError(f"{path} is damaged; move it away and restart (the states are hashed again, "
                                      "trusting the files as they are)") from None
        else:
            self.migrate()
        self.reconcile()

    def migrate(self):
        """A folder from before the manifest: kept states that are hard links of the snapshot become their own
        files, and the files as they are now are hashed into a new manifest."""
        self.snapshots, self.kept = [], {}
        if (self.folder / SNAPSHOT).is_file():
            self.snapshots = [sha256(self.folder / SNAPSHOT)]
        for path in sorted(self.kept_folder.glob("[0-9]*.safetensors")):
            if path.stat().st_nlink > 1:
                tmp = path.with_name(f".{path.name}.tmp")
                durable_copy(path, tmp)
                os.replace(tmp, path)
            try:
                canary = load_checkpoint(path)[1]["canary"]
            except (ForgetlessError, KeyError):
                log.warning("%s cannot be read; it is renamed *.damaged, out of the kept states", path)
                os.replace(path, path.with_name(path.name + ".damaged"))
                continue
            self.kept[int(path.stem)] = {"sha256": sha256(path), "canary": canary}
        if self.snapshots or self.kept:
            self.write_manifest()

    def reconcile(self):
        """After a kill mid-write: a kept state the manifest lists whose file never got renamed into place is
        copied from the snapshot when that holds it, else dropped (the replay writes it again); a kept file the
        manifest no longer lists (pruned, its removal interrupted) is removed."""
        snapshot = self.folder / SNAPSHOT
        digest = sha256(snapshot) if snapshot.is_file() and any(
            not (self.kept_folder / kept_name(s)).exists() for s in self.kept) else None
        changed = False
        for seq, entry in list(self.kept.items()):
            path = self.kept_folder / kept_name(seq)
            if path.exists():
                continue
            if entry["sha256"] == digest:
                tmp = path.with_name(f".{path.name}.tmp")
                durable_copy(snapshot, tmp)
                os.replace(tmp, path)
            else:
                del self.kept[seq]
                changed = True
        for path in self.kept_folder.glob("[0-9]*.safetensors"):
            if path.stem.isdigit() and int(path.stem) not in self.kept:
                path.unlink()
        if changed:
            self.write_manifest()

    def write_manifest(self):
        path, tmp = self.folder / MANIFEST, self.folder / f".{MANIFEST}.tmp"
        data = json.dumps({"snapshots": self.snapshots, "kept": {str(s): e for s, e in sorted(self.kept.items())}})
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(self.folder)

    def save(self, tensors: dict[str, torch.Tensor], meta: dict, keep: bool):
        """Write the snapshot (and, when `keep` and no kept state has its seq yet, its kept copy): files first,
        then the manifest, then the renames. Never rewrites a kept state."""
        path = self.folder / SNAPSHOT
        aliases = shared(tensors)
        unique = {name: t.detach().contiguous().cpu() for name, t in tensors.items() if name not in aliases}
        work = private_folder(path)
        try:
            tmp = work / path.name
            save_file(unique, str(tmp), metadata={"forgetless": json.dumps({**meta, "format": FORMAT,
                                                                            "aliases": aliases})})
            os.chmod(tmp, PRIVATE_FILE)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest, seq = sha256(tmp), meta["seq"]
            kept_tmp = None
            if keep and seq not in self.kept:
                kept_tmp = self.kept_folder / f".{kept_name(seq)}.tmp"
                durable_copy(tmp, kept_tmp)
            snapshots, kept = self.snapshots, dict(self.kept)
            self.snapshots = [*self.snapshots[-1:], digest]
            if kept_tmp:
                self.kept[seq] = {"sha256": digest, "canary": meta["canary"]}
            pruned = [s for s in sorted(self.kept) if s][:-self.keep_states]  # the first start's (seq 0) stays
            for s in pruned:
                del self.kept[s]
            try:
                self.write_manifest()
            except OSError:
                self.snapshots, self.kept = snapshots, kept
                raise
            os.replace(tmp, path)
            if kept_tmp:
                os.replace(kept_tmp, self.kept_folder / kept_name(seq))
            fsync_path(self.folder)
            fsync_path(self.kept_folder)
            for s in pruned:
                (self.kept_folder / kept_name(s)).unlink(missing_ok=True)
        finally:
            remove_unfinished(work)
            for stale in self.kept_folder.glob(".*.tmp"):
                stale.unlink(missing_ok=True)

    def read_snapshot(self) -> tuple[dict, dict]:
        """(tensors, meta) of the snapshot, Damaged when it matches no hash of the manifest or cannot be read."""
        return self.read(self.folder / SNAPSHOT, self.snapshots)

    def read_kept(self, seq: int) -> tuple[dict, dict]:
        return self.read(self.kept_folder / kept_name(seq), [self.kept[seq]["sha256"]])

    def read(self, path: Path, hashes: list[str]) -> tuple[dict, dict]:
        if not path.is_file():
            raise Damaged(f"{path} is missing")
        if sha256(path) not in hashes:
            raise Damaged(f"{path} is damaged (its SHA-256 is not the one {self.folder / MANIFEST} records)")
        try:
            return load_checkpoint(path)
        except ForgetlessError as e:
            raise Damaged(str(e)) from None

    def drop_kept(self, seq: int):
        """Take a damaged kept state out of the targets (its file renamed *.damaged, for a look)."""
        path = self.kept_folder / kept_name(seq)
        if path.exists():
            os.replace(path, path.with_name(path.name + ".damaged"))
        del self.kept[seq]
        self.write_manifest()
