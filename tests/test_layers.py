"""The package's layers import only the layers below them (every `import`, also those inside
functions): a new arrow pointing up fails here, naming the file, line and import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hlomap"

#: layer -> the layers it may import (itself included). `plan` is the hlomap/plan/ package.
ALLOWED: dict[str, set[str]] = {
    "hlo": {"hlo"},
    "agents": {"agents"},
    "propagation": {"hlo", "propagation"},
    "cost": {"hlo", "propagation", "cost"},
    "plan": {"hlo", "propagation", "cost", "plan"},
    "search": {"agents", "search"},
    "tasks": {"hlo", "propagation", "cost", "plan", "search", "agents", "tasks"},
    "verify": {"hlo", "propagation", "cost", "plan", "verify"},
    "run": {"hlo", "propagation", "cost", "plan", "verify", "tasks", "search", "agents", "run"},
    "zoo": {"hlo", "run", "zoo"},
    "report": {"hlo", "propagation", "cost", "plan", "search", "agents", "tasks", "verify", "run", "report"},
    "api": {"hlo", "propagation", "cost", "plan", "search", "agents", "tasks", "verify", "run", "zoo", "api"},
    # the decorator (`hlomap.auto_shard`; a module named auto_shard would shadow the function on
    # the package): above api (it explores through it) and report (its progress bar, explain())
    "autoshard": {"hlo", "propagation", "cost", "plan", "search", "agents", "tasks", "verify", "run", "zoo", "api",
                   "report", "__init__", "autoshard"},
    # `hlomap.elastic` (a module named elastic would shadow the function too): re-plans through api
    # and captures as the decorator does
    "elasticity": {"hlo", "cost", "run", "api", "autoshard", "elasticity"},
}
#: what the package's own __init__ may import: everything.
TOP = {"__init__"}
#: the command line is a face over the one front: it reads arguments, calls the api, and prints
#: through report (plan for the plan's own types).
CLI_ALLOWED = {"api", "plan", "report", "cli"}


def _layer(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported hlomap module) of every import statement in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "hlomap" else [f"hlomap.{a.name}" for a in node.names]
            out += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in out if name == "hlomap" or name.startswith("hlomap.")]


def _target(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_layer_imports_only_layers_below_it() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer in TOP or layer == "cli":
            continue
        assert layer in ALLOWED, f"{path}: a module outside every known layer ({layer}); add it to ALLOWED"
        for line, module in _imports(path):
            target = _target(module)
            if target not in ALLOWED[layer]:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {module}")
    assert not violations, "imports that point up the layers:\n" + "\n".join(violations)


def test_the_cli_imports_only_api_plan_and_report() -> None:
    violations = [f"{path.relative_to(PACKAGE.parent)}:{line}: cli imports {module}"
                  for path in sorted((PACKAGE / "cli").rglob("*.py"))
                  for line, module in _imports(path) if _target(module) not in CLI_ALLOWED]
    assert not violations, "the cli reaches past the api:\n" + "\n".join(violations)


def test_the_cli_check_sees_a_reach_past_the_api(tmp_path: Path) -> None:
    """What the cli test refuses: an import of a layer below the api."""
    source = tmp_path / "m.py"
    source.write_text("from hlomap.tasks.pipeline.explore import explore_pipeline\nfrom hlomap import api\n")
    assert [_target(m) not in CLI_ALLOWED for _, m in _imports(source)] == [True, False]


@pytest.mark.parametrize("layer", ["cost", "propagation", "search"])
def test_the_lower_layers_never_reach_the_front(layer: str) -> None:
    """Spelled out for the layers docs/design.md names: no api, cli, report, zoo or top-level hlomap."""
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _imports(path):
            assert _target(module) not in {"api", "cli", "report", "zoo", "__init__"}, f"{path}:{line}: {module}"


def test_the_checker_sees_an_arrow_pointing_up(tmp_path: Path) -> None:
    """The walk finds imports inside functions too (where a back-arrow hides best)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from hlomap.api import explore\n    import hlomap.cli\n")
    assert [m for _, m in _imports(source)] == ["hlomap.api", "hlomap.cli"]
