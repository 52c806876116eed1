"""The docs as a reader meets them: the README is a landing page, the results' front page (docs/RESULTS.md) is short
and opens with the claims table, each results page opens with its summary and contents, the generated parts match
the code, and the MkDocs site builds in strict mode (broken links, anchors and API names fail)."""
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
    """The README's method guide (guide.py), docs/methods.md's option blocks and DESIGN's method table (the
    registry) and the results' lists of contents are what scripts/sync_docs.py generates: run it after changing
    those."""
    stale = [p.name for p in sync_docs.files() if not sync_docs.sync(p, write=False)]
    assert not stale, f"stale generated blocks in {stale}: run python scripts/sync_docs.py"


def test_every_method_has_its_options_in_the_methods_guide_once():
    from forgetless.methods import METHODS
    text = (ROOT / "docs/methods.md").read_text()
    documented = [n.strip() for names in re.findall(r"<!-- generated: options ([^>]+?) -->", text)
                  for n in names.split(",")]
    assert sorted(documented) == sorted(METHODS), set(METHODS) ^ set(documented)


def test_a_method_that_no_heading_names_gets_a_section_and_a_heading_its_options():
    """The option blocks come from the registry: a section naming `lora` gets its block after its first paragraph,
    every other method a section of its own after it."""
    from forgetless.methods import METHODS
    text = "# Methods\n\n## LoRA: `lora`\n\nLow-rank updates.\n\n- **When**: often.\n\n## Your own\n\nWrite one.\n"
    done = sync_docs.method_sections(text)
    assert done.startswith("# Methods\n\n## LoRA: `lora`\n\nLow-rank updates.\n\n<!-- generated: options lora -->\n"
                           "<!-- /generated -->\n\n- **When**: often.\n\n## `")
    added = re.findall(r"^## `([^`]+)`$", done, flags=re.M)
    assert sorted(added) == sorted(set(METHODS) - {"lora"}) and done.endswith("## Your own\n\nWrite one.\n")
    assert sync_docs.method_sections(done) == done
    filled = sync_docs.BLOCK.sub(lambda m: m.group(1) + sync_docs.generate(m.group("name"), ROOT / "docs/methods.md")
                                 + m.group(4), done)
    assert "| `r` | `8` | LoRA rank |" in filled and "`apn-local` takes the same options as `apn`" in filled


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    first = "\n".join(lines[:80])
    assert "forgetless.data.load(" in first and "forgetless.attach(" in first  # your model, your data
    assert "| you have | method |" in first                                   # which method
    assert "forgetless adapt --model" in "\n".join(lines)


def summary_rows() -> list[list[str]]:
    text = (ROOT / "docs/RESULTS.md").read_text()
    summary = text.split("\n## Summary", 1)[1].split("\n## ", 1)[0]
    table = [line for line in summary.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]


def anchors_of(path: Path) -> set[str]:
    return {sync_docs.anchor(title) for _, title in sync_docs.headings(path.read_text())}


def test_the_results_front_page_is_short_and_opens_with_the_claims():
    front = ROOT / "docs/RESULTS.md"
    text = front.read_text()
    assert len(text.splitlines()) <= 300
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections[0] == "Summary: what each source claims, and what was measured here" and "The pages" in sections
    header, _, *rows = summary_rows()
    assert header[:2] == ["source", "verdict"] and len(rows) >= 10
    for row in rows:
        assert len(row) == len(header), row
        assert re.search(r"\*\*(holds|partly|does not hold|not shown|not seen)\*\*", row[1]), row[1]
        for cell in row:
            assert len(cell) <= 200, f"{len(cell)} characters: {cell[:80]}..."
        links = re.findall(r"\]\((results/[\w-]+\.md)#([^)]+)\)", row[-1])
        assert links and all(anchor in anchors_of(ROOT / "docs" / page) for page, anchor in links), row[-1]
    listed = re.findall(r"\]\((results/[\w-]+\.md)\)", text.split("## The pages", 1)[1])
    assert listed == [str(p.relative_to(ROOT / "docs")) for p in sync_docs.results_pages()]
    assert set(listed) == {f"results/{p.name}" for p in (ROOT / "docs/results").glob("*.md")}


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs/results").glob("*.md")))
def test_each_results_page_opens_with_its_summary_and_contents(page):
    text = (ROOT / "docs/results" / page).read_text()
    found = sync_docs.headings(text)
    assert found[0][0] == 1 and [t for _, t in found[1:3]] == ["Summary", "Contents"], found[:3]
    summary = text.split("## Summary\n", 1)[1].split("\n## Contents", 1)[0].strip()
    assert summary and "TODO" not in summary and len(summary.splitlines()) <= 30
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"\]\(#([^)]+)\)", contents)) == len(found) - 2  # all but the title and Contents
    anchors = [sync_docs.anchor(t) for _, t in found]
    assert len(anchors) == len(set(anchors)), "two headings of one page share an anchor"


@pytest.mark.parametrize("doc", ["docs/RESULTS.md", *sorted(f"docs/results/{p.name}" for p in
                                                           (ROOT / "docs/results").glob("*.md"))])
def test_results_name_no_issue_numbers(doc):
    text = (ROOT / doc).read_text()
    assert not re.search(r"\bissues? #?\d", text, flags=re.I), f"{doc} names an issue number readers cannot see"


mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings")
                            is None, reason="the docs site needs mkdocs and mkdocstrings[python] (the dev extra)")


@mkdocs
def test_docs_site_builds_in_strict_mode(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Which method, when" in home and 'href="RESULTS/#' in home  # the README, its docs/ links rewritten
    for page in sync_docs.results_pages():  # every results page is built
        assert (tmp_path / "site" / "results" / page.stem / "index.html").is_file(), page.name
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


def test_a_moved_section_keeps_its_links_working():
    """scripts/move_results.py rewrites a section's relative links for docs/results/; anchors, URLs and code stay."""
    import move_results
    text = ("![f](figures/x/a.png) [d](DESIGN.md#6-names) [s](#a-section) [w](https://x.org/y.md) "
            "`[c](figures/c.png)`\n")
    moved = move_results.relocate(text, ROOT / "docs", ROOT / "docs" / "results")
    assert moved == ("![f](../figures/x/a.png) [d](../DESIGN.md#6-names) [s](#a-section) [w](https://x.org/y.md) "
                     "`[c](figures/c.png)`\n")
    assert move_results.bare(moved) == move_results.bare(text)


def test_the_guides_evidence_needs_a_page_and_an_anchor(tmp_path, capsys):
    import guide_evidence
    (tmp_path / "results.json").write_text("{}")
    for section in ("the-studys-anchor", "no-such-page.md#the-studys-anchor"):
        with pytest.raises(SystemExit) as stop:
            guide_evidence.main([str(tmp_path), "--section", section, "--study-command", "x"])
        assert stop.value.code == 2 and "give PAGE.md#ANCHOR" in capsys.readouterr().err
