"""The package is a layer cake: a module imports only modules of its own floor or the floors below
(README, "Package layout"). Every `import magclip...` in the source, at the top of a file or inside a
function, is checked, so a new upward import fails here instead of drifting in."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "magclip"

# lowest first; a floor may import itself and every floor before it; `magclip` itself (the version,
# the lazily imported public names) may be imported from anywhere
FLOORS = [
    {"modes", "io"},
    {"config"},
    {"similarity", "temperature", "losses", "distributed"},
    {"metrics"},
    {"models"},
    {"data"},
    {"diagnostics"},
    {"evaluation"},
    {"training"},
    {"experiments"},
    {"cli"},
]


def floor_of(unit: str) -> int:
    for i, units in enumerate(FLOORS):
        if unit in units:
            return i
    raise AssertionError(f"magclip.{unit} is on no floor of tests/test_layers.py: add it to FLOORS")


def unit_of(module: str) -> str | None:
    """'magclip.data.beir' -> 'data'; 'magclip' -> None (the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "magclip":
            if node.module == "magclip":  # `from magclip import x`: x may be a subpackage
                found += [(node.lineno, f"magclip.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "magclip"]
    return found


def test_no_module_imports_a_floor_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = unit_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here in (None, "__init__"):
            continue
        for line, module in imports(ast.parse(path.read_text(), str(path))):
            there = unit_of(module)
            if there is None or there in ("__version__",):
                continue
            if there in ("CLIPLoss", "LogitScale", "MODES", "Scorer", "default_logit_scale"):
                continue  # the root's public names
            if floor_of(there) > floor_of(here):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} (magclip.{here}) imports {module}")
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import():
    tree = ast.parse("def f():\n    from magclip.training.engine import Engine\n")
    (line, module), = imports(tree)
    assert floor_of(unit_of(module)) > floor_of("metrics") and line == 2
