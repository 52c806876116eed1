"""Compare every value of two results.json files, exactly: `python scripts/compare_results.py A.json B.json`.

Checks that a change meant to keep behaviour (a refactor) does: the same command and seeds run by two versions of
the code, each with its own --out and $FORGETLESS_CACHE, must give the same numbers bit for bit. Every leaf of the
two JSON trees is compared (a float must be the same float; NaN equals NaN), but what differs between two runs of
the same code: times and memory (`SKIPPED` keys), the date, provenance (version, code fingerprint, commit, Python,
torch, device) and absolute paths (caches, output folders). `--ignore KEY` skips more keys (a key one version
added, say). Prints how many values were compared and each that differs or is in one file only; exits 1 on any."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SKIPPED = {"wall_s", "peak_rss_mb", "updates_per_s", "pretrain_wall_s", "date",
           "forgetless_version", "code", "git_commit", "python", "torch", "device"}
SHOWN = 40  # differences printed at most


def leaves(value, skipped: set[str], path: str = "") -> dict[str, object]:
    """{path: value} of every leaf of a JSON value ("methods.lora.forgetting.mean", "...curves.step[3]"), without
    the `skipped` keys and absolute paths."""
    if isinstance(value, dict):
        return {p: v for k, item in value.items() if k not in skipped
                for p, v in leaves(item, skipped, f"{path}.{k}" if path else k).items()}
    if isinstance(value, list):
        return {p: v for i, item in enumerate(value) for p, v in leaves(item, skipped, f"{path}[{i}]").items()}
    if isinstance(value, str) and value.startswith("/"):
        return {}
    return {path: value}


def same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def compare(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(values compared, one line per difference) between two results dicts."""
    skipped = SKIPPED | set(ignore)
    left, right = leaves(a, skipped), leaves(b, skipped)
    differ = [f"{p}: only in {'A' if p in left else 'B'}" for p in sorted(left.keys() ^ right.keys())]
    both = [p for p in left if p in right]
    differ += [f"{p}: A {left[p]!r}, B {right[p]!r}" for p in both if not same(left[p], right[p])]
    return len(both), differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--ignore", action="append", default=[], metavar="KEY", help="skip this key too (repeatable)")
    args = parser.parse_args(argv)
    compared, differ = compare(*(json.loads(p.read_text()) for p in (args.a, args.b)), tuple(args.ignore))
    print(f"{compared} values compared, {len(differ)} differ ({args.a} vs {args.b})")
    for line in differ[:SHOWN]:
        print("  " + line)
    if len(differ) > SHOWN:
        print(f"  ... and {len(differ) - SHOWN} more")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
