"""The hlo layer's imports: nothing else of hlomap, and no cycle among its own modules.

Every import statement counts, those inside functions included: a lazy import hides a cycle
from Python but not from the design (ir -> printer -> parser -> ir was one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hlomap.hlo

PACKAGE = "hlomap.hlo"
ROOT = Path(hlomap.hlo.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def _imports(path: Path) -> set[str]:
    """Modules of hlomap that `path` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from hlomap.hlo import parser` imports the module hlomap.hlo.parser
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (ROOT / f"{alias.name}.py").exists() and node.module == PACKAGE)
    return {name for name in found if name == "hlomap" or name.startswith("hlomap.")}


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in sorted(ROOT.glob("*.py"))}


def test_hlo_imports_nothing_else_of_hlomap():
    for module, imported in _graph().items():
        outside = {name for name in imported if not (name == PACKAGE or name.startswith(PACKAGE + "."))}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_hlo_modules_import_each_other_without_cycles():
    graph = _graph()
    # The package's __init__ re-exports its modules; a module importing the package would loop.
    for module, imported in graph.items():
        if module != PACKAGE:
            assert PACKAGE not in imported, f"{module} imports the package {PACKAGE}"
    edges = {module: {name for name in imported if name in graph and name != PACKAGE}
             for module, imported in graph.items() if module != PACKAGE}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = path[path.index(module):] + (module,)
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(edges[module]):
            visit(imported, path + (module,))
        done.add(module)

    for module in sorted(edges):
        visit(module, ())
