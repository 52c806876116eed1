"""Write a run's results (a `RunResult`, report/results.py): JSON (the contract), CSV, Markdown and figures (figures
need the `plots` extra, matplotlib: without it the tables are written and the figures skipped, with one line saying
so). What each kind of results is written as is its `Report` (report/kinds.py), found by `report_for`; the two-domain
and sequence reports are declared here, the online and study reports in their own files."""
from __future__ import annotations

from pathlib import Path

from forgetless import distributed
from forgetless.report import figures as drawing
from forgetless.report.diagnostics import method_figures
from forgetless.report.figures import r_heatmaps, r_matrices, write_figures
from forgetless.report.frontier import (ACCURACY, GAIN, curves, frontier_figure, frontier_markdown, matched,
                                        matched_markdown, operating_points)
from forgetless.report.kinds import Report, register_report, report_for
from forgetless.report.results import RunResult
from forgetless.report.tables import (domains_text, markdown, one_table, sequence_markdown, sequence_terminal_rows,
                                      tasks_text, terminal_rows, write_csv, write_sequence_csv)


def write_report(results: RunResult, out: Path, figures: bool = True) -> list[Path]:
    """results.json/csv/md and figures in `out` (none with `figures` False: `forgetless report` draws them later),
    as the results' report says; a run with sweeps on a report with a frontier also gets `frontier` (JSON, Markdown)
    and frontier.png. Under torchrun rank 0 writes them; the others wait in the barrier that pairs with the one
    ending write_json (results.json), and return no files."""
    if not distributed.is_main():
        distributed.barrier()
        return []
    out.mkdir(parents=True, exist_ok=True)
    report = report_for(results)
    frontier, missing = report.frontier, None
    if frontier is not None and not curves(results):  # no sweep: no curve to draw a frontier on
        frontier = None
    if frontier is not None and (missing := frontier.undefined(results)):
        frontier = None
    if frontier is not None:
        results.extra["frontier"] = operating_points(results, frontier)
        if found := matched(results, frontier):
            results.extra["matched"] = found
    results.save(out)
    report.csv(results, out / "results.csv")
    text = report.markdown(results)
    if missing:
        text += f"\nNo trade-off frontier: some arms have no {missing} (e.g. BWT in a sequence of one task).\n"
    if frontier is not None and results.extra.get("frontier"):
        text += "\n".join(frontier_markdown(results.extra["frontier"])) + "\n"
    if frontier is not None and results.extra.get("matched"):
        text += "\n".join(matched_markdown(results, frontier)) + "\n"
    (out / "results.md").write_text(text)
    tables = [out / "results.json", out / "results.csv", out / "results.md"]
    if not figures:
        return tables
    if not drawing.available():
        return skipped(tables)
    drawn = report.figures(results, out)
    if frontier is not None and frontier_figure(results, out / "frontier.png", frontier):
        drawn.append(out / "frontier.png")
    return [*tables, *drawn]


def skipped(files: list[Path]) -> list[Path]:
    """The files written when matplotlib is missing, after one line on the console saying how to get figures."""
    from forgetless.progress import console
    console.print(drawing.PLOTS_MISSING, markup=False, highlight=False, soft_wrap=True)
    return files


def terminal_table(results: RunResult, title: str, caption: str):
    """The (first) rich table `forgetless bench` prints for these results (their report's)."""
    return report_for(results).terminal(results, title, caption)[0]


def sequence_figures(results: RunResult, out: Path) -> list[Path]:
    r_heatmaps(r_matrices(results), out / "r_matrix.png")
    return [out / "r_matrix.png", *method_figures(results, out)]


def two_domain_figures(results: RunResult, out: Path) -> list[Path]:
    return [*write_figures(results, out), *method_figures(results, out)]


TWO_DOMAIN = register_report(Report("two-domain", write_csv, markdown, two_domain_figures, one_table(terminal_rows),
                                    domains_text, frontier=GAIN))
SEQUENCE = register_report(Report("sequence", write_sequence_csv, sequence_markdown, sequence_figures,
                                  one_table(sequence_terminal_rows), tasks_text, frontier=ACCURACY))
