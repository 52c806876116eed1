"""A bench run's results as typed objects, the one place that knows the layout of results.json (docs/DESIGN.md
§6.3): `RunResult` (the contract's top-level keys, each arm's `MethodEntry`, the protocol's own keys in one
mapping) and `MethodEntry` (the keys every method entry has, the protocol's stats in one mapping).
`to_json()` gives back the dict `from_json` read, key for key and in its order, keys added since after them;
older files load (no `method`: the label up to `[`; `config.adapt.replay` for `mix`, `RunResult.adapt`).

    results = RunResult.load(Path("runs/two-domain-smoke"))    # the folder, or its results.json
    lora = results.methods["lora"]
    lora.trainable_params, lora.stats["forgetting"]["mean"]
    results["methods"]["lora"]["forgetting"]                    # read as the file's dict: the Python API as before
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from forgetless.checkpoint import write_json
from forgetless.errors import ForgetlessError

PROVENANCE = ("forgetless_version", "code", "git_commit", "python", "torch", "device")  # what made the file
ENTRY = ("method", "options", "trainable_params", "total_params", "peak_rss_mb", "wall_s", "per_seed")
REQUIRED_ENTRY = ("options", "trainable_params", "total_params", "peak_rss_mb", "wall_s")
REQUIRED = ("protocol", "preset", "seeds", "date", "methods")


class Keyed(Mapping):
    """Read like the file's dict, a read-only mapping of live values (`x["methods"]` are the entries): code that took
    the results dict reads them unchanged. Writes go to the fields and mappings; `to_json()` is the dict itself."""

    def keyed(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key: str):
        return self.keyed()[key]

    def __iter__(self):
        return iter(self.keyed())

    def __len__(self) -> int:
        return len(self.keyed())


@dataclass(frozen=True)
class MethodEntry(Keyed):
    """One arm's entry: the keys every protocol writes, typed; the protocol's own (metrics, curves, R matrices,
    reports; docs/DESIGN.md §6.3's table) in `stats`."""
    method: str                  # the registered name
    options: dict
    trainable_params: int
    total_params: int
    peak_rss_mb: float | None = None  # max over seeds (None: not measured, e.g. Adapted.figures' entry)
    wall_s: dict | None = None   # a stat: {mean, std[, ci95]}
    per_seed: dict | None = None  # {seed: {metric: value}}; None: not kept (online, older files)
    stats: dict = field(default_factory=dict)
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)  # the keys as read, in the file's order

    @classmethod
    def from_json(cls, label: str, entry: dict) -> MethodEntry:
        missing = [k for k in REQUIRED_ENTRY if k not in entry]
        if missing:
            raise ForgetlessError(f"the method entry {label!r} has no {', '.join(missing)} (docs/DESIGN.md §6.3): not "
                                  "the results of `forgetless bench`; run the bench again")
        return cls(entry.get("method") or label.split("[")[0], *(entry[k] for k in REQUIRED_ENTRY),
                   entry.get("per_seed"), {k: v for k, v in entry.items() if k not in ENTRY}, tuple(entry))

    def typed(self) -> dict:
        """The typed keys that have a value."""
        return {k: getattr(self, k) for k in ENTRY if getattr(self, k) is not None}

    def to_json(self) -> dict:
        return in_order(self.typed(), self.stats, self.order)

    def keyed(self) -> dict:
        return {**self.typed(), **self.stats}


@dataclass(frozen=True)
class RunResult(Keyed):
    """A run's results.json: the keys every protocol writes, typed; the protocol's own (domains, tasks, config,
    bases, stream, frontier, study, ...) in `extra`."""
    protocol: str                # two-domain | sequence | online
    methods: dict[str, MethodEntry]  # arm label -> entry, in run order
    preset: str = ""             # (every file has it, seeds and date: empty only in results built in code)
    seeds: list[int] = field(default_factory=list)
    date: str = ""               # ISO date
    base_seeds: int = 1          # arm seed s adapts the base of seed s mod base_seeds
    precision: dict | None = None  # {used, requested, why}
    model: str = "byte-gpt"      # byte-gpt, or the --model spec
    provenance: dict = field(default_factory=dict)  # the PROVENANCE keys the file has
    extra: dict = field(default_factory=dict)
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)  # the keys as read, in the file's order

    @classmethod
    def from_json(cls, results: dict) -> RunResult:
        missing = [k for k in REQUIRED if k not in results] if isinstance(results, dict) else list(REQUIRED)
        if missing:
            raise ForgetlessError(f"no {', '.join(missing)} (docs/DESIGN.md §6.3): not the results of `forgetless "
                                  "bench`; give the --out folder of a bench run")
        methods = {label: MethodEntry.from_json(label, entry) for label, entry in results["methods"].items()}
        typed = ("protocol", "preset", "seeds", "date", "methods", "base_seeds", "precision", "model", *PROVENANCE)
        return cls(results["protocol"], methods, results["preset"], results["seeds"], results["date"],
                   results.get("base_seeds", 1), results.get("precision"), results.get("model", "byte-gpt"),
                   {k: results[k] for k in PROVENANCE if k in results},
                   {k: v for k, v in results.items() if k not in typed}, tuple(results))

    @classmethod
    def load(cls, path: Path) -> RunResult:
        """The results.json at `path` (or in the folder `path`), with one-line errors for a missing or broken file."""
        path = path / "results.json" if path.is_dir() else path
        if not path.is_file():
            raise ForgetlessError(f"{path} does not exist; give the --out folder of a `forgetless bench` run")
        try:
            return cls.from_json(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ForgetlessError(f"{path} is not valid JSON ({e}); re-run the bench") from None
        except ForgetlessError as e:
            raise ForgetlessError(f"{path}: {e}") from None

    def save(self, folder: Path) -> Path:
        """Write folder/results.json (atomically; rank 0 under torchrun) and return its path."""
        write_json(folder / "results.json", self.to_json())
        return folder / "results.json"

    def typed(self, entries: bool = True) -> dict:
        """The typed keys that have a value; the entries as dicts (else as MethodEntry)."""
        return {"protocol": self.protocol, "preset": self.preset, "seeds": self.seeds, "date": self.date,
                "base_seeds": self.base_seeds, **({"precision": self.precision} if self.precision is not None else {}),
                "model": self.model, **self.provenance,
                "methods": {label: e.to_json() for label, e in self.methods.items()} if entries else self.methods}

    def to_json(self) -> dict:
        return in_order(self.typed(), self.extra, self.order)

    def keyed(self) -> dict:
        return {**self.typed(entries=False), **self.extra}

    def with_keys(self, **keys) -> RunResult:
        """These results with top-level `keys` set, as a dict update sets them (a new key after the others)."""
        return RunResult.from_json({**self.to_json(), **keys})

    @property
    def adapt(self) -> dict:
        """The run's adapt config; files written before the knob's rename say `replay` for `mix`."""
        adapt = self.extra.get("config", {}).get("adapt", {})
        return {**adapt, "mix": adapt["replay"]} if "mix" not in adapt and "replay" in adapt else adapt


def in_order(typed: dict, rest: dict, order: tuple[str, ...]) -> dict:
    """The file's dict: the keys of `order` (as read), then those of `rest` added since; without an order (built
    from fields), the typed keys, then `rest`'s."""
    if not order:
        return {**typed, **rest}
    out = {k: typed[k] if k in typed else rest[k] for k in order if k in typed or k in rest}
    return out | {k: v for k, v in rest.items() if k not in out}
