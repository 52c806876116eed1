"""Peak resident memory of this process while a block runs (sampled by a thread), and the C heap's settings that
keep it near the live tensors' bytes on CPU."""
from __future__ import annotations

import ctypes
import os
import resource
import threading
import time

from forgetless.errors import ForgetlessError

HEAP_ENV = "FORGETLESS_HEAP"  # lean (default) or glibc: how `adapt` sets the C heap on CPU
MMAP_THRESHOLD = 1 << 20  # bytes: allocations this large or larger get their own mapping under the lean heap
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: the high-water mark is the best we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def release_memory():
    """Give freed heap pages back to the OS (glibc), so the next peak is not inflated."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def lean_heap() -> str | None:
    """Bound the process's resident memory by the tensors alive, for a training run on CPU: glibc serves every
    allocation of MMAP_THRESHOLD bytes or more from its own mapping, given back to the OS when freed. By default
    glibc raises that threshold as large blocks are freed (up to 32 MiB), so a training step's activations,
    gradients and chunks of logits come from the heap, whose freed holes stay resident: on SmolLM2-135M,
    `adapt --method ewc-distill` peaked at 6.2-6.3 GiB, and 4.2 GiB with the lean heap (docs/results/memory.md).
    The price is fresh pages for every large allocation (1.16-1.26x the training's time there; bench_heap.py).
    $FORGETLESS_HEAP=glibc keeps glibc's default. Returns a note when the lean heap was asked for and cannot act (a
    C library other than glibc)."""
    choice = os.environ.get(HEAP_ENV, "lean")
    if choice not in ("lean", "glibc"):
        raise ForgetlessError(f"${HEAP_ENV} is {choice!r}; set it to lean (the default: resident memory near the live "
                              "tensors) or glibc (glibc's own heap: faster, more resident memory), or unset it")
    if choice == "glibc":
        return None
    try:
        done = ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        done = False
    if done or HEAP_ENV not in os.environ:
        return None
    return f"${HEAP_ENV}=lean has no effect here: it sets glibc's heap, and this C library is not glibc"


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.peak_mb`."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak_mb = interval, 0.0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb())
            time.sleep(self.interval)

    def __enter__(self):
        release_memory()
        self.peak_mb = rss_mb()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, rss_mb())
