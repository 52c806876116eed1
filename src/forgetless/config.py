"""Config helpers: dataclasses with help metadata -> dicts, files, hashes and CLI options."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import types
import typing
from pathlib import Path

from forgetless.errors import ForgetlessError


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def coerce(value, typ, where: str):
    """Turn a value from a file or the command line into the field's type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return coerce(value, args[0], where)
    try:
        if typ is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if typ in (int, float, str, bool):
            out = typ(value)
            if typ is int and isinstance(value, float) and value != out:
                raise ValueError(value)
            return out
        if origin in (list, tuple) or typ in (list, tuple):
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            (inner,) = typing.get_args(typ)[:1] or (str,)
            return [coerce(v, inner, where) for v in value]
        if typ is dict or origin is dict:
            return json.loads(value) if isinstance(value, str) else dict(value)
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ForgetlessError(f"{where}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    return value


def from_dict(cls, data: dict, section: str):
    """Build dataclass `cls` from `data`; an unknown key is an error naming the valid ones. Keys in
    `cls.aliases` (earlier names of a field) are read as the field they name."""
    aliases = getattr(cls, "aliases", {})
    data = {aliases.get(k, k): v for k, v in data.items()}
    types = field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ForgetlessError(
            f"unknown config key {section}.{unknown[0]}; valid keys in {section}: {', '.join(types)}")
    return cls(**{k: coerce(v, types[k], f"{section}.{k}") for k, v in data.items()})


def as_saved(cls, data: dict) -> dict:
    """`data` read from a save: a field it lacks that declares `if_absent` in its metadata (an option added
    after the save was written) takes that value, the behaviour the save was made with, not the new default."""
    return {**{f.name: f.metadata["if_absent"] for f in dataclasses.fields(cls)
               if "if_absent" in f.metadata and f.name not in data}, **data}


def replace(obj, overrides: dict, section: str):
    """A copy of dataclass `obj` with `overrides` applied (validated like `from_dict`)."""
    merged = {**dataclasses.asdict(obj), **overrides}
    return from_dict(type(obj), merged, section)


def load_file(path: str | Path) -> dict:
    """Read a YAML or JSON config file into a dict of sections."""
    path = Path(path)
    if not path.is_file():
        raise ForgetlessError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise many kinds
        raise ForgetlessError(f"config file {path} is not valid {path.suffix[1:] or 'JSON'}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ForgetlessError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


@functools.cache
def code_fingerprint() -> str:
    """Short hash of the package sources that compute results (all but the CLI, reports and aunn/),
    recorded with cached bases and bench arms so that reusing one made by other code is flagged.
    Read once per process (the CLI reads it at start): the code that ran, not files edited since."""
    root = Path(__file__).parent
    sources = sorted(f for f in root.rglob("*.py")
                     if f.relative_to(root).parts[0] not in ("report", "aunn") and not f.name.startswith("cli"))
    digest = hashlib.sha256()
    for f in sources:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def git_commit() -> str | None:
    """The commit of the checkout the package runs from ('+dirty' when its files differ from it), None outside
    a git checkout (an installed wheel). Read once per process (`bench` reads it at start, with the code
    fingerprint): a commit made while a run goes on is not the run's."""
    root = Path(__file__).parent

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no", ".").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def cache_dir() -> Path:
    """Where corpora, pretrained bases and GGUF conversions are cached: $FORGETLESS_CACHE or ~/.cache/forgetless."""
    return Path(os.environ.get("FORGETLESS_CACHE") or Path.home() / ".cache" / "forgetless")


def stable_hash(obj, n: int = 12) -> str:
    """Short hash of a JSON-able object (dataclasses allowed), stable across runs."""
    def default(o):
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        raise TypeError(type(o))
    blob = json.dumps(obj, sort_keys=True, default=default)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]
