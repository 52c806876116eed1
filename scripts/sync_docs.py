"""The generated parts of the docs, kept in step with the code they describe:

- README.md's method guide (a decision table) and docs/methods.md's table of its evidence, from the rows of
  src/forgetless/guide.py (`forgetless methods` prints the same);
- docs/methods.md's option tables, from each method's config dataclass (the `help` of its fields);
- docs/RESULTS.md's table of contents, from its headings.

Each part sits between `<!-- generated: NAME -->` and `<!-- /generated -->`. `python scripts/sync_docs.py`
rewrites them; `python scripts/sync_docs.py --check` changes nothing and exits 1 when one is stale
(tests/test_docs.py runs the check)."""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[^>]*?) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)
COMMON = ("target_modules", "exclude_modules", "optimizer", "joint")  # options every method has, described once


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def guide_table(results_link: str = "docs/RESULTS.md") -> str:
    """The method guide as a decision table: what you have -> method -> its settings in Trainer and in the CLI,
    one link to its evidence, named by its scale."""
    from forgetless.guide import GUIDE, cli_text, settings, trainer_text
    rows = ["| you have | method | in `Trainer` | in `forgetless adapt` | evidence |", "|---|---|---|---|---|"]
    for a in GUIDE:
        rows.append(f"| {cell(a.situation)} | `{a.method}` | {cell(trainer_text(settings(a)))} | {cell(cli_text(a))} "
                    f"| [{cell(a.scale)}]({results_link}#{a.anchor}) |")
    return "\n".join(rows) + "\n"


def guide_evidence(results_link: str = "RESULTS.md") -> str:
    """What was measured behind each row of the guide, at what scale (docs/methods.md)."""
    from forgetless.guide import GUIDE
    rows = ["| you have | method | measured on | what was measured |", "|---|---|---|---|"]
    rows += [f"| {cell(a.situation)} | `{a.method}` | {cell(a.scale)} | {cell(a.evidence)} "
             f"([RESULTS]({results_link}#{a.anchor})) |" for a in GUIDE]
    return "\n".join(rows) + "\n"


def option_help(cls, name: str) -> str:
    """The help of option `name`, from `cls` or the first base class that documents it."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("help"):
            return f.metadata["help"]
    return ""


def default(f) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return "protocol's" if value is None else repr(value).replace("'", "")


def options_table(method: str) -> str:
    """`method`'s options (all but the common ones) with their defaults and help; for a variant such as
    `apn-local vs apn`, the defaults in which it differs from the other method."""
    from forgetless.methods import METHODS
    name, _, other = (part.strip() for part in method.partition(" vs "))
    config = METHODS[name].Config
    fields = [f for f in dataclasses.fields(config) if f.name not in COMMON]
    if other:
        base = {f.name: default(f) for f in dataclasses.fields(METHODS[other].Config)}
        changed = [f"`{f.name}={default(f)}`" for f in fields if base.get(f.name) != default(f)]
        same = "the same options" if [f.name for f in fields] == [f for f in base if f not in COMMON] else "options"
        return (f"`{name}` takes {same} as `{other}`; its defaults differ in: "
                f"{', '.join(changed) or 'nothing (it differs in how it trains, above)'}.\n")
    rows = ["| option | default | what it sets |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{cell(default(f))}` | {cell(option_help(config, f.name))} |" for f in fields]
    return "\n".join(rows) + "\n"


def anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading (MkDocs is set to the same: pymdownx.slugs in mkdocs.yml)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every Markdown heading outside fenced code."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [(len(m.group(1)), m.group(2).strip()) for m in re.finditer(r"^(#{1,6}) (.+)$", prose, flags=re.M)]


def toc(path: str) -> str:
    """A nested list linking every section of `path` below its title (the Contents heading itself left out)."""
    lines = []
    for level, title in headings((ROOT / path).read_text(encoding="utf-8")):
        if level > 1 and title != "Contents":
            text = re.sub(r"[\[\]]", "", title)
            lines.append(f"{'  ' * (level - 2)}- [{text}](#{anchor(title)})")
    return "\n".join(lines) + "\n"


def generate(name: str) -> str:
    if name == "guide":
        return guide_table()
    if name == "guide evidence":
        return guide_evidence()
    if name.startswith("toc "):
        return toc(name.removeprefix("toc "))
    if name.startswith("options "):
        return options_table(name.removeprefix("options "))
    raise ValueError(f"unknown generated block {name!r}")


def sync(path: Path, write: bool) -> bool:
    """Whether `path`'s generated blocks were up to date (rewritten when `write`)."""
    text = path.read_text(encoding="utf-8")
    new = BLOCK.sub(lambda m: m.group(1) + generate(m.group("name")) + m.group(4), text)
    if write and new != text:
        path.write_text(new, encoding="utf-8")
    return new == text


FILES = [ROOT / "README.md", ROOT / "docs" / "methods.md", ROOT / "docs" / "RESULTS.md"]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    check = "--check" in argv
    stale = [p.relative_to(ROOT) for p in FILES if not sync(p, write=not check)]
    if stale:
        print(("stale, run python scripts/sync_docs.py: " if check else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
