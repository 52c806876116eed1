"""Progress of every long loop: rich bars on a terminal (nested runs share one live display); on a log
file or pipe, where bars never show, a plain line per loop every `LOG_EVERY_S` seconds (also while one
step takes minutes) and at its end, with the count, the loop's numbers and the time left."""
from __future__ import annotations

import contextlib
import threading
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

console = Console(stderr=True)
_live: Progress | None = None
LOG_EVERY_S = 30.0


@contextlib.contextmanager
def progress_task(desc: str, total: int, completed: int = 0, percent: bool = False, rate: float | None = None):
    """Yield `advance(n, **fields)`; shows a bar with loss and ETA on stderr (plain lines off a terminal).
    `percent`: the count is in units a user does not read (e.g. estimated seconds): show a percentage.
    `rate`: the units per second expected, for the time left until the first units are done (log lines).
    Ranks other than 0 of a torchrun show nothing (their console is quiet)."""
    if console.quiet:
        yield lambda n=1, **fields: None
        return
    if not console.is_terminal:
        with plain_progress(desc, total, completed, percent, rate) as advance:
            yield advance
        return
    global _live
    owner = _live is None
    if owner:
        _live = Progress(TextColumn("[bold]{task.description}"), BarColumn(), CountColumn(),
                         TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                         console=console, transient=False)
        _live.start()
    progress = _live
    task = progress.add_task(escape(desc), total=total, completed=completed, info="", percent=percent)
    try:
        def advance(n: int = 1, **fields):
            progress.update(task, advance=n, info=escape(info_text(fields)))
        yield advance
    finally:
        if owner:
            progress.stop()
            _live = None
        else:
            progress.remove_task(task)


class CountColumn(ProgressColumn):
    """12/32, or 38% for a task counted in units a user does not read."""

    def render(self, task) -> Text:
        return Text(f"{task.percentage:>3.0f}%" if task.fields.get("percent") else f"{task.completed:.0f}/{task.total:.0f}")


@contextlib.contextmanager
def plain_progress(desc: str, total: int, completed: int = 0, percent: bool = False, rate: float | None = None):
    """`progress_task` for logs: "desc: 12/32 loss 2.31 · 1m 40s, ~2m 47s left" lines."""
    start, done, last = time.monotonic(), completed, {"at": time.monotonic(), "info": ""}

    def line():
        elapsed = time.monotonic() - start
        if done > completed and elapsed > 0:
            left_s = max(0, total - done) * elapsed / (done - completed)
        else:  # nothing counted yet: the expected rate, if given
            left_s = max(0.0, (total - completed) / rate - elapsed) if rate else None
        left = f", ~{duration(left_s)} left" if left_s is not None and done < total else ""
        count = f"{100 * done / max(total, 1):.0f}%" if percent else f"{done}/{total}"
        console.print(f"{desc}: {count} {last['info']}".rstrip() + f" · {duration(elapsed)}{left}",
                      markup=False, highlight=False, soft_wrap=True)
        last["at"] = time.monotonic()

    def advance(n: int = 1, **fields):
        nonlocal done
        done += n
        last["info"] = info_text(fields) or last["info"]
        if time.monotonic() - last["at"] >= LOG_EVERY_S and done < total:
            line()

    def heartbeat():  # a loop whose steps take minutes (a bench's arms) still logs every LOG_EVERY_S (0: only steps)
        while not stopped.wait(LOG_EVERY_S or None):
            if time.monotonic() - last["at"] >= LOG_EVERY_S:
                line()

    stopped = threading.Event()
    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        yield advance
    finally:
        stopped.set()
        beat.join()
    if done > completed:
        line()


def info_text(fields: dict) -> str:
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


def duration(seconds: float) -> str:
    """2h 05m, 3m 07s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"
