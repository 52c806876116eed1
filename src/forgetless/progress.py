"""Rich progress bars shared by every long loop (nested runs share one live display)."""
from __future__ import annotations

import contextlib

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
_live: Progress | None = None


@contextlib.contextmanager
def progress_task(desc: str, total: int, completed: int = 0):
    """Yield `advance(n, **fields)`; shows a bar with loss and ETA on stderr."""
    global _live
    owner = _live is None
    if owner:
        _live = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                         console=console, transient=False)
        _live.start()
    progress = _live
    task = progress.add_task(escape(desc), total=total, completed=completed, info="")
    try:
        def advance(n: int = 1, **fields):
            info = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
            progress.update(task, advance=n, info=escape(info))
        yield advance
    finally:
        if owner:
            progress.stop()
            _live = None
        else:
            progress.remove_task(task)
