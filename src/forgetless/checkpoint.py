"""Checkpoints: one safetensors file (tensors + JSON metadata), written atomically. Never pickles."""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from forgetless import distributed
from forgetless.errors import ForgetlessError

FORMAT = "forgetless-1"


def shared(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: first name} of the tensors that share storage with an earlier one (tied weights)."""
    aliases, seen = {}, {}
    for name, t in tensors.items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
        elif key is not None:
            seen[key] = name
    return aliases


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict):
    """Write tensors and a JSON-able `meta` to `path` atomically (tmp file + rename); under torchrun,
    rank 0 writes and every rank waits until it has.

    Tensors sharing storage (tied weights) are written once; `meta["aliases"]` names the rest.
    """
    if not distributed.is_main():
        return distributed.barrier()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    aliases = shared(tensors)
    unique = {name: t.detach().contiguous().cpu() for name, t in tensors.items() if name not in aliases}
    meta = {**meta, "format": FORMAT, "aliases": aliases}
    # a private folder: safetensors >= 0.7 writes through its own `.tmpXXXXXX` file beside the target, so a kill
    # leaves only this folder, which the next save (or serve's restart) removes
    work = private_folder(path)
    tmp = work / path.name
    save_file(unique, str(tmp), metadata={"forgetless": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    work.rmdir()
    distributed.barrier()


def private_folder(path: Path) -> Path:
    """A new empty folder beside `path` to write it in (`.NAME.tmp-HOST-PID`), renamed or emptied when done; the
    folders that processes of this host killed while writing `path` left are removed first."""
    host = socket.gethostname()
    for stale in path.parent.glob(f".{path.name}.tmp-{host}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not alive(int(pid)):
            remove_unfinished(stale)
    work = path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}")
    remove_unfinished(work)
    work.mkdir()
    return work


def alive(pid: int) -> bool:
    """Whether process `pid` of this host exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_unfinished(stale: Path):
    """Delete what a killed writer left at `stale` (a `private_folder`, or a file of older versions)."""
    if stale.is_dir():
        shutil.rmtree(stale, ignore_errors=True)  # another process may be removing it too
    else:
        stale.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a checkpoint written by `save_checkpoint`: (tensors with aliases restored, meta)."""
    path = Path(path)
    if not path.is_file():
        raise ForgetlessError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["forgetless"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
        raise ForgetlessError(
            f"checkpoint {path} is corrupt or truncated ({str(e).splitlines()[0][:80]}); "
            "delete it and re-run, or point to another checkpoint") from None
    if meta.get("format") != FORMAT:
        raise ForgetlessError(f"checkpoint {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    for alias, target in meta.get("aliases", {}).items():
        tensors[alias] = tensors[target]
    return tensors, meta


def writable_dir(path: str | Path) -> Path:
    """`path` as a folder that exists (made if missing); a file there is a one-line error."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ForgetlessError(f"{path} is a file; give a folder to write into")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: str | Path, obj):
    """Write JSON atomically (rank 0 only under torchrun)."""
    if not distributed.is_main():
        return distributed.barrier()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
    distributed.barrier()


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Split an optimizer state_dict into flat tensors and JSON-able param groups."""
    sd = opt.state_dict()
    flat = {f"optim.{idx}.{key}": (v if torch.is_tensor(v) else torch.tensor(v))
            for idx, state in sd["state"].items() for key, v in state.items()}
    return flat, sd["param_groups"]


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list):
    """Load what `optimizer_tensors` split (states of FSDP-sharded parameters sharded as they are)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            # clone: fresh memory, so reductions sum in the same order
            state.setdefault(int(idx), {})[key] = distributed.shard_as(t.clone(), params[int(idx)])
    opt.load_state_dict({"state": state, "param_groups": groups})
