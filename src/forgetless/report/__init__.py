"""Write a run's results: JSON (the contract), CSV, Markdown and figures."""
from __future__ import annotations

from pathlib import Path

from forgetless.checkpoint import write_json
from forgetless.report.figures import write_figures
from forgetless.report.tables import markdown, write_csv


def write_report(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    write_csv(results, out / "results.csv")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.csv", out / "results.md", *write_figures(results, out)]
