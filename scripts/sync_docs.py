"""The generated parts of the docs, kept in step with the code they describe:

- README.md's method guide (a decision table), and the table of its evidence in docs/methods.md and on the results'
  front page (docs/RESULTS.md), from the rows of src/forgetless/guide.py (`forgetless methods` prints the same);
- docs/methods.md's option tables, one block per section, for the methods its heading names (`## LoRA: `lora`,
  `seq-lora``), from each method's config dataclass (the `help` of its fields); a registered method that no heading
  names gets a section of its own, added here, to be written by hand around its table;
- docs/DESIGN.md's table of method names (§6.1), from the method registry;
- the results' front page's list of pages (in mkdocs.yml's nav order) and each results page's table of contents,
  from their headings.

Each part sits between `<!-- generated: NAME -->` and `<!-- /generated -->`. `python scripts/sync_docs.py`
rewrites them; `python scripts/sync_docs.py --check` changes nothing and exits 1 when one is stale
(tests/test_docs.py runs the check)."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FRONT, PAGES = DOCS / "RESULTS.md", DOCS / "results"  # the results: a front page and one page per area
BLOCK = re.compile(r"(<!-- generated: (?P<name>[^>]*?) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)
COMMON = ("target_modules", "exclude_modules", "optimizer", "joint")  # options every method has, described once


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def guide_table(results_link: str = "docs/results") -> str:
    """The method guide as a decision table: what you have -> method -> its settings in Trainer and in the CLI,
    one link to its evidence, named by its scale."""
    from forgetless.guide import GUIDE, cli_text, settings, trainer_text
    rows = ["| you have | method | in `Trainer` | in `forgetless adapt` | evidence |", "|---|---|---|---|---|"]
    for a in GUIDE:
        rows.append(f"| {cell(a.situation)} | `{a.method}` | {cell(trainer_text(settings(a)))} | {cell(cli_text(a))} "
                    f"| [{cell(a.scale)}]({results_link}/{a.section}) |")
    return "\n".join(rows) + "\n"


def guide_evidence(results_link: str = "results") -> str:
    """What was measured behind each row of the guide, at what scale (docs/methods.md, the results' front page)."""
    from forgetless.guide import GUIDE
    rows = ["| you have | method | measured on | what was measured |", "|---|---|---|---|"]
    rows += [f"| {cell(a.situation)} | `{a.method}` | {cell(a.scale)} | {cell(a.evidence)} "
             f"([results]({results_link}/{a.section})) |" for a in GUIDE]
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


def options_table(name: str, other: str | None = None) -> str:
    """`name`'s options (all but the common ones) with their defaults and help; against `other` (a method with the
    same options, or the registered one `name`'s class derives from), the defaults in which they differ."""
    from forgetless.methods import METHODS
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


def options(name: str) -> list[str]:
    from forgetless.methods import METHODS
    return [f.name for f in dataclasses.fields(METHODS[name].Config) if f.name not in COMMON]


def parent(name: str) -> str | None:
    """The registered method `name`'s class derives from, if any."""
    from forgetless.methods import METHODS
    names = {cls: n for n, cls in METHODS.items()}
    return next((names[k] for k in METHODS[name].__mro__[1:] if k in names), None)


# ---- docs/methods.md: one options block per section, for the methods its heading names ------------------------
OPTIONS = re.compile(r"<!-- generated: options[^>]*-->\n.*?<!-- /generated -->\n", re.S)


def named(heading: str) -> list[str]:
    """The registered methods a `## ` heading names in backticks, in its order."""
    from forgetless.methods import METHODS
    return [n for n in re.findall(r"`([^`]+)`", heading) if n in METHODS]


def method_sections(text: str) -> str:
    """docs/methods.md with one `options` block in every section whose heading names methods (placed after its
    first paragraph where it has none, several merged into one), and a new section at the end of the methods'
    sections for every registered method no heading names."""
    from forgetless.methods import METHODS, method_names
    parts = sections(text)
    for i, part in enumerate(parts):
        heading = part.split("\n", 1)[0]
        names = named(heading) if heading.startswith("## ") else []
        blocks = OPTIONS.findall(part)
        if not names:
            if blocks:
                raise SystemExit(f"docs/methods.md: '{heading}' has an options block but names no method in backticks")
            continue
        block = f"<!-- generated: options {', '.join(names)} -->\n<!-- /generated -->\n"
        if blocks:
            first = part.index(blocks[0])
            rest = part[first:].replace(blocks[0], block, 1)
            for extra in blocks[1:]:  # blocks of the old one-per-method kind: merged into the first
                rest = rest.replace("\n" + extra, "", 1)
            parts[i] = part[:first] + rest
        else:
            head, _, body = part.partition("\n\n")
            paragraph, sep, after = body.partition("\n\n")
            parts[i] = f"{head}\n\n{paragraph}\n\n{block}" + (f"\n{after}" if sep else "")
    documented = [n for part in parts for n in named(part.split("\n", 1)[0]) if part.startswith("## ")]
    missing = [n for n in method_names() if n not in documented]
    if missing:
        last = max(i for i, part in enumerate(parts) if part.startswith("## ") and named(part.split("\n", 1)[0]))
        new = [f"## `{n}`\n\n{(METHODS[n].__doc__ or n).strip().splitlines()[0]}\n\n"
               f"<!-- generated: options {n} -->\n<!-- /generated -->\n\n" for n in missing]
        parts[last + 1:last + 1] = new
    return "".join(parts)


def options_block(names: str) -> str:
    """The options of a section's methods: each in full, or against the method it derives from or an earlier one
    of the section with the same options."""
    names = [n.strip() for n in names.split(",")]
    return "\n".join(options_table(n, parent(n) or next((e for e in names[:i] if options(e) == options(n)), None))
                     for i, n in enumerate(names))


def method_table(path: Path) -> str:
    """docs/DESIGN.md §6.1: every registered method in table order, its base kind, the protocols whose `--methods
    all` runs it, and its section of docs/methods.md."""
    from forgetless.methods import METHODS, build_method, method_names
    from forgetless.models.gpt import GPTConfig
    guide = DOCS / "methods.md"
    where = {n: title for _, title in headings(guide.read_text(encoding="utf-8")) for n in named(title)}
    link = os.path.relpath(guide, path.parent)
    rows = ["| name | base | in `--methods all` of | described in |", "|---|---|---|---|"]
    for n in method_names():
        title = where.get(n, "")
        rows.append(f"| `{n}` | {build_method(n).base_config(GPTConfig()).ffn} | "
                    f"{', '.join(METHODS[n].default_for) or 'named only'} | "
                    f"[{cell(title.split(':')[0].replace('`', '') or n)}]({link}#{anchor(title)}) |")
    return "\n".join(rows) + "\n"


def anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading (MkDocs is set to the same: pymdownx.slugs in mkdocs.yml)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every Markdown heading outside fenced code."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [(len(m.group(1)), m.group(2).strip()) for m in re.finditer(r"^(#{1,6}) (.+)$", prose, flags=re.M)]


def sections(text: str) -> list[str]:
    """`text` cut before every `## ` heading outside fenced code: [preamble, section, section, ...]."""
    cuts, fenced, offset = [0], False, 0
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            cuts.append(offset)
        offset += len(line)
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]


def results_pages() -> list[Path]:
    """The results' pages (docs/results/*.md) in mkdocs.yml's nav order; each must be there."""
    nav = re.findall(r"^\s+- (results/[\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    pages = sorted(PAGES.glob("*.md"))
    missing = [p.name for p in pages if f"results/{p.name}" not in nav]
    if missing:
        raise SystemExit(f"docs/results/{missing[0]} is not in mkdocs.yml's nav: list it under Results")
    return [DOCS / page for page in nav if (DOCS / page).is_file()]


def pages_list(path: Path) -> str:
    """The front page's list of the results' pages, each with its sections (all but its Summary and Contents)."""
    lines = []
    for page in results_pages():
        link = os.path.relpath(page, path.parent)
        (_, title), *parts = headings(page.read_text(encoding="utf-8"))
        lines.append(f"- [{title}]({link})")
        lines += [f"  - [{re.sub(r'[][]', '', t)}]({link}#{anchor(t)})" for level, t in parts
                  if level == 2 and t not in ("Summary", "Contents")]
    return "\n".join(lines) + "\n"


def toc(path: str) -> str:
    """A nested list linking every section of `path` below its title (the Contents heading itself left out)."""
    lines = []
    for level, title in headings((ROOT / path).read_text(encoding="utf-8")):
        if level > 1 and title != "Contents":
            text = re.sub(r"[\[\]]", "", title)
            lines.append(f"{'  ' * (level - 2)}- [{text}](#{anchor(title)})")
    return "\n".join(lines) + "\n"


def generate(name: str, path: Path) -> str:
    """Block `name` of the doc at `path` (links in it are relative to `path`)."""
    results = os.path.relpath(PAGES, path.parent)
    if name == "guide":
        return guide_table(results)
    if name == "guide evidence":
        return guide_evidence(results)
    if name == "results pages":
        return pages_list(path)
    if name == "method names":
        return method_table(path)
    if name.startswith("toc "):
        return toc(name.removeprefix("toc "))
    if name.startswith("options "):
        return options_block(name.removeprefix("options "))
    raise ValueError(f"unknown generated block {name!r}")


def sync(path: Path, write: bool) -> bool:
    """Whether `path`'s generated blocks were up to date (rewritten when `write`)."""
    text = path.read_text(encoding="utf-8")
    new = method_sections(text) if path == DOCS / "methods.md" else text
    new = BLOCK.sub(lambda m: m.group(1) + generate(m.group("name"), path) + m.group(4), new)
    if write and new != text:
        path.write_text(new, encoding="utf-8")
    return new == text


def files() -> list[Path]:
    """Every doc with generated parts."""
    return [ROOT / "README.md", DOCS / "methods.md", DOCS / "DESIGN.md", FRONT, *results_pages()]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    check = "--check" in argv
    stale = [p.relative_to(ROOT) for p in files() if not sync(p, write=not check)]
    if stale:
        print(("stale, run python scripts/sync_docs.py: " if check else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
