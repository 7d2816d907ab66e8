"""The package's layers point one way (docs/architecture.md, "Layout").

Every module under ``whalepy/``, ``passes/`` and ``cost_models/`` is parsed with ``ast``; every import in
it (module level, inside a function, under ``TYPE_CHECKING``, or ``importlib.import_module("...")`` with
a literal name) is mapped to the layer of the module it names. An import may point down or sideways,
never up, unless it is on ``ALLOWED_UP``; the modules of one layer form no cycle; and no module outside
the package root imports an underscored module, or an underscored name of a module, from another folder.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SOURCES = {"whalepy": ROOT / "whalepy", "whalepy.passes": ROOT / "passes",
           "whalepy.cost_models": ROOT / "cost_models"}
"""Package name -> the folder it is installed from (pyproject's ``package-dir``)."""

LAYERS = {
    "whalepy.errors": 0, "whalepy.log": 0, "whalepy.files": 0, "whalepy.ir": 0,
    "whalepy.cost_models": 1,
    "whalepy.hardware": 2, "whalepy.models": 2,
    "whalepy.passes": 3,
    "whalepy.primitives": 4, "whalepy.frontend": 4,
    "whalepy.planner": 5,
    "whalepy.runtime": 6,
    "whalepy.tools": 7,
    "whalepy": 8,
}
"""Module-name prefix -> layer, lowest first; the longest matching prefix decides. ``whalepy`` alone is
the package's ``__init__``: the public names, above everything."""

ALLOWED_UP = {
    # deprecated for one release: Plan.load(path, model=...) / Plan.check_against profile the model and
    # check the plan against it, which the planner's check does (architecture.md 4.4 (b))
    ("whalepy.ir.plan", "whalepy.planner.check"),
}
"""(importer, imported) pairs allowed to point up a layer. Only shrinks."""

ALLOWED_CYCLES: list[list[str]] = []
"""Sorted module lists allowed to import one another in a circle. Only shrinks."""


def module_files(sources: dict[str, pathlib.Path] = SOURCES) -> dict[str, pathlib.Path]:
    """Dotted module name -> its source file, for every module of the package."""
    out = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            out[name] = path
    return out


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def imported_names(name: str, path: pathlib.Path, source: str | None = None) -> dict[str, bool]:
    """Every dotted name ``name``'s source imports, relative imports resolved, mapped to whether the
    import runs (False: only under ``TYPE_CHECKING``)."""
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    typing_only = _type_checking_nodes(tree)
    package = name if _is_package(path) else name.rpartition(".")[0]
    found: dict[str, bool] = {}

    def add(imported: str, node: ast.AST) -> None:
        found[imported] = found.get(imported, False) or id(node) not in typing_only

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                add(f"{mod}.{alias.name}", node)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node)
    return found


def resolve(imported: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module of the package a dotted name refers to (``from m import f`` names ``m.f``), or None."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def layer(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS in tests/test_layers.py")


def import_graph(modules: dict[str, pathlib.Path], sources: dict[str, str] | None = None) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        text = (sources or {}).get(name)
        for imported, runs in imported_names(name, path, text).items():
            target = resolve(imported, modules)
            if target is not None and target != name and not name.startswith(target + "."):
                runs = runs or graph.get_edge_data(name, target, {}).get("runs", False)
                graph.add_edge(name, target, runs=runs)
    return graph


def upward(graph: nx.DiGraph) -> list[str]:
    return sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, b in graph.edges
                  if layer(b) > layer(a) and (a, b) not in ALLOWED_UP)


def cycles_within_layers(graph: nx.DiGraph) -> list[list[str]]:
    """Modules of one layer that import one another in a circle, by imports that run (an import under
    ``TYPE_CHECKING`` only names a type for an annotation), and are not on ``ALLOWED_CYCLES``."""
    same = nx.DiGraph((a, b) for a, b, runs in graph.edges(data="runs") if runs and layer(a) == layer(b))
    found = (sorted(c) for c in nx.strongly_connected_components(same) if len(c) > 1)
    return sorted(c for c in found if c not in ALLOWED_CYCLES)


def folder(module: str, modules: dict[str, pathlib.Path]) -> str:
    return module if _is_package(modules[module]) else module.rpartition(".")[0]


def private_crossings(graph: nx.DiGraph, modules: dict[str, pathlib.Path]) -> list[str]:
    """Imports of an underscored module from another folder, by a module outside the package root."""
    out = []
    for a, b in graph.edges:
        if folder(a, modules) == "whalepy":
            continue
        private = any(p.startswith("_") for p in b.split(".")[1:])
        if private and folder(a, modules) != folder(b, modules):
            out.append(f"{a} imports {b}")
    return sorted(out)


def private_names(modules: dict[str, pathlib.Path], sources: dict[str, str] | None = None) -> list[str]:
    """Underscored names (``from whalepy.ir.plan_text import _t``) that a module outside the package root
    imports from a module of another folder outside the root: such a name is shared, so public."""
    out = []
    for name, path in modules.items():
        if folder(name, modules) == "whalepy":
            continue
        for imported in imported_names(name, path, (sources or {}).get(name)):
            target = resolve(imported, modules)
            if target is None or target == imported or folder(target, modules) in ("whalepy", folder(name, modules)):
                continue
            attr = imported[len(target) + 1:].split(".")[0]
            if attr.startswith("_") and not attr.startswith("__"):
                out.append(f"{name} imports {attr} from {target}")
    return sorted(out)


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph(module_files())


def test_every_module_is_in_a_layer():
    for name in module_files():
        layer(name)


def test_no_import_points_up(graph):
    assert upward(graph) == []


def test_no_cycle_within_a_layer(graph):
    assert cycles_within_layers(graph) == []


def test_no_private_module_crosses_a_folder(graph):
    assert private_crossings(graph, module_files()) == []


def test_no_private_name_crosses_a_folder():
    assert private_names(module_files()) == []


def test_the_test_catches_an_upward_import_in_a_function():
    modules = module_files()
    low = next(m for m in modules if layer(m) == 0 and not _is_package(modules[m]))
    text = modules[low].read_text() + "\n\ndef _late():\n    from whalepy.runtime import parallelize\n"
    graph = import_graph(modules, sources={low: text})
    assert any(line.startswith(f"{low} (layer 0) imports whalepy.runtime") for line in upward(graph))


def test_the_test_catches_a_cycle_and_a_private_crossing():
    modules = module_files()
    a, b = "whalepy.planner.search", "whalepy.planner.ilp"
    texts = {a: modules[a].read_text() + "\nimport whalepy.planner.ilp\n",
             b: modules[b].read_text() + "\nfrom whalepy.planner import search\n"
                                         "from whalepy.runtime import _swap\n"}
    graph = import_graph(modules, sources=texts)
    assert any(a in c and b in c for c in cycles_within_layers(graph))
    assert f"{b} imports whalepy.runtime._swap" in private_crossings(graph, modules)
    texts[b] += "from whalepy.ir.plan import _to_jsonable\n"
    assert f"{b} imports _to_jsonable from whalepy.ir.plan" in private_names(modules, sources=texts)


def test_the_package_root_stays_small():
    root = sorted(p.name for p in SOURCES["whalepy"].glob("*.py"))
    assert len(root) <= 5, f"whalepy/ holds {root}: a new module goes into the folder of its layer"
