"""Move sections of docs/RESULTS.md (the results' front page) to the end of a page under docs/results/, verbatim:

    python scripts/move_results.py PAGE.md "HEADING" ["HEADING" ...]
    python scripts/sync_docs.py          # then: the pages' contents and the front page's list of pages

A HEADING is the start of a `## ` heading of RESULTS.md; its section moves with its subsections, up to the next
`## ` heading. The moved text's relative links are rewritten for docs/results/ (`figures/..` becomes
`../figures/..`), and every link in README.md and docs/ to a results section that moved is pointed at the page
that holds it now. A section added at the end of RESULTS.md (where a new result used to go) reaches its page this
way; a new result can also be written at the end of its page directly.

    python scripts/move_results.py --new-from OTHER.md

appends to RESULTS.md the `## ` sections of OTHER.md (e.g. `git show BRANCH:docs/RESULTS.md`, a branch's
RESULTS.md from before the pages) that no results file holds yet, and names the sections both hold whose text
differs (links aside): edits to merge by hand. Then move the new ones to their pages as above."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRONT = ROOT / "docs" / "RESULTS.md"
PAGES = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "scripts"))
from sync_docs import anchor, headings, sections

LINK = re.compile(r"(\]\(|href=\")([^)\s\"]*)")  # a Markdown link's or an HTML href's target
CODE = re.compile(r"(^```.*?^```|`[^`\n]*`)", re.M | re.S)  # fenced blocks and code spans hold no links


def outside_code(text: str, change) -> str:
    """`change` applied to the parts of `text` outside code."""
    return "".join(part if i % 2 else change(part) for i, part in enumerate(CODE.split(text)))


def relocate(text: str, old: Path, new: Path) -> str:
    """`text`'s relative file links, written in folder `old`, rewritten to work from folder `new`."""
    def target(m: re.Match) -> str:
        link = m.group(2)
        file, hash_, fragment = link.partition("#")
        if not file or re.match(r"[a-z]+:", file) or old == new:
            return m.group(0)
        moved = os.path.relpath(os.path.normpath(old / file), new)
        return m.group(1) + moved + hash_ + fragment
    return outside_code(text, lambda part: LINK.sub(target, part))


def results_files() -> list[Path]:
    return [FRONT, *sorted(PAGES.glob("*.md"))]


def repoint(paths: list[Path]) -> list[Path]:
    """Point every link in `paths` to a results section at the file that holds that section now; the changed."""
    held = {path: {anchor(title) for _, title in headings(path.read_text(encoding="utf-8"))}
            for path in results_files()}
    changed = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = outside_code(text, lambda part, path=path: LINK.sub(lambda m: repointed(m, path, held), part))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def repointed(m: re.Match, path: Path, held: dict[Path, set[str]]) -> str:
    """Link `m` in `path`, pointed at the one results file that holds its anchor (`held`: file -> its anchors)
    where the file it names does not."""
    file, hash_, fragment = m.group(2).partition("#")
    linked = (path.parent / file).resolve() if file else path
    holders = [where for where, anchors in held.items() if fragment in anchors]
    if not hash_ or linked not in held or fragment in held[linked] or len(holders) != 1:
        return m.group(0)
    return m.group(1) + ("" if holders[0] == path else os.path.relpath(holders[0], path.parent)) + "#" + fragment


def move(page: Path, starts: list[str]) -> None:
    """Move the `## ` sections of RESULTS.md whose headings start with `starts` to the end of `page`."""
    parts = sections(FRONT.read_text(encoding="utf-8"))
    moving = []
    for start in starts:
        found = [i for i, part in enumerate(parts) if part.startswith("## " + start)]
        if len(found) != 1:
            raise SystemExit(f"{len(found)} sections of {FRONT.relative_to(ROOT)} start with '## {start}': "
                             "give one heading's start")
        moving += found
    body = "".join(relocate(parts[i], FRONT.parent, page.parent) for i in moving)
    kept = "".join(part for i, part in enumerate(parts) if i not in moving)
    text = page.read_text(encoding="utf-8")
    page.write_text(text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n", encoding="utf-8")
    FRONT.write_text(kept.rstrip("\n") + "\n", encoding="utf-8")


def bare(text: str) -> str:
    """`text` with every link target cut to its anchor (or its file name), for comparing sections across pages."""
    text = re.sub(r"(\]\(|href=\")[^)\s\"#]*#", r"\1#", text)
    return re.sub(r"(\]\()(?:\.\./)*", r"\1", text).strip()


def new_from(other: Path) -> None:
    """Append `other`'s sections that no results file holds to RESULTS.md; name those held with other text."""
    held = {}
    for path in results_files():
        for part in sections(path.read_text(encoding="utf-8"))[1:]:
            held[part.split("\n", 1)[0]] = (path, part)
    new, edited = [], []
    for part in sections(other.read_text(encoding="utf-8"))[1:]:
        heading = part.split("\n", 1)[0]
        if heading not in held:
            new.append(part)
        elif bare(part) != bare(held[heading][1]) and heading not in ("## Contents", "## Summary"):
            edited.append(f"{heading} ({held[heading][0].relative_to(ROOT)})")
    if new:
        FRONT.write_text(FRONT.read_text(encoding="utf-8").rstrip("\n") + "\n\n" + "".join(new), encoding="utf-8")
    print(f"appended {len(new)} new section(s) to {FRONT.relative_to(ROOT)}:",
          *(part.split("\n", 1)[0] for part in new), sep="\n  ")
    if edited:
        print("held with other text (merge by hand):", *edited, sep="\n  ")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--new-from":
        new_from(Path(argv[1]))
        return 0
    if len(argv) < 2:
        print(__doc__)
        return 2
    page = PAGES / argv[0]
    if not page.is_file():
        raise SystemExit(f"{page.relative_to(ROOT)} does not exist: write its title and summary first (and add it to "
                         "mkdocs.yml's nav under Results)")
    move(page, argv[1:])
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    changed = repoint([p for p in docs if "figures" not in p.relative_to(ROOT).parts])
    print(f"moved {len(argv) - 1} section(s) to {page.relative_to(ROOT)}; links re-pointed in "
          f"{len(changed)} file(s); now run python scripts/sync_docs.py")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
