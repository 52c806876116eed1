"""Write a run's results: JSON (the contract), CSV, Markdown and figures."""
from __future__ import annotations

from pathlib import Path

from forgetless.checkpoint import write_json
from forgetless.report.figures import method_figures, r_heatmaps, write_figures
from forgetless.report.tables import markdown, sequence_markdown, write_csv, write_sequence_csv


def write_report(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    if results["protocol"] == "sequence":
        write_sequence_csv(results, out / "results.csv")
        (out / "results.md").write_text(sequence_markdown(results))
        r_heatmaps(results, out / "r_matrix.png")
        return [out / "results.json", out / "results.csv", out / "results.md", out / "r_matrix.png",
                *method_figures(results, out)]
    write_csv(results, out / "results.csv")
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.csv", out / "results.md", *write_figures(results, out)]
