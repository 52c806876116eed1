"""What each kind of results file is written as (docs/DESIGN.md §6.3): a `Report` declares the results it reads
(their `protocol` value and the top-level keys only they have), its CSV, Markdown, figures, terminal tables and
trade-off frontier. Reports register themselves, as protocols and methods do; `report_for(results)` finds a file's
(each protocol in continual/ names the report it writes: `Protocol.report`).

    SEQUENCE = register_report(Report("sequence", write_sequence_csv, sequence_markdown, sequence_figures,
                                      one_table(sequence_terminal_rows), tasks_text, frontier=LA_BWT))
    report_for(RunResult.load(Path("runs/sequence-smoke"))).markdown(results)
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from forgetless.errors import ForgetlessError
from forgetless.report.results import RunResult


@dataclass(frozen=True)
class Report:
    """The files and terminal tables of one kind of results."""
    protocol: str                                         # the results' `protocol` value
    csv: Callable[[RunResult, Path], None]                # writes results.csv
    markdown: Callable[[RunResult], str]                  # results.md (the frontier's tables follow it)
    figures: Callable[[RunResult, Path], list[Path]]      # draws its figures (matplotlib there), returns them
    terminal: Callable[[RunResult, str, str], list]       # (results, title, caption) -> the rich tables bench prints
    where: Callable[[RunResult], str]                     # what the run learned, for the terminal title
    marks: tuple[str, ...] = ()                           # top-level keys only its results have (of its `protocol`)
    frontier: object = None                               # its trade-off frontier (report/frontier.py), or None


REPORTS: list[Report] = []


def register_report(report: Report) -> Report:
    REPORTS.append(report)
    return report


def report_for(results: RunResult) -> Report:
    """The registered report of `results`: of those for its `protocol` value, the one whose marks it has, most
    marks first."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):  # the reports register themselves
        importlib.import_module(f"forgetless.report.{info.name}")
    fits = [r for r in REPORTS if r.protocol == results.protocol and all(k in results.extra for k in r.marks)]
    if not fits:
        raise ForgetlessError(f"no report writes results of protocol {results.protocol!r}; known: "
                              f"{', '.join(sorted({r.protocol for r in REPORTS}))} (is the file a forgetless "
                              "results.json?)")
    return max(fits, key=lambda r: len(r.marks))
