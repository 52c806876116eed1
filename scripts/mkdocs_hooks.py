"""MkDocs hooks (mkdocs.yml `hooks:`): the repository's README.md is the site's home page.

README.md lives at the repository root, where GitHub shows it, and links into docs/ as `docs/X.md`; the
guides link back to it as `../README.md`. On the site the README is `index.md` inside docs/, so those
links are rewritten here; everything else (strict mode, anchors) is checked by MkDocs itself."""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=(ROOT / "README.md").read_text(encoding="utf-8")))
    return files


CODE = re.compile(r"(^```.*?^```|`[^`\n]*`)", re.M | re.S)  # fenced blocks and code spans


def on_page_markdown(markdown: str, page, config, files):
    if page.file.src_uri == "index.md":
        markdown = re.sub(r"\]\(docs/", "](", markdown)  # README's docs/X.md is X.md beside index.md
    else:
        markdown = re.sub(r"\]\(\.\./README\.md", "](index.md", markdown)
    if page.file.src_uri == "api.md":
        return markdown
    # R[t][i] in prose is an index, as GitHub shows it, not a reference link that mkdocstrings' autorefs resolves
    parts = CODE.split(markdown)
    return "".join(part if i % 2 else re.sub(r"\](?=\[[^\]\s]*\](?!\())", r"]\\", part) for i, part in enumerate(parts))
