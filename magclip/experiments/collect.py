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
from magclip.experiments.grid import MAIN, Column, Grid
from magclip.metrics.ranks import (
    DIGEST_MARK,
    DIRECTIONS,
    ITEMS_KEY,
    load_query_values,
    load_ranks,
    queries_path,
    ranks_path,
)


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
    stale_reasons: list[str]        # why a finished cell is not the grid's current experiment (empty: current)
    values: dict[str, float | None]
    results: dict[str, str]
    unresolved: list[str]
    precision: str | None = None    # the training precision the run resolved (fp32/bf16/fp16; `auto` is per machine)

    @property
    def stale(self) -> bool:
        return bool(self.stale_reasons)

    def to_dict(self) -> dict[str, Any]:
        """The record as compare.json holds it (axis values as top-level keys)."""
        return {"cell": self.cell, **self.axis_values, "finished": self.finished, "stale": self.stale,
                "stale_reasons": self.stale_reasons, "values": self.values, "results": self.results,
                "unresolved": self.unresolved, "precision": self.precision}


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
        records.append(CellRecord(cell.name, dict(cell.values), finished, cell.stale_reasons() if finished else [], values,
                                  {k: str(p) for k, p in cell.results.items()},
                                  [k for k, v in values.items() if v is None] if finished else [],
                                  trained_precision(loaded.get(MAIN)) if finished else None))
    return records


def trained_precision(results: Any) -> str | None:
    """The precision a run resolved `train.precision: auto` to, as its results.json records it
    (`speed_levers.precision`: "bf16 (auto: this CPU has AVX512-BF16 and AMX)"): "bf16"; None for a
    pinned precision (a setting of the grid, compared by staleness) or no record."""
    recorded = lookup(results, "speed_levers.precision") if isinstance(results, dict) else None
    if not isinstance(recorded, str) or "(auto:" not in recorded:
        return None
    return recorded.split()[0]


def mixed_precisions(records: list[CellRecord]) -> dict[str, list[str]]:
    """{precision: finished cells} when `auto` resolved to more than one precision among the finished
    cells, else {}. Grid staleness compares configs, and `train.precision: auto` is the same value on
    every machine: a grid resumed on a machine that resolves it otherwise (bf16 where native, fp32
    elsewhere) mixes the two in one table."""
    by: dict[str, list[str]] = {}
    for r in records:
        if r.finished and r.precision:
            by.setdefault(r.precision, []).append(r.cell)
    return by if len(by) > 1 else {}


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
        ranked = col.better in ("max", "min") and means
        best = (max(means) if col.better == "max" else min(means)) if ranked else None
        for r in rows:
            m = r.stats[col.key].mean
            r.best[col.key] = best is not None and m is not None and round(m * col.scale, col.digits) == best
    return rows


# ----------------------------------------------------------------------------- paired comparisons

# a column whose number is a mean over queries of a retrieval direction: `val.image_to_text_R@1`, `..._mean_rank`
_PER_QUERY = re.compile(rf"^(?P<where>.+)\.(?P<direction>{'|'.join(DIRECTIONS)})_(?:R@(?P<k>[0-9]+)|mean_rank)$")
# a column whose number is a mean over queries of a text evaluation: `metrics.scifact/ndcg@10`, `xquad.answer_recall@5`
_MEAN_OVER_QUERIES = re.compile(r"[./](ndcg|mrr|recall|map|precision|answer_recall|gold_passage_recall|gold_passage_acc)@[0-9]+$")
# a column whose number is a correlation over pairs (STS): `metrics.stsb/spearman`, `stsb.pearson_ab`
_CORRELATION = re.compile(r"^(?P<prefix>.+[./])(?P<method>spearman|pearson)(?:_(?P<tag>ab|ba|mean))?$")


def item_noun(path: str) -> str:
    """What a column's query-level statistics resample: "pairs" for a correlation over pairs (STS),
    "queries" for everything else."""
    path = "metrics." + path[4:] if path.startswith("val.") else path
    return "pairs" if _CORRELATION.match(path.split(":", 1)[-1]) else "queries"


@dataclass
class PairScores:
    """What a correlation column is recomputed from, per pair: the model's scores and the gold scores."""

    pred: np.ndarray
    gold: np.ndarray
    method: str


Outcomes = tuple["np.ndarray | PairScores", "str | None"]


def per_query_outcomes(col: Column, results_path: str | Path, cache: dict[Path, Any] | None = None) -> Outcomes | str:
    """The per-query outcomes behind a column of one cell, with the digest of the evaluated items:
    R@k -> 1.0 where rank < k else 0.0, mean rank -> rank + 1, from the ranks file beside its results
    file (`results.ranks.npz`); a mean of per-query values (nDCG@10, answer recall) -> those values,
    a correlation over pairs (STS Spearman) -> its `PairScores`, from `results.queries.npz`. A string
    says why there are none."""
    cache = {} if cache is None else cache
    m = _PER_QUERY.match(col.path)
    if m is not None:
        loaded = _cached(ranks_path(results_path), load_ranks, cache)
        if not isinstance(loaded, dict):
            return loaded or "no per-query ranks (runs written before they were kept)"
        where = "metrics" if m["where"] == "val" else m["where"]
        ranks = (loaded.get(where) or {}).get(m["direction"])
        if ranks is None:
            return f"no per-query ranks for {where}/{m['direction']}"
        values = (ranks < int(m["k"])).astype(float) if m["k"] else ranks + 1.0
        return values, loaded[where].get(ITEMS_KEY)
    path = "metrics." + col.path[4:] if col.path.startswith("val.") else col.path
    values = _cached(queries_path(results_path), load_query_values, cache)
    if not isinstance(values, dict):
        if values is None and not (_MEAN_OVER_QUERIES.search(path) or _CORRELATION.match(path)):
            return "not a per-query metric"
        return values or "no per-query values (runs written before they were kept)"
    if path in values:
        return values[path], values.get(path + DIGEST_MARK)
    c = _CORRELATION.match(path)
    if c is not None:
        keys = [c["prefix"] + k for k in ("pred_ab", "pred_ba", "gold")]
        if all(k in values for k in keys):
            ab, ba, gold = (values[k] for k in keys)
            pred = {"ab": ab, "ba": ba}.get(c["tag"] or "mean", (ab + ba) / 2)
            return PairScores(pred, gold, c["method"]), values.get(keys[0] + DIGEST_MARK)
    return "not a per-query metric"


def _cached(path: Path, load, cache: dict[Path, Any]) -> Any:
    """load(path) once per report: None when there is no file, a string when it cannot be read."""
    if path not in cache:
        try:
            cache[path] = load(path) if path.is_file() else None
        except (OSError, ValueError) as e:
            cache[path] = f"unreadable {path.name}: {e}"
    return cache[path]


def item_statistics(per_cell: list[tuple[Outcomes, Outcomes]], n_resamples: int) -> tuple[np.ndarray | None, stats.ItemStats | None, str | None]:
    """(per-item differences [seeds, items], None, None) for a mean over items, (None, its
    ItemStats, None) for a correlation over pairs, or (None, None, why) when the cells cannot be
    paired item by item (evaluated on different items, or of different kinds)."""
    outcomes = [o for pair in per_cell for o in pair]
    if len({(len(v.pred) if isinstance(v, PairScores) else len(v), digest) for v, digest in outcomes}) != 1:
        return None, None, "the runs were evaluated on different items"
    kinds = {isinstance(v, PairScores) for v, _ in outcomes}
    if kinds == {False}:
        return np.stack([r[0] - b[0] for b, r in per_cell]), None, None
    if kinds == {True}:
        base = [b[0] for b, _ in per_cell]
        row = [r[0] for _, r in per_cell]
        if any(not np.array_equal(x.gold, base[0].gold) for x in base + row):
            return None, None, "the runs were scored against different gold scores"
        found = stats.correlation_item_stats(base[0].gold, np.stack([b.pred for b in base]),
                                             np.stack([r.pred for r in row]), base[0].method, n_resamples=n_resamples)
        return None, found, None
    return None, None, "per-query outcomes of different kinds"


def baseline_labels(grid: Grid, rows: list[Row]) -> dict[str, str] | None:
    """The row every other row is compared with: the grid's `baseline:`, else the first row."""
    if grid.baseline:
        return dict(grid.baseline)
    return dict(rows[0].labels) if rows and grid.table_axes else None


def comparisons(grid: Grid, records: list[CellRecord], rows: list[Row],
                n_resamples: int = stats.N_RESAMPLES) -> list[dict[str, Any]]:
    """Every row against the baseline row, then the grid's `contrasts` (row, baseline), per ranked
    column (better: max/min): cells are paired by their aggregated axes (seed s with seed s); the
    per-seed differences give the seed-level interval, the per-query outcomes (when every paired cell
    kept them, on the same items) the item-level one; `stats.compare` gives the verdict. Values are in
    the column's raw units. Each comparison is the plain record docs/results.md reads
    (`stats.Comparison.to_dict` + labels)."""
    base = baseline_labels(grid, rows)
    if base is None:
        return []
    axes = [a.name for a in grid.table_axes]

    def members(labels: dict[str, str]) -> dict[tuple, CellRecord]:
        return {tuple(r.axis_values[a] for a in grid.aggregate): r for r in records
                if r.finished and all(r.axis_values[a] == labels[a] for a in axes)}

    pairs = [(row.labels, base) for row in rows if row.labels != base] + list(grid.contrasts)
    cache: dict[Path, Any] = {}
    out = []
    for row_labels, base_labels in pairs:
        row_cells, base_cells = members(row_labels), members(base_labels)
        for col in grid.columns:
            if col.better == "none":
                continue
            keys = [k for k in base_cells if k in row_cells and base_cells[k].values[col.key] is not None
                    and row_cells[k].values[col.key] is not None]
            if not keys:
                continue
            per_seed = [row_cells[k].values[col.key] - base_cells[k].values[col.key] for k in keys]
            per_cell = [(per_query_outcomes(col, base_cells[k].results[col.source], cache),
                         per_query_outcomes(col, row_cells[k].results[col.source], cache)) for k in keys]
            out.append({"labels": row_labels, "baseline": base_labels, "column": col.key,
                        "seeds": [list(k) for k in keys],
                        **paired_comparison(col, per_seed, per_cell, n_resamples)})
    return out


def paired_comparison(col: Column, per_seed: list[float], per_cell: list[tuple[Outcomes | str, Outcomes | str]],
            n_resamples: int) -> dict[str, Any]:
    """`stats.compare` of paired per-seed differences, with the query-level statistics when every
    pair of cells kept per-query outcomes on the same items (else the reason they are missing)."""
    items, item_stats = None, None
    reasons = [o for pair in per_cell for o in pair if isinstance(o, str)]
    if reasons:
        why = reasons[0]
    else:
        items, item_stats, why = item_statistics(per_cell, n_resamples)
    cmp = stats.compare(per_seed, items, item_stats=item_stats, higher_is_better=col.better != "min",
                        n_resamples=n_resamples).to_dict()
    if col.better == "diff":   # a direction, not a judgement: an effect size such as Cohen's d
        cmp["verdict"] = {stats.BETTER: stats.HIGHER, stats.WORSE: stats.LOWER}.get(cmp["verdict"], cmp["verdict"])
    return {**cmp, "items_unavailable": why}


# ----------------------------------------------------------------------------- what training moved

BEFORE = "zero_shot"   # where a trainer keeps its evaluation of the model it started from (eval.at_start)


def before_column(col: Column) -> Column | None:
    """The same metric on the starting model, `metrics.K` -> `zero_shot.K`; None for unranked columns
    and for columns that are not a trained run's `metrics`."""
    if col.better == "none" or not col.path.startswith("metrics."):
        return None
    path = BEFORE + col.path[len("metrics"):]
    return Column(key=f"{col.source}:{path}" if ":" in col.key else path, label=f"{col.label} (before)",
                  scale=col.scale, better=col.better, digits=col.digits)


def training_effects(grid: Grid, records: list[CellRecord], rows: list[Row],
                     n_resamples: int = stats.N_RESAMPLES) -> list[dict[str, Any]]:
    """Every row's after − before on each ranked `metrics.K` column whose runs also evaluated the model
    they started from (`zero_shot.K`): each run against its own start, paired by query where both
    evaluations kept per-query outcomes. The start is the same model in every seed, so the seed
    interval excludes 0 only when training moved the metric by more than the seed-to-seed spread of
    the trained runs: the check that a budget moves the model at all. `baseline` is {"model": "zero_shot"}."""
    cache: dict[Path, Any] = {}

    def results(path: str) -> Any:
        return _cached(Path(path), lambda p: json.loads(p.read_text()), cache)

    out = []
    for row in rows:
        cells = [r for r in records if r.finished and all(r.axis_values[k] == v for k, v in row.labels.items())]
        for col in grid.columns:
            before = before_column(col)
            if before is None:
                continue
            pairs = []
            for r in cells:
                b = lookup(results(r.results[col.source]), before.path)
                if r.values[col.key] is not None and isinstance(b, (int, float)) and not isinstance(b, bool):
                    pairs.append((r, float(b)))
            if not pairs:
                continue
            per_cell = [(per_query_outcomes(before, r.results[col.source], cache),
                         per_query_outcomes(col, r.results[col.source], cache)) for r, _ in pairs]
            out.append({"labels": row.labels, "baseline": {"model": BEFORE}, "column": col.key,
                        "seeds": [[r.axis_values[a] for a in grid.aggregate] for r, _ in pairs],
                        "before": statistics.fmean(b for _, b in pairs),
                        "after": statistics.fmean(r.values[col.key] for r, _ in pairs),
                        **paired_comparison(col, [r.values[col.key] - b for r, b in pairs], per_cell, n_resamples)})
    return out
