"""A run's results from a few numbers, as the report code reads them (the contract keys a test leaves out filled
in); and the check that a results.json read and written back is the same text."""
import json
from pathlib import Path

from forgetless.report.results import RunResult


def run_result(protocol: str, methods: dict[str, dict], **keys) -> RunResult:
    """A RunResult of `protocol` whose arms have the keys `methods` gives them (the other keys every method entry
    has: options {}, zero sizes and times), with top-level `keys` (config, ...) besides the contract's."""
    entries = {label: {"options": {}, "trainable_params": 0, "total_params": 1, "peak_rss_mb": 0.0,
                       "wall_s": {"mean": 0.0, "std": 0.0}, **entry} for label, entry in methods.items()}
    return RunResult.from_json({"protocol": protocol, "preset": "smoke", "seeds": [0], "date": "2026-01-01",
                                "methods": entries, **keys})


def round_trips(path: Path) -> bool:
    """Whether the results.json at `path`, loaded as a RunResult and written back, is the same text, key order
    included (write_json's form)."""
    return json.dumps(RunResult.load(path).to_json(), indent=2) == path.read_text()
