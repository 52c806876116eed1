"""`forgetless adapt` on CPU with the lean heap (monitor.lean_heap, adapt's default) against glibc's own heap
($FORGETLESS_HEAP=glibc), measured in the same run: peak RSS of the training (the report's) and of the whole process
(Fisher pass and scoring included), and the training's wall time.

    python benchmarks/bench_heap.py                      # ewc-distill on SmolLM2-135M, the smoke preset, 3 steps
    python benchmarks/bench_heap.py --repeats 2          # each heap twice, in the order glibc lean lean glibc

Each run is its own process (`forgetless adapt`, fp32, gradient checkpointing: issue 48's goal run) on the first
--rows records of --data and the first --retain-chars characters of --retain, so that scoring the held-out rows
before and after stays short; time it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED = Path(os.environ.get("FORGETLESS_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="ewc-distill[fisher_samples=8]")
    p.add_argument("--data", default=str(SHARED / "data" / "cl500" / "FOMC"))
    p.add_argument("--retain", default=str(SHARED / "data" / "tinyshakespeare.txt"))
    p.add_argument("--rows", type=int, default=200, help="records of --data used (a tenth held out)")
    p.add_argument("--retain-chars", type=int, default=200_000, help="characters of --retain used")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="runs per heap, in ABBA order")
    p.add_argument("--flags", default="--preset smoke --precision fp32 --gradient-checkpointing",
                   help="more adapt flags")
    args = p.parse_args()
    order = (["glibc", "lean", "lean", "glibc"] * args.repeats)[:2 * args.repeats]
    with tempfile.TemporaryDirectory() as tmp:
        data, retain = subsets(args, Path(tmp))
        rows = [run(heap, i, args, data, retain, Path(tmp)) for i, heap in enumerate(order)]
        estimate = plan(args, data, retain, Path(tmp))
    print(table(rows, estimate))


def subsets(args, tmp: Path) -> tuple[Path, Path]:
    """The first --rows records of --data (a .json list, a .jsonl or a folder with train.json) and the first
    --retain-chars characters of --retain."""
    source = Path(args.data)
    source = source / "train.json" if source.is_dir() else source
    text = source.read_text()
    records = json.loads(text) if source.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:args.rows]))
    retain = tmp / "retain.txt"
    retain.write_text(Path(args.retain).read_text()[:args.retain_chars])
    return data, retain


def command(args, data: Path, retain: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "forgetless", "adapt", "--model", args.model, "--data", str(data), "--retain",
            str(retain), "--method", args.method, "--adapt-steps", str(args.steps), "--out", str(out),
            *args.flags.split()]


def plan(args, data: Path, retain: Path, tmp: Path) -> float:
    """The run's estimated peak in GiB (`adapt --plan`: the first row is the run as set)."""
    out = subprocess.run([*command(args, data, retain, tmp / "plan"), "--plan"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "400"}, check=True).stdout
    size, unit = re.search(r"^\s+(?:fits|over)\s+([0-9.]+) (GiB|MiB)", out, re.MULTILINE).groups()
    return float(size) / (1024 if unit == "MiB" else 1)


def run(heap: str, i: int, args, data: Path, retain: Path, tmp: Path) -> dict:
    out = tmp / f"run{i}"
    cmd = command(args, data, retain, out)
    print(f"run {i + 1}: FORGETLESS_HEAP={heap} {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "FORGETLESS_HEAP": heap}, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"run {i + 1} failed (status {status})")
    report = json.loads((out / "report.json").read_text())
    return {"heap": heap, "train_peak_gib": report["peak_rss_mb"] / 1024, "process_peak_gib": usage.ru_maxrss / 2**20,
            "start_gib": report["rss_start_mb"] / 1024, "train_s": report["wall_s"], "steps": report["steps"]}


def table(rows: list[dict], estimate: float) -> str:
    """One row per run; the means' ratios; the plan's estimate against the training's peak above the process's
    memory before the model loaded (what `adapt --plan` estimates: on CPU the RAM the run takes)."""
    lines = ["| run | heap | before load (GiB) | training peak RSS (GiB) | process peak RSS (GiB) | training wall (s) | "
             "plan / (training peak - before load) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['heap']} | {r['start_gib']:.2f} | {r['train_peak_gib']:.2f} | {r['process_peak_gib']:.2f} "
              f"| {r['train_s']:.1f} | {estimate / (r['train_peak_gib'] - r['start_gib']):.2f} |"
              for i, r in enumerate(rows)]
    mean = {h: {k: statistics.mean(r[k] for r in rows if r["heap"] == h)
                for k in ("train_peak_gib", "process_peak_gib", "train_s")} for h in ("glibc", "lean")}
    lean, glibc = mean["lean"], mean["glibc"]
    lines += ["", f"lean / glibc: training peak {lean['train_peak_gib'] / glibc['train_peak_gib']:.2f}x, process peak "
              f"{lean['process_peak_gib'] / glibc['process_peak_gib']:.2f}x, training wall "
              f"{lean['train_s'] / glibc['train_s']:.2f}x ({rows[0]['steps']} steps per run); adapt --plan: "
              f"{estimate:.2f} GiB"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
