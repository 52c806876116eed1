"""Jobs side by side on a multi-core CPU: `--workers N` runs a bench's bases and arms in N forked
processes of one thread share each: a small model's matrix products keep one core busier than they
keep several, so N processes of one thread can finish sooner than one process of N threads
(`python benchmarks/bench_harness.py -- --workers N` times a run on a machine).

Each job is a zero-argument callable that saves its own output (a base checkpoint, an arm's JSON),
so an interrupted run resumes as a serial one does; results come back to the parent, which keeps the
run's bar. Workers print nothing (their console is quiet); the parent reports for them.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Callable

import torch

from forgetless.errors import ForgetlessError
from forgetless.progress import console

_jobs: list[Callable] = []  # the jobs of the running pool: forked workers inherit them


def can_fork() -> bool:
    """Whether jobs can run in forked processes here (Linux, not under torchrun)."""
    return "fork" in multiprocessing.get_all_start_methods() and int(os.environ.get("WORLD_SIZE", "1")) == 1


def check_workers(workers: int | None, device: torch.device):
    """A one-line error for a worker count the run cannot use (None: auto, chosen by the plan)."""
    if workers is None:
        return
    if workers < 1:
        raise ForgetlessError(f"--workers must be at least 1, got {workers}")
    if workers > 1 and device.type != "cpu":
        raise ForgetlessError(f"--workers {workers} runs jobs side by side on CPU cores; on {device.type} use 1")
    if workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
        raise ForgetlessError(f"--workers {workers} needs forked processes (Linux); use --workers 1 here")
    if workers > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ForgetlessError("--workers and torchrun do not mix: torchrun already runs one process per rank")


def run_jobs(jobs: list[Callable], workers: int, done: Callable[[int, object], None],
             seconds: list[float] | None = None):
    """Run `jobs`; `done(i, result)` in the parent as each finishes (in order when workers == 1). With their
    estimated `seconds`, workers take the longest first (the last to finish then waits least for the others)."""
    if workers == 1 or len(jobs) < 2:
        for i, job in enumerate(jobs):
            done(i, job())
        return
    global _jobs
    _jobs = jobs
    order = sorted(range(len(jobs)), key=lambda i: -seconds[i]) if seconds else range(len(jobs))
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(jobs)), _start_worker,
                                                      (worker_threads(workers),)) as pool:
            for i, result in pool.imap_unordered(_run, order):
                done(i, result)
    finally:
        _jobs = []


def worker_threads(workers: int) -> int:
    """Threads each of `workers` processes gets: this process's share of them."""
    return max(1, torch.get_num_threads() // workers)


def _start_worker(threads: int):
    torch.set_num_threads(threads)
    console.quiet = True


def _run(i: int):
    return i, _jobs[i]()
