"""The docs as a reader meets them: the README is a landing page, RESULTS opens with a short claims table and a
table of contents, the generated parts match the code, and the MkDocs site builds in strict mode (broken links,
anchors and API names fail)."""
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sync_docs  # noqa: E402


def test_generated_parts_match_the_code():
    """The README's method guide (guide.py), the option tables of docs/methods.md (each method's config) and
    RESULTS' table of contents are what scripts/sync_docs.py generates: run it after changing those."""
    stale = [p.name for p in sync_docs.FILES if not sync_docs.sync(p, write=False)]
    assert not stale, f"stale generated blocks in {stale}: run python scripts/sync_docs.py"


def test_every_method_has_its_options_in_the_methods_guide():
    from forgetless.methods import METHODS
    text = (ROOT / "docs/methods.md").read_text()
    documented = set(re.findall(r"<!-- generated: options ([\w-]+)", text))
    assert documented == set(METHODS), set(METHODS) ^ documented


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    first = "\n".join(lines[:80])
    assert "forgetless.data.load(" in first and "forgetless.attach(" in first  # your model, your data
    assert "| you have | method |" in first                                   # which method
    assert "forgetless adapt --model" in "\n".join(lines)


def summary_rows() -> list[list[str]]:
    text = (ROOT / "docs/RESULTS.md").read_text()
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    table = [line for line in summary.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


def test_results_opens_with_the_claims_in_short_and_a_table_of_contents():
    text = (ROOT / "docs/RESULTS.md").read_text()
    sections = [h for h in re.findall(r"^## (.+)$", text, flags=re.M)]
    assert sections[:2] == ["Summary: what each source claims, and what was measured here", "Contents"]
    header, _, *rows = summary_rows()
    assert header[:2] == ["source", "verdict"] and len(rows) >= 10
    anchors = {sync_docs.anchor(title) for _, title in sync_docs.headings(text)}
    for row in rows:
        assert len(row) == len(header), row
        assert re.search(r"\*\*(holds|partly|does not hold|not shown|not seen)\*\*", row[1]), row[1]
        for cell in row:
            assert len(cell) <= 200, f"{len(cell)} characters: {cell[:80]}..."
        links = re.findall(r"\]\(#([^)]+)\)", row[-1])
        assert links and set(links) <= anchors, row[-1]
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    assert set(listed) <= anchors and len(listed) == len(sync_docs.headings(text)) - 2  # all but title, Contents
    assert not re.search(r"\bissues? #?\d", text, flags=re.I), "RESULTS names an issue number readers cannot see"


mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings")
                            is None, reason="the docs site needs mkdocs and mkdocstrings[python] (the dev extra)")


@mkdocs
def test_docs_site_builds_in_strict_mode(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Which method, when" in home and 'href="RESULTS/#' in home  # the README, its docs/ links rewritten
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("attach", "from_pretrained", "Adapted", "ForgetlessCallback", "Collator", "mix", "load"):
        assert f"forgetless.adapted.{name}" in api or name in api


@mkdocs
def test_docs_site_fails_on_a_broken_anchor(tmp_path):
    """The same settings on a one-page copy with a link to a missing section: strict mode refuses it."""
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^hooks:.*?(?=^\w)|^plugins:.*?(?=^\w)|^nav:.*", "", config)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the results](other.md#no-such-section).\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no-such-section" in run.stdout + run.stderr
    shutil.rmtree(tmp_path / "site", ignore_errors=True)
