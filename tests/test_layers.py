"""The import graph of src/forgetless has layers (docs/DESIGN.md §1.2): a module imports from its own layer or
below, never above, and no modules import each other in a circle. The one arrow up is model code registering
its layers: models/gpt.py imports nn/ when an FFN kind is first looked up (the kinds register themselves there).
Imports under `if TYPE_CHECKING:` are annotations, not run: they do not count."""
import ast
import importlib
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[1] / "src" / "forgetless"
LAYERS = [  # bottom to top; a unit is a top-level module or package ("": the package's own __init__)
    {"", "errors", "config", "progress", "monitor", "side", "stats", "device", "distributed", "checkpoint"},
    {"report"},                                   # results files and figures, of any protocol and method
    {"models", "optim"},
    {"data"},
    {"train", "loss"},
    {"nn"},                                       # modules: the math, FFN kinds
    {"methods"},
    {"presets", "export", "adapted", "hf_trainer", "memory"},
    {"continual"},                                # protocols
    {"cli", "cliutil", "__main__", "serve", "hope", "aunn", "guide"},
]
UP = {("forgetless.models.gpt", "forgetless.nn")}  # model code registering its layers
FACADE = "forgetless"  # the package's public names, imported on first use (its __getattr__): outside the layers


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> set[tuple[str, str]]:
    """(importer, imported) forgetless modules, every import statement at run time (module level or in a function)."""
    edges = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
        source = module_name(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                           for a in node.names]
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
    return sorted((a, b) for a, b in edges if a != FACADE and layer(b) > layer(a) and (a, b) not in UP)


def circle(edges: set[tuple[str, str]]) -> list[str]:
    """One circle of imports among `edges` (but the allowed arrows up), as [a, b, ..., a]; [] if none."""
    graph: dict[str, set[str]] = {}
    for a, b in edges - UP:
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


def test_no_import_goes_up_a_layer():
    up = arrows_up(EDGES)
    assert not up, "imports up the layers: " + ", ".join(f"{a} -> {b}" for a, b in up)
    assert UP <= EDGES, "an allowed arrow up is gone: drop it from UP"


def test_no_modules_import_each_other_in_a_circle():
    assert not circle(EDGES), "a circle of imports: " + " -> ".join(circle(EDGES))


def test_the_checks_find_an_arrow_up_and_a_circle():
    """Imports in functions count, and an import from methods/ into continual/ or a pair of modules importing
    each other would be found."""
    assert ("forgetless.continual.export_run", "forgetless.adapted") in EDGES  # module level
    assert ("forgetless.models.hf", "forgetless.device") in EDGES  # in a function
    wrong = {("forgetless.methods.ewc", "forgetless.continual.arm")}
    assert arrows_up(EDGES | wrong) == sorted(wrong)
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
