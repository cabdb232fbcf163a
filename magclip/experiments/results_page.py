"""docs/results.md from a template in which every number is a lookup into a committed JSON file.

The measured numbers live in files the commands write (a compare grid's `--report X.md` also writes
X.json with its rows; eval/*.py write `--out FILE.json`). The prose that puts them beside the
paper's claims lives in a template; rendering replaces each placeholder by the number it names, so
a number in the document can only come from a file and a rerun changes the text with the data.

Placeholders (paths relative to the repository root):

    {{num FILE KEY [xSCALE] [.DIGITS]}}         a value of a JSON file; KEY is a dotted path whose
                                                parts may themselves hold dots or slashes
                                                (`scifact.modes.cosine.ndcg@10`)
    {{grid FILE ROW COLUMN [xSCALE] [.DIGITS] [pm]}}
                                                the mean of a compare grid's row (FILE: the JSON
                                                written beside `--report`; ROW: its labels as
                                                `loss=cosine`, several joined by ','; COLUMN: the
                                                column key); `pm` appends ± the std over seeds
    {{text FILE KEY}}                           a string (or flag) of a JSON file, e.g. a recommended mode
    {{include FILE [+N]}}                       a file's text (a generated grid report); +N demotes
                                                its Markdown headings by N levels

Defaults: scale 1, 2 decimals (`.3g`: 3 significant digits). A missing file, key or row is an error that names it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from magclip.experiments.report import lookup

PLACEHOLDER = re.compile(r"\{\{(.+?)\}\}", re.DOTALL)


class RenderError(ValueError):
    """A placeholder that names a missing file, key or row, or is malformed."""


def render(template: str, root: str | Path = ".") -> str:
    """The template with every placeholder replaced (see the module docstring)."""
    root = Path(root)
    cache: dict[Path, Any] = {}

    def load(name: str) -> Any:
        path = root / name
        if path not in cache:
            if not path.is_file():
                raise RenderError(f"{name}: no such file (relative to {root})")
            cache[path] = json.loads(path.read_text())
        return cache[path]

    def replace(match: re.Match) -> str:
        words = match.group(1).split()
        if not words:
            raise RenderError("empty placeholder {{}}")
        kind, args = words[0], words[1:]
        if kind == "include" and len(args) in (1, 2):
            path = root / args[0]
            if not path.is_file():
                raise RenderError(f"include {args[0]}: no such file")
            text = path.read_text().rstrip("\n")
            if len(args) == 2:  # "+N": demote the included headings by N levels
                if not re.fullmatch(r"\+[1-5]", args[1]):
                    raise RenderError(f"include {args[0]}: option {args[1]!r} is not +1..+5")
                text = re.sub(r"(?m)^(#+) ", lambda m: "#" * int(args[1][1:]) + m.group(1) + " ", text)
            return text
        if kind == "num" and len(args) >= 2:
            value = lookup(load(args[0]), args[1])
            if not isinstance(value, (int, float)):
                raise RenderError(f"{args[0]}: key {args[1]!r} holds {value!r}, not a number")
            return _format(value, None, args[2:])
        if kind == "text" and len(args) == 2:
            value = lookup(load(args[0]), args[1])
            if not isinstance(value, (str, bool, int)):
                raise RenderError(f"{args[0]}: key {args[1]!r} holds {value!r}, not a word")
            return str(value)
        if kind == "grid" and len(args) >= 3:
            stats = _grid_stats(load(args[0]), args[0], args[1], args[2])
            return _format(stats["mean"], stats.get("std"), args[3:])
        raise RenderError(f"cannot read placeholder {{{{{match.group(1)}}}}}")

    return PLACEHOLDER.sub(replace, template)


def _grid_stats(data: dict[str, Any], name: str, row: str, column: str) -> dict[str, float]:
    wanted = dict(part.split("=", 1) for part in row.split(",") if "=" in part)
    for r in data.get("rows", []):
        if all(str(r["labels"].get(k)) == v for k, v in wanted.items()):
            stats = r["stats"].get(column)
            if stats is None or stats.get("mean") is None:
                raise RenderError(f"{name}: row {row!r} has no number for column {column!r}")
            return stats
    raise RenderError(f"{name}: no row {row!r} (rows: {', '.join(_row_name(r) for r in data.get('rows', []))})")


def _row_name(row: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in row["labels"].items())


def _format(value: float, std: float | None, options: list[str]) -> str:
    scale, spec, pm = 1.0, ".2f", False
    for opt in options:
        if opt == "pm":
            pm = True
        elif re.fullmatch(r"x[0-9.e+-]+", opt):
            scale = float(opt[1:])
        elif re.fullmatch(r"\.[0-9]+[fg]?", opt):
            spec = opt if opt[-1] in "fg" else opt + "f"
        else:
            raise RenderError(f"unknown option {opt!r} (use xSCALE, .DIGITS, .DIGITSg or pm)")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    text = format(value * scale, spec)
    if pm and std is not None and not math.isnan(std):
        text += f" ± {format(std * scale, spec)}"
    return text


__all__ = ["RenderError", "render"]
