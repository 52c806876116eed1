"""Write a run's results (a `RunResult`, report/results.py): JSON (the contract), CSV, Markdown and figures (figures
need the `plots` extra, matplotlib: without it the tables are written and the figures skipped, with one line saying
so)."""
from __future__ import annotations

from pathlib import Path

from forgetless import distributed
from forgetless.report import figures as drawing
from forgetless.report.diagnostics import method_figures
from forgetless.report.figures import r_heatmaps, write_figures
from forgetless.report.online import (online_figure, online_markdown, online_terminal_rows, online_tradeoff,
                                      write_online_csv)
from forgetless.report.frontier import (curves, frontier_figure, frontier_markdown, matched, matched_markdown,
                                        operating_points)
from forgetless.report.results import RunResult
from forgetless.report.study import op_vs_bwt, study_markdown
from forgetless.report.tables import (markdown, rich_table, sequence_markdown, sequence_terminal_rows, terminal_rows,
                                      write_csv, write_sequence_csv)


def write_report(results: RunResult, out: Path, figures: bool = True) -> list[Path]:
    """results.json/csv/md and figures in `out` (none with `figures` False: `forgetless report` draws them later);
    a run with sweeps also gets `frontier` (JSON, Markdown) and frontier.png. Under torchrun rank 0 writes them;
    the others wait in the barrier that pairs with the one ending write_json (results.json), and return no files."""
    if not distributed.is_main():
        distributed.barrier()
        return []
    out.mkdir(parents=True, exist_ok=True)
    if "study" in results.extra:
        return write_study(results, out)
    if results.protocol != "online" and curves(results):  # the online protocol has no frontier
        results.extra["frontier"] = operating_points(results)
        if found := matched(results):
            results.extra["matched"] = found
    results.save(out)
    if results.protocol == "online":
        write_online_csv(results, out / "results.csv")
        (out / "results.md").write_text(online_markdown(results))
        tables = [out / "results.json", out / "results.csv", out / "results.md"]
        if not drawing.available():
            return skipped(tables)
        online_figure(results, out / "online.png")
        online_tradeoff(results, out / "online_tradeoff.png")
        return [*tables, out / "online.png", out / "online_tradeoff.png"]
    sequence = results.protocol == "sequence"
    (write_sequence_csv if sequence else write_csv)(results, out / "results.csv")
    text = sequence_markdown(results) if sequence else markdown(results)
    if results.extra.get("frontier"):
        text += "\n".join(frontier_markdown(results.extra["frontier"])) + "\n"
    if results.extra.get("matched"):
        text += "\n".join(matched_markdown(results)) + "\n"
    (out / "results.md").write_text(text)
    tables = [out / "results.json", out / "results.csv", out / "results.md"]
    if not figures:
        return tables
    if not drawing.available():
        return skipped(tables)
    if sequence:
        r_heatmaps(r_matrices(results), out / "r_matrix.png")
        figures = [out / "r_matrix.png", *method_figures(results, out)]
    else:
        figures = [*write_figures(results, out), *method_figures(results, out)]
    if frontier_figure(results, out / "frontier.png"):
        figures.append(out / "frontier.png")
    return [*tables, *figures]


def write_study(results: RunResult, out: Path) -> list[Path]:
    """A study's files (continual/study.py): results.json, .csv (the main order's sequence columns), .md (the field's
    table, published rows, lr grid, the main order in full) and figures (R matrices, OP against BWT)."""
    results.save(out)
    write_sequence_csv(results, out / "results.csv")
    (out / "results.md").write_text(study_markdown(results))
    tables = [out / "results.json", out / "results.csv", out / "results.md"]
    if not drawing.available():
        return skipped(tables)
    study = results.extra["study"]
    r_heatmaps(r_matrices(results), out / "r_matrix.png", title=f"R of each method: order {study['main_order']} of the "
               f"{study['stream'] if ',' not in study['stream'] else 'task'} stream, mean over seeds "
               f"{results.seeds}; column 0: general text")
    op_vs_bwt(results, out / "op_vs_bwt.png")
    return [*tables, out / "r_matrix.png", out / "op_vs_bwt.png"]


def skipped(files: list[Path]) -> list[Path]:
    """The files written when matplotlib is missing, after one line on the console saying how to get figures."""
    from forgetless.progress import console
    console.print(drawing.PLOTS_MISSING, markup=False, highlight=False, soft_wrap=True)
    return files


def terminal_table(results: RunResult, title: str, caption: str):
    """The rich table `forgetless bench` prints: the terminal columns of either protocol."""
    rows_of = {"two-domain": terminal_rows, "sequence": sequence_terminal_rows, "online": online_terminal_rows}
    return rich_table(*rows_of[results.protocol](results), title, caption)


def r_matrices(results: RunResult) -> dict:
    """Label -> the method's R matrix (seed means), for r_heatmaps."""
    return {label: m.stats["r_matrix"] for label, m in results.methods.items()}
