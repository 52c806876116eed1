"""Peak resident memory of this process while a block runs (sampled by a thread)."""
from __future__ import annotations

import ctypes
import os
import resource
import threading
import time


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
