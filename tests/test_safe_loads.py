"""No `torch.load` in the tree unpickles code: every call passes weights_only=True (issue 55).

`torch.load` without it (or with weights_only=False) runs whatever a pickle holds; a benchmark that read
its own ranks' files that way was one copy-paste away from reading a user's checkpoint so. The tree is
read with `ast`, so a comment or a string that mentions the call does not count and a call spread over
lines does; `load` imported from torch under any name counts too.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("magclip", "train", "eval", "tools", "benchmarks", "tests")


def torch_load_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the torch module, names bound to torch.load) in one file."""
    modules, loads = {"torch"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "torch" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            loads |= {a.asname or a.name for a in node.names if a.name == "load"}
    return modules, loads


def unsafe_loads(source: str, filename: str) -> list[int]:
    """Line numbers of torch.load calls without a literal weights_only=True."""
    tree = ast.parse(source, filename)
    modules, loads = torch_load_names(tree)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        is_load = (isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name)
                   and f.value.id in modules) or (isinstance(f, ast.Name) and f.id in loads)
        safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in node.keywords)
        if is_load and not safe:
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_what_it_must():
    bad = ("import torch\nimport torch as T\nfrom torch import load as L\n"
           "torch.load('a')\nT.load('b', weights_only=False)\nL('c')\n"
           "torch.load(\n  'd',\n  map_location='cpu')\n"
           "torch.load('e', map_location='cpu', weights_only=True)\n# torch.load('f')\nx = \"torch.load('g')\"\n")
    assert unsafe_loads(bad, "bad.py") == [4, 5, 6, 7]


def test_no_torch_load_in_the_tree_without_weights_only():
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100   # the tree was found
    found = {f"{p.relative_to(ROOT)}:{line}" for p in files for line in unsafe_loads(p.read_text(), str(p))}
    assert not found, f"torch.load without weights_only=True: {sorted(found)}"
