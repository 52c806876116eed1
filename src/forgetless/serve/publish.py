"""Published versions of a served state: `POST /v1/publish` and `forgetless export STATE_DIR` write the last good
state in the form a serving engine loads (forgetless.export: a PEFT adapter for LoRA on a local transformers base,
merged weights where the method folds into them, else the forgetless folder) into `STATE_DIR/publish/vN/`, with
`manifest.json`: version, parent version, form, method spec, canary loss, the documents it holds (log sequence
numbers), the base's fingerprint, the time and the SHA-256 of every file.

A version is written whole in a private folder beside it (`.vN.tmp-HOST-PID`), every file and the folder fsynced,
its manifest last, and only then renamed to `vN`: a kill at any point leaves the earlier versions as they were and
no `vN` folder; the next publish removes what the killed one left and takes the same number. Publishes of one
folder take turns (an OS lock on `publish/.lock`)."""
from __future__ import annotations

import fcntl
import json
import os
import re
import time
from pathlib import Path


from forgetless.checkpoint import private_folder, remove_unfinished
from forgetless.errors import ForgetlessError
from forgetless.export import export_adapted
from forgetless.serve.store import KEPT, SNAPSHOT, kept_name, sha256
from forgetless.serve.store import MANIFEST as STORE_MANIFEST
from forgetless.serve.wal import fsync_path

PUBLISH, MANIFEST = "publish", "manifest.json"
VERSION = re.compile(r"v(\d+)")


def versions(root: Path) -> dict[int, Path]:
    """Version number -> folder of every finished version under `root` (a `vN` folder holding its manifest)."""
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if (m := VERSION.fullmatch(p.name)) and p.is_dir()}
    return {n: p for n, p in sorted(found.items()) if (p / MANIFEST).is_file()}


def write_version(root: Path, adapted, meta: dict, tokenizer, spec: str | None = None, name: str | None = None) -> dict:
    """Export `adapted` (holding the state to publish; a merge may fold its modules away: give a copy) as the next
    version under `root`; `meta`: the state's (seq, canary, method, undone ranges, ...). Returns the manifest."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        done = versions(root)
        number = max([int(m.group(1)) for p in root.iterdir() if (m := VERSION.fullmatch(p.name))], default=0) + 1
        target = root / f"v{number}"
        work = private_folder(target)  # removes what a killed publish of this number left
        try:
            form, _ = export_adapted(adapted, spec, tokenizer, work)
            files = {str(p.relative_to(work)): p for p in sorted(work.rglob("*")) if p.is_file()}
            for path in files.values():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            manifest = {"version": number, "parent": max(done, default=None), "form": form, "method": meta["method"],
                        "canary_loss": meta["canary"], "canary_reference": meta["reference"],
                        "documents": documents(meta), "base": {**adapted.base_fingerprint, "name": name},
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "files": {rel: sha256(path) for rel, path in files.items()}}
            with open(work / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(work)
            commit(work, target)
            fsync_path(root)
        finally:
            remove_unfinished(work)
    return {**manifest, "path": str(target)}


def commit(work: Path, target: Path):
    """The step that makes a version: the finished folder renamed to its number (atomic)."""
    os.rename(work, target)


def documents(meta: dict) -> dict:
    """The log's documents a state holds: 1..seq less the ranges rollbacks undid."""
    seq, undone = meta["seq"], [r for r in meta.get("undone", []) if r[0] <= meta["seq"]]
    count = seq - sum(min(b, seq) - a + 1 for a, b in undone)
    return {"through_seq": seq, "count": count, "undone": undone}


def check_intact(folder: Path) -> dict:
    """The manifest of the version in `folder`, every file's SHA-256 checked (ForgetlessError naming a bad one)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for rel, digest in manifest["files"].items():
        if not (folder / rel).is_file() or sha256(folder / rel) != digest:
            raise ForgetlessError(f"{folder / rel} does not match its SHA-256 in {folder / MANIFEST}; publish again")
    return manifest


def is_state_folder(folder: Path) -> bool:
    """Whether `folder` is a `forgetless serve` --state-dir (a snapshot and kept states)."""
    return (folder / SNAPSHOT).is_file() and (folder / KEPT).is_dir()


def export_state(state_dir: Path, out: Path | None, model: str | None) -> tuple[str, Path]:
    """The newest kept state of a serve state folder (a checked, good state; documents logged after it are not in
    it: `POST /v1/publish` on the running server includes them) published as the next version under `out` (default
    STATE_DIR/publish), on the base `model` names; returns (form, folder)."""
    from forgetless.adapted import attach
    from forgetless.checkpoint import load_checkpoint
    if model is None:
        raise ForgetlessError(f"{state_dir} is a serve state folder: name the base it serves with --model "
                              "(smollm2-135m, hf:PATH, a .gguf file, or a forgetless base .safetensors)")
    store = json.loads((state_dir / STORE_MANIFEST).read_text())
    if not store.get("kept"):
        raise ForgetlessError(f"{state_dir} holds no kept state; start forgetless serve on it first")
    seq = max(int(s) for s in store["kept"])
    path = state_dir / KEPT / kept_name(seq)
    if not path.is_file() or sha256(path) != store["kept"][str(seq)]["sha256"]:
        raise ForgetlessError(f"{path} is missing or damaged (its SHA-256 is not the manifest's); start forgetless serve "
                              "on the folder (it falls back to an intact state) and POST /v1/publish")
    tensors, meta = load_checkpoint(path)
    if model.endswith(".safetensors"):
        from forgetless.continual.base_model import load_base
        base, tokenizer, _ = load_base(Path(model))
        spec = "byte-gpt"
    else:
        from forgetless.models.hf import load_model
        base, tokenizer = load_model(model)
        spec = model
    adapted = attach(base, meta["method"])
    try:
        adapted.model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError:
        raise ForgetlessError(f"{path} was written on another base than {model}; give the --model it was served "
                              "with") from None
    manifest = write_version(out or state_dir / PUBLISH, adapted, meta, tokenizer, spec, model)
    return manifest["form"], Path(manifest["path"])
