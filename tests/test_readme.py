"""The README's Python examples run as written, each in a new process, one after another in one
folder (a later example may load what an earlier one saved), and print what the README says they
print: every block is followed by `<!-- prints: REGEX -->`."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```\n(?:<!-- prints: (.*?) -->)?", README.read_text(), re.S)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


def test_readme_has_examples_with_expected_output():
    assert len(EXAMPLES) >= 5 and all(expected for _, expected in EXAMPLES)


@pytest.mark.parametrize("code,expected", EXAMPLES, ids=[f"block{i}" for i in range(len(EXAMPLES))])
def test_readme_python_example_runs(code, expected, folder):
    run = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(expected, run.stdout, re.M), run.stdout


def anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", "docs/RESULTS.md", "docs/DESIGN.md"])
def test_links_to_sections_and_files_resolve(doc):
    """Every [text](#anchor), [text](FILE#anchor) and relative file link of a doc points at something that exists."""
    root = Path(__file__).resolve().parent.parent
    path = root / doc
    broken = []
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", path.read_text(), flags=re.S)  # no links in code
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            if fragment not in {anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc}: links to nothing: {broken}"
