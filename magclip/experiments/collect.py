"""A grid's results, collected: one typed record per cell (its columns' values read from its results
files), the table rows (mean and spread over the aggregated axes), and every row's paired difference
to the baseline row (magclip.experiments.stats). What magclip.experiments.report renders."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from magclip.experiments import stats
from magclip.experiments.grid import Column, Grid
from magclip.metrics.ranks import DIRECTIONS, ITEMS_KEY, load_ranks, ranks_path


def lookup(results: Any, path: str) -> Any:
    """Follow a dotted path; a key may itself hold dots or slashes (the longest match wins), a
    number indexes a list. `val` stands for the run's validation `metrics`."""
    parts = path.split(".")
    node = results
    i = 0
    while i < len(parts):
        if isinstance(node, list) and parts[i].isdigit():  # a list element by index, e.g. `bins.0`
            node, i = (node[int(parts[i])] if int(parts[i]) < len(node) else None), i + 1
            continue
        if not isinstance(node, dict):
            return None
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            if i == 0 and parts[0] == "val" and "metrics" in node:
                node, i = node["metrics"], 1
                continue
            return None
    return node


@dataclass
class CellRecord:
    """One cell as collected: its axis values, finished/stale flags, each column's raw value (None where
    its results have no number), the results files it read, and the columns unresolved in a finished cell."""

    cell: str
    axis_values: dict[str, str]
    finished: bool
    stale: bool
    values: dict[str, float | None]
    results: dict[str, str]
    unresolved: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The record as compare.json holds it (axis values as top-level keys)."""
        return {"cell": self.cell, **self.axis_values, "finished": self.finished, "stale": self.stale,
                "values": self.values, "results": self.results, "unresolved": self.unresolved}


@dataclass
class Stat:
    mean: float | None
    std: float | None
    n: int


@dataclass
class Row:
    """One table row: a combination of the non-aggregated axes, each column's mean and sample std over
    the aggregated axes, finished and planned cells, and whether it is the best row per column."""

    labels: dict[str, str]
    finished: int
    cells: int
    stats: dict[str, Stat]
    best: dict[str, bool]

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels, "finished": self.finished, "cells": self.cells,
                "stats": {k: vars(s) for k, s in self.stats.items()}, "best": self.best}


def collect(grid: Grid) -> list[CellRecord]:
    """One record per cell, in the grid's order."""
    records = []
    for cell in grid.cells():
        loaded: dict[str, Any] = {}
        for name, path in cell.results.items():
            try:
                loaded[name] = json.loads(path.read_text())
            except (OSError, ValueError):
                loaded[name] = None
        values = {}
        for col in grid.columns:
            v = lookup(loaded.get(col.source), col.path) if loaded.get(col.source) is not None else None
            values[col.key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        finished = cell.finished
        records.append(CellRecord(cell.name, dict(cell.values), finished, finished and cell.stale, values,
                                  {k: str(p) for k, p in cell.results.items()},
                                  [k for k, v in values.items() if v is None] if finished else []))
    return records


def _stat(values: list[float | None]) -> Stat:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return Stat(None, None, 0)
    return Stat(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs))


def summarize(grid: Grid, records: list[CellRecord] | None = None) -> list[Row]:
    """Table rows: one per combination of the non-aggregated axes (in YAML order)."""
    records = collect(grid) if records is None else records
    axes = grid.table_axes
    per_group = 1
    for a in grid.axes:
        if a.name in grid.aggregate:
            per_group *= len(a.values)
    rows = []
    for combo in itertools.product(*(a.values for a in axes)):
        key = {a.name: v.name for a, v in zip(axes, combo)}
        members = [r for r in records if all(r.axis_values[k] == v for k, v in key.items())]
        col_stats = {col.key: _stat([r.values[col.key] for r in members]) for col in grid.columns}
        rows.append(Row(key, sum(r.finished for r in members), per_group, col_stats, {}))
    for col in grid.columns:
        means = [round(r.stats[col.key].mean * col.scale, col.digits) for r in rows
                 if r.stats[col.key].mean is not None]
        best = None if col.better == "none" or not means else (max(means) if col.better == "max" else min(means))
        for r in rows:
            m = r.stats[col.key].mean
            r.best[col.key] = best is not None and m is not None and round(m * col.scale, col.digits) == best
    return rows


# ----------------------------------------------------------------------------- paired comparisons

# a column whose number is a mean over queries of a retrieval direction: `val.image_to_text_R@1`, `..._mean_rank`
_PER_QUERY = re.compile(rf"^(?P<where>.+)\.(?P<direction>{'|'.join(DIRECTIONS)})_(?:R@(?P<k>[0-9]+)|mean_rank)$")


def per_query_outcomes(col: Column, results_path: str | Path,
                       cache: dict[Path, Any] | None = None) -> tuple[np.ndarray, str | None] | str:
    """The per-query outcomes behind a column of one cell: R@k -> 1.0 where rank < k else 0.0, mean
    rank -> rank + 1, read from the ranks file beside its results file (`results.ranks.npz`), with
    the digest of the evaluated items. A string says why there are none."""
    m = _PER_QUERY.match(col.path)
    if m is None:
        return "not a per-query metric"
    where = "metrics" if m["where"] == "val" else m["where"]
    path = ranks_path(results_path)
    cache = {} if cache is None else cache
    if path not in cache:
        try:
            cache[path] = load_ranks(path) if path.is_file() else None
        except (OSError, ValueError) as e:
            cache[path] = f"unreadable {path.name}: {e}"
    loaded = cache[path]
    if not isinstance(loaded, dict):
        return loaded or "no per-query ranks (runs written before they were kept)"
    ranks = (loaded.get(where) or {}).get(m["direction"])
    if ranks is None:
        return f"no per-query ranks for {where}/{m['direction']}"
    values = (ranks < int(m["k"])).astype(float) if m["k"] else ranks + 1.0
    return values, loaded[where].get(ITEMS_KEY)


def baseline_labels(grid: Grid, rows: list[Row]) -> dict[str, str] | None:
    """The row every other row is compared with: the grid's `baseline:`, else the first row."""
    if grid.baseline:
        return dict(grid.baseline)
    return dict(rows[0].labels) if rows and grid.table_axes else None


def comparisons(grid: Grid, records: list[CellRecord], rows: list[Row],
                n_resamples: int = stats.N_RESAMPLES) -> list[dict[str, Any]]:
    """Every row against the baseline row, per ranked column (better: max/min): cells are paired by
    their aggregated axes (seed s with seed s); the per-seed differences give the seed-level
    interval, the per-query outcomes (when every paired cell kept them, on the same items) the
    item-level one; `stats.compare` gives the verdict. Values are in the column's raw units. Each
    comparison is the plain record docs/results.md reads (`stats.Comparison.to_dict` + labels)."""
    base = baseline_labels(grid, rows)
    if base is None:
        return []
    axes = [a.name for a in grid.table_axes]

    def members(labels: dict[str, str]) -> dict[tuple, CellRecord]:
        return {tuple(r.axis_values[a] for a in grid.aggregate): r for r in records
                if r.finished and all(r.axis_values[a] == labels[a] for a in axes)}

    base_cells = members(base)
    cache: dict[Path, Any] = {}
    out = []
    for row in rows:
        if row.labels == base:
            continue
        row_cells = members(row.labels)
        for col in grid.columns:
            if col.better == "none":
                continue
            keys = [k for k in base_cells if k in row_cells and base_cells[k].values[col.key] is not None
                    and row_cells[k].values[col.key] is not None]
            if not keys:
                continue
            per_seed = [row_cells[k].values[col.key] - base_cells[k].values[col.key] for k in keys]
            items, why = None, None
            per_cell = [(per_query_outcomes(col, base_cells[k].results[col.source], cache),
                         per_query_outcomes(col, row_cells[k].results[col.source], cache)) for k in keys]
            reasons = [o for pair in per_cell for o in pair if isinstance(o, str)]
            if reasons:
                why = reasons[0]
            elif len({(len(o[0]), o[1]) for pair in per_cell for o in pair}) != 1:
                why = "the runs were evaluated on different items"
            else:
                items = np.stack([r[0] - b[0] for b, r in per_cell])
            cmp = stats.compare(per_seed, items, higher_is_better=col.better == "max", n_resamples=n_resamples)
            out.append({"labels": row.labels, "baseline": base, "column": col.key, "seeds": [list(k) for k in keys],
                        **cmp.to_dict(), "items_unavailable": why})
    return out
