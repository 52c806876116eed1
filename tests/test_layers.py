"""The import graph of src/forgetless has layers (docs/DESIGN.md §1.2): a module imports from its own layer or
below, never above, and no modules import each other in a circle. Every import statement counts: at module level,
in a function, under `if TYPE_CHECKING:` (an annotation's import is a dependency too), relative ones. At most one
arrow goes up: model code registering its layers, models/gpt.py importing nn/ when an FFN kind is first looked up
(the kinds register themselves there)."""
import ast
import importlib
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[1] / "src" / "forgetless"
LAYERS = [  # bottom to top; a unit is a top-level module or package ("": the package's own __init__)
    {"", "errors", "config", "progress", "monitor", "side", "hooks", "stats", "device", "distributed", "checkpoint"},
    {"report"},                                   # results files and figures, of any protocol and method
    {"data"},                                     # corpora, splits, tokenizers (a pretrained model's too)
    {"models", "optim"},
    {"nn", "loss"},                               # modules: the math, FFN kinds; a model's training loss
    {"methods"},
    {"train"},                                    # the loop: methods are its StepHooks (hooks.py), not its imports
    {"presets", "export", "adapted", "hf_trainer", "memory"},
    {"continual"},                                # protocols
    {"cli", "cliutil", "__main__", "serve", "hope", "aunn", "guide"},
]
UP = {("forgetless.models.gpt", "forgetless.nn")}  # the one arrow up: model code registering its layers
FACADE = "forgetless"  # the package's public names, imported on first use (its __getattr__): outside the layers


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> set[tuple[str, str]]:
    """(importer, imported) forgetless modules of every file under SRC."""
    return {edge for path in SRC.rglob("*.py") for edge in
            imports_of(module_name(path), path.read_text(), path.name == "__init__.py")}


def imports_of(source: str, text: str, package: bool = False) -> set[tuple[str, str]]:
    """(source, imported) for every import statement of the module `source` (its `text`): at module level, in a
    function, under TYPE_CHECKING; a relative one resolved (`package`: the module is a package's __init__)."""
    parts = source.split(".") if package else source.split(".")[:-1]
    edges = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join([*(parts[:len(parts) - node.level + 1] if node.level else []), *filter(None, [node.module])])
            targets = [f"{module}.{a.name}" if is_module(f"{module}.{a.name}") else module for a in node.names]
        else:
            continue
        edges |= {(source, t) for t in targets if t.split(".")[0] == "forgetless" and t != source}
    return edges


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    found = [i for i, units in enumerate(LAYERS) if unit(module) in units]
    assert found, f"{module} is in no layer: add its unit to LAYERS (and to docs/DESIGN.md §1.2)"
    return found[0]


def arrows_up(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every import from a lower layer into a higher one (the allowed arrow too)."""
    return sorted((a, b) for a, b in edges if a != FACADE and layer(b) > layer(a))


def circle(edges: set[tuple[str, str]]) -> list[str]:
    """One circle of imports among `edges` (the arrow up too), as [a, b, ..., a]; [] if none."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != FACADE:
            graph.setdefault(a, set()).add(b)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for nxt in sorted(graph.get(module, ())):
            if found := visit(nxt, path + [module]):
                return found
        done.add(module)
        return []

    return next((found for module in sorted(graph) if (found := visit(module, []))), [])


EDGES = imports()


def test_every_module_is_in_a_layer():
    for path in SRC.rglob("*.py"):
        layer(module_name(path))


def test_at_most_one_import_goes_up_a_layer():
    up = arrows_up(EDGES)
    assert set(up) <= UP, "imports up the layers: " + ", ".join(f"{a} -> {b}" for a, b in up if (a, b) not in UP)
    assert UP <= EDGES, "an allowed arrow up is gone: drop it from UP"
    assert len(UP) <= 1


def test_no_modules_import_each_other_in_a_circle():
    assert not circle(EDGES), "a circle of imports: " + " -> ".join(circle(EDGES))


def test_the_checks_find_an_arrow_up_and_a_circle():
    """Imports in functions and under TYPE_CHECKING count, and an import from methods/ into continual/ or a pair of
    modules importing each other would be found."""
    assert ("forgetless.continual.export_run", "forgetless.adapted") in EDGES  # module level
    assert ("forgetless.models.hf", "forgetless.device") in EDGES  # in a function
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from forgetless.adapted import Adapted\n"
            "def f():\n    from ..data import splits\n    from . import cms\n")
    assert imports_of("forgetless.nn.apn", text) == {("forgetless.nn.apn", "forgetless.adapted"),
                                                     ("forgetless.nn.apn", "forgetless.data.splits"),
                                                     ("forgetless.nn.apn", "forgetless.nn.cms")}
    wrong = {("forgetless.methods.ewc", "forgetless.continual.arm")}
    assert arrows_up(EDGES | wrong) == sorted(wrong | UP)
    pair = {("forgetless.report.tables", "forgetless.report.figures"), ("forgetless.report.figures", "forgetless.report.tables")}
    assert set(circle(EDGES | pair)) == {"forgetless.report.tables", "forgetless.report.figures"}


def test_every_name_imported_from_forgetless_exists():
    """A name moved to another module (provenance to continual/protocol.py, ...) is imported from there everywhere,
    in functions too: every `from forgetless.X import name` in src/ and tests/ finds it (modules that need an
    optional package that is missing are skipped)."""
    missing = []
    for path in [*SRC.rglob("*.py"), *(SRC.parents[1] / "tests").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("forgetless")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ModuleNotFoundError as e:
                if (e.name or "").startswith("forgetless"):
                    raise
                continue
            missing += [f"{path.name}:{node.lineno} {node.module}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and not is_module(f"{node.module}.{a.name}")]
    if missing:
        pytest.fail("imported names that do not exist: " + ", ".join(missing))


if __name__ == "__main__":  # python tests/test_layers.py: the graph's arrows up and a circle, if any
    print("arrows up:", *(f"{a} -> {b}" + ("" if (a, b) in UP else "  (not allowed)") for a, b in arrows_up(EDGES)),
          sep="\n  ")
    print("circle:", " -> ".join(circle(EDGES)) or "none")
