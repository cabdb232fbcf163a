"""docs/results.md from a template in which every number is a lookup into a committed JSON file.

The measured numbers live in files the commands write (a compare grid's `--report X.md` also writes
X.json with its rows; eval/*.py write `--out FILE.json`). The prose that puts them beside the
paper's claims lives in a template; rendering replaces each placeholder by the number it names, so
a number in the document can only come from a file and a rerun changes the text with the data.

Placeholders (paths relative to the repository root):

    {{num FILE KEY [xSCALE] [.DIGITS] [signed]}}
                                                a value of a JSON file; KEY is a dotted path whose
                                                parts may themselves hold dots or slashes
                                                (`scifact.modes.cosine.ndcg@10`); `signed`: a
                                                difference, written +1.23 / −1.23
    {{grid FILE ROW COLUMN [xSCALE] [.DIGITS] [pm]}}
                                                the mean of a compare grid's row (FILE: the JSON
                                                written beside `--report`; ROW: its labels as
                                                `loss=cosine`, several joined by ','; COLUMN: the
                                                column key); `pm` appends ± the std over seeds
    {{diff FILE ROW:BASE COLUMN [xSCALE] [.DIGITS] [min] [FIELD]}}
                                                a grid row's difference to another row (ROW − BASE,
                                                labels as for `grid`) with its 95 % CIs and verdict:
                                                the report's precomputed paired comparison when
                                                FILE has it, else computed here: paired by seed from
                                                the per-cell values (`cells`) when FILE keeps them,
                                                else from the two rows' mean/std/n (unpaired: older
                                                reports kept no per-seed values). `min`: lower is
                                                better. BASE may name a row of another grid's JSON
                                                as `OTHER.json@labels` (the same recipe under another
                                                loss): paired by seed from both files' cells.
                                                BASE `before`: what training moved, ROW's trained
                                                runs against the model they started from (the
                                                report's `training_effects`).
                                                FIELD: `line` (default: the whole computed
                                                statement), `short` (difference, CI, verdict), `diff`,
                                                `ci`, `verdict`, `mde`, `seeds` (seeds a true
                                                difference of this size needs), `seeds@EFFECT` (seeds
                                                to detect EFFECT, in the file's units, at the
                                                observed seed-to-seed sd), `qmde` (the MDE of the
                                                query-level test alone), `sd` (of the per-seed
                                                differences), `n` (seeds)
    {{text FILE KEY}}                           a string (or flag) of a JSON file, e.g. a recommended mode
    {{include FILE [+N]}}                       a file's text (a generated grid report); +N demotes
                                                its Markdown headings by N levels

Defaults: scale 1, 2 decimals (`.3g`: 3 significant digits). A missing file, key or row is an error that names it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from magclip.experiments import stats
from magclip.experiments.collect import item_noun, lookup
from magclip.experiments.grid import Column
from magclip.experiments.report import comparison_statement, interval, seeds_text, signed, unit_of

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
        if kind == "diff" and len(args) >= 3:
            return _diff(load(args[0]), args[0], args[1], args[2], args[3:], load)
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


DIFF_FIELDS = ("line", "short", "diff", "ci", "verdict", "mde", "qmde", "sd", "seeds", "n")


def _labels(spec: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in spec.split(",") if "=" in part)


def _diff(data: dict[str, Any], name: str, rows: str, column: str, options: list[str],
          load: Callable[[str], Any] | None = None) -> str:
    if ":" not in rows:
        raise RenderError(f"diff {name}: {rows!r} must be ROW:BASE, e.g. loss=qnorm:loss=cosine")
    row, base = rows.split(":", 1)
    base_data, base_name = data, name
    if "@" in base:  # OTHER.json@labels: the baseline row lives in another grid's report
        if load is None:
            raise RenderError(f"diff {name}: a baseline in another file ({base!r}) needs a loader")
        base_name, base = base.split("@", 1)
        base_data = load(base_name)
    fields = [o for o in options if o in DIFF_FIELDS or re.fullmatch(r"seeds@[0-9.e+-]+", o)]
    field = fields[0] if fields else "line"
    lower = "min" in options
    rest = [o for o in options if o not in fields and o != "min"]
    scale, digits = 1.0, 2
    for opt in rest:
        if re.fullmatch(r"x[0-9.e+-]+", opt):
            scale = float(opt[1:])
        elif re.fullmatch(r"\.[0-9]+", opt):
            digits = int(opt[1:])
        else:
            raise RenderError(f"diff: unknown option {opt!r} (use xSCALE, .DIGITS, min, seeds@EFFECT or one of "
                              f"{', '.join(DIFF_FIELDS)})")
    want, want_base = _labels(row), _labels(base)
    if base == "before":
        found = [c for c in data.get("training_effects") or [] if c["column"] == column
                 and all(str(c["labels"].get(k)) == v for k, v in want.items())]
        if not found:
            raise RenderError(f"diff {name}: no training effect of {row!r} on {column!r} (a report written "
                              "before they were kept, or runs that did not evaluate their start)")
    else:
        found = [c for c in data.get("comparisons") or [] if c["column"] == column
                 and all(str(c["labels"].get(k)) == v for k, v in want.items())
                 and all(str(c["baseline"].get(k)) == v for k, v in want_base.items())] if base_data is data else []
    if found:
        c = found[0]
    else:
        c = _paired_from_cells(data, want, want_base, column, not lower, base_data)
        if c is None:
            a = _grid_stats(base_data, base_name, base, column)
            b = _grid_stats(data, name, row, column)
            c = stats.compare_summary(a, b, higher_is_better=not lower).to_dict()
    col = Column(key=column, label=column, scale=scale, digits=digits)
    if field == "line":
        return comparison_statement(c, col)
    if field == "short":
        text = signed(c["diff"], scale, digits) + unit_of(col)
        if c.get("seed_low") is not None:
            text += f", 95 % CI {interval(c['seed_low'], c['seed_high'], scale, digits)}"
        text += f" ({seeds_text(c['n_seeds'])}"
        text += f" × {c['n_items']} {item_noun(column)})" if c.get("n_items") else ")"
        return text + f" → {c['verdict']}"
    if field == "sd":
        return "n/a" if c.get("seed_sd") is None else f"{c['seed_sd'] * scale:.{digits}f}"
    if field == "qmde":
        return "n/a" if c.get("item_se") is None else f"{stats.mde_normal(c['item_se']) * scale:.{digits}f}"
    if field == "diff":
        return signed(c["diff"], scale, digits)
    if field == "ci":
        return "n/a" if c.get("seed_low") is None else interval(c["seed_low"], c["seed_high"], scale, digits)
    if field == "verdict":
        return c["verdict"]
    if field == "mde":
        return "n/a" if c.get("mde") is None else f"{c['mde'] * scale:.{digits}f}"
    if field == "seeds":
        return str(c.get("seeds_for_diff") or "n/a")
    if field.startswith("seeds@"):
        sd = c.get("seed_sd")
        needed = stats.seeds_needed(float(field[6:]), sd, paired=c.get("paired", True)) if sd else None
        return str(needed or "n/a")
    return str(c["n_seeds"])


def _paired_from_cells(data: dict[str, Any], row: dict[str, str], base: dict[str, str], column: str,
                       higher_is_better: bool, base_data: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A seed-level paired comparison from the per-cell values a newer report JSON keeps (`cells`),
    for a pair of rows the report did not compare (e.g. dnorm − qnorm), the baseline row from
    `base_data` when given (another grid on the same seeds); None without cells."""
    base_data = data if base_data is None else base_data
    cells = [c for c in data.get("cells") or [] if c.get("finished")]
    base_cells = [c for c in base_data.get("cells") or [] if c.get("finished")]
    if not cells or not base_cells or not data.get("rows"):
        return None
    table = set(data["rows"][0]["labels"])
    not_axes = ("cell", "finished", "stale", "stale_reasons", "values")
    paired_by = [k for k in cells[0] if k not in table and k not in not_axes]

    def values(source: list[dict], labels: dict[str, str]) -> dict[tuple, float]:
        return {tuple(c.get(k) for k in paired_by): c["values"].get(column) for c in source
                if all(str(c.get(k)) == v for k, v in labels.items()) and c["values"].get(column) is not None}

    a, b = values(base_cells, base), values(cells, row)
    keys = [k for k in a if k in b]
    if not keys:
        return None
    return stats.compare([b[k] - a[k] for k in keys], higher_is_better=higher_is_better).to_dict()


def _row_name(row: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in row["labels"].items())


def _format(value: float, std: float | None, options: list[str]) -> str:
    scale, spec, pm, sign = 1.0, ".2f", False, False
    for opt in options:
        if opt == "pm":
            pm = True
        elif opt == "signed":
            sign = True
        elif re.fullmatch(r"x[0-9.e+-]+", opt):
            scale = float(opt[1:])
        elif re.fullmatch(r"\.[0-9]+[fg]?", opt):
            spec = opt if opt[-1] in "fg" else opt + "f"
        else:
            raise RenderError(f"unknown option {opt!r} (use xSCALE, .DIGITS, .DIGITSg, pm or signed)")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    text = format(value * scale, ("+" if sign else "") + spec)
    if sign:
        text = text.replace("-", "−")
    if pm and std is not None and not math.isnan(std):
        text += f" ± {format(std * scale, spec)}"
    return text


__all__ = ["RenderError", "render"]
