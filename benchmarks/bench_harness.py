"""Where the time of a `forgetless bench` goes: wall seconds per phase of one real run.

Phases (each second counts once, in the innermost phase running): plan (the calibration), pretrain
(bases, minus their evaluations), adapt (arms' training, minus their evaluations), evaluate (held-out
scoring, at every curve point and before/after), report (tables and figures), other (data loading,
start-up). The run itself is the CLI's, on a cache folder of its own (cold: bases pretrained here)
unless --warm; the plan's estimate is printed beside the measured total, as the ratio estimated/measured.

    python benchmarks/bench_harness.py [--threads 2] [--warm] [-- BENCH ARGS, e.g. --preset smoke --seeds 1]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _timing import provenance

PHASES = ["plan", "pretrain", "adapt", "evaluate", "report", "other"]


class PhaseClock:
    """Exclusive wall time per phase: entering a phase pauses the one it interrupts."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.stack, self.since = ["other"], time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.switch(lambda: self.stack.append(name))
        try:
            yield
        finally:
            self.switch(self.stack.pop)

    def switch(self, change):
        now = time.perf_counter()
        self.seconds[self.stack[-1]] += now - self.since
        change()
        self.since = now

    def timed(self, module, name: str, phase: str):
        """Wrap `module.name` so that its calls count as `phase`."""
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            with self.phase(phase):
                return fn(*args, **kwargs)
        setattr(module, name, wrapper)


def instrument(clock: PhaseClock) -> dict:
    """Time the phases where the bench calls them; returns a dict the plan's estimate lands in."""
    from forgetless import report
    from forgetless.continual import arm, base_model, plan, sequence
    estimate = {}
    make_plan = plan.make_plan

    def planned(*args, **kwargs):
        with clock.phase("plan"):
            result = make_plan(*args, **kwargs)
        estimate["seconds"] = result.seconds
        return result
    plan.make_plan = planned
    clock.timed(plan, "cached_base", "pretrain")
    clock.timed(plan, "run_or_reuse_arm", "adapt")
    for module in (arm, base_model, sequence):  # evaluate is imported by name where it is used
        clock.timed(module, "evaluate", "evaluate")
        if hasattr(module, "module_stats"):
            clock.timed(module, "module_stats", "evaluate")
    clock.timed(report, "write_report", "report")
    return estimate


def cold_cache(folder: Path):
    """A cache without pretrained bases; everything else in the usual cache (e.g. corpora) is linked in."""
    from forgetless.data.corpora import cache_dir
    folder.mkdir(parents=True)
    if cache_dir().is_dir():
        for entry in cache_dir().iterdir():
            if entry.name != "bases":
                (folder / entry.name).symlink_to(entry)
    os.environ["FORGETLESS_CACHE"] = str(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warm", action="store_true", help="use the usual cache (bases already pretrained)")
    own, bench_args = (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]) if "--" in sys.argv \
        else (sys.argv[1:], [])
    args = parser.parse_args(own)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.warm:
            cold_cache(Path(tmp) / "cache")
        if "--out" not in bench_args:
            bench_args += ["--out", str(Path(tmp) / "run")]
        from forgetless.cli import app
        clock = PhaseClock()
        estimate = instrument(clock)
        t0 = clock.since = time.perf_counter()
        code = app(["bench", *bench_args], standalone_mode=False)
        clock.switch(lambda: None)
        total = time.perf_counter() - t0
    if code:  # the CLI printed its one-line error
        sys.exit(code)
    print(f"\n{'phase':<10} {'seconds':>9} {'share':>7}")
    for name in PHASES:
        print(f"{name:<10} {clock.seconds[name]:>9.1f} {100 * clock.seconds[name] / total:>6.1f}%")
    print(f"{'total':<10} {total:>9.1f}   (plan estimated {estimate.get('seconds', float('nan')):.1f} s)")
    print(json.dumps({"bench": "harness", "provenance": provenance(), "ratio": estimate.get("seconds", float("nan")) / total,
                      "baseline_ms": 1000 * total, "candidate_ms": 1000 * estimate.get("seconds", float("nan")),
                      "phases_s": {k: round(v, 2) for k, v in clock.seconds.items()}, "threads": args.threads,
                      "cold": not args.warm, "args": bench_args}))


if __name__ == "__main__":
    main()
