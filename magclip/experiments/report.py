"""A grid's report: results collected per cell, mean and spread per row, Markdown/CSV tables, plots
and the rows JSON that docs/results.md looks numbers up in."""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools
import json
import math
import os
import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magclip.experiments.grid import Column, Grid, format_value
from magclip.io import atomic_write_json, atomic_write_text

# ----------------------------------------------------------------------------- collecting


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


def collect(grid: Grid) -> list[dict[str, Any]]:
    """One record per cell: its axis values, finished/stale flags and the columns' raw values (or None)."""
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
        records.append({"cell": cell.name, **cell.values, "finished": finished, "stale": finished and cell.stale,
                        "values": values, "results": {k: str(p) for k, p in cell.results.items()},
                        "unresolved": [k for k, v in values.items() if v is None] if finished else []})
    return records


@dataclass
class Stat:
    mean: float | None
    std: float | None
    n: int


def _stat(values: list[float | None]) -> Stat:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return Stat(None, None, 0)
    return Stat(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs))


def summarize(grid: Grid, records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Table rows: one per combination of the non-aggregated axes (in YAML order), each column's
    mean and sample std over the aggregated axes, the number of finished cells, and the best flags."""
    records = collect(grid) if records is None else records
    axes = grid.table_axes
    per_group = 1
    for a in grid.axes:
        if a.name in grid.aggregate:
            per_group *= len(a.values)
    rows = []
    for combo in itertools.product(*(a.values for a in axes)):
        key = {a.name: v.name for a, v in zip(axes, combo)}
        members = [r for r in records if all(r[k] == v for k, v in key.items())]
        stats = {col.key: _stat([r["values"][col.key] for r in members]) for col in grid.columns}
        rows.append({"labels": key, "finished": sum(r["finished"] for r in members), "cells": per_group,
                     "stats": stats, "best": {}})
    for col in grid.columns:
        means = [round(r["stats"][col.key].mean * col.scale, col.digits) for r in rows
                 if r["stats"][col.key].mean is not None]
        best = None if col.better == "none" or not means else (max(means) if col.better == "max" else min(means))
        for r in rows:
            m = r["stats"][col.key].mean
            r["best"][col.key] = best is not None and m is not None and round(m * col.scale, col.digits) == best
    return rows


def _fmt(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _cell_text(stat: Stat, col: Column) -> str:
    if stat.mean is None:
        return "–"
    text = _fmt(stat.mean * col.scale, col.digits)
    if stat.std is not None:
        text += f" ± {_fmt(stat.std * col.scale, col.digits)}"
    return text


def markdown_table(grid: Grid, rows: list[dict[str, Any]]) -> str:
    axes = [a.name for a in grid.table_axes] or ["cells"]
    head = [*axes, "runs", *(c.label for c in grid.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        labels = [r["labels"][a] for a in axes] if grid.table_axes else ["all"]
        vals = []
        for col in grid.columns:
            text = _cell_text(r["stats"][col.key], col)
            vals.append(f"**{text}**" if r["best"][col.key] else text)
        lines.append("| " + " | ".join([*labels, f"{r['finished']}/{r['cells']}", *vals]) + " |")
    return "\n".join(lines)


def write_csv(grid: Grid, rows: list[dict[str, Any]], path: Path) -> None:
    """One row per table row: axis labels, runs finished, and per column mean, std, n and best (1/0)."""
    axes = [a.name for a in grid.table_axes]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = [*axes, "runs_finished", "runs"]
    for col in grid.columns:
        header += [f"{col.label} mean", f"{col.label} std", f"{col.label} n", f"{col.label} best"]
    w.writerow(header)
    for r in rows:
        line: list[Any] = [r["labels"][a] for a in axes] + [r["finished"], r["cells"]]
        for col in grid.columns:
            s = r["stats"][col.key]
            line += ["" if s.mean is None else repr(s.mean * col.scale),
                     "" if s.std is None else repr(s.std * col.scale), s.n, int(r["best"][col.key])]
        w.writerow(line)
    atomic_write_text(path, buf.getvalue())


def write_cells_csv(grid: Grid, records: list[dict[str, Any]], path: Path) -> None:
    """One row per cell (no aggregation): axis values, finished, stale, each column's scaled value."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["cell", *(a.name for a in grid.axes), "finished", "stale", *(c.label for c in grid.columns)])
    for r in records:
        w.writerow([r["cell"], *(r[a.name] for a in grid.axes), int(r["finished"]), int(r["stale"]),
                    *("" if r["values"][c.key] is None else repr(r["values"][c.key] * c.scale) for c in grid.columns)])
    atomic_write_text(path, buf.getvalue())


def _slug(text: str) -> str:
    text = text.replace("→", "2").replace("@", "at")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "column"


def write_plots(grid: Grid, rows: list[dict[str, Any]], plot_dir: Path) -> list[Path]:
    """One bar chart per column (mean, std error bars, best bar highlighted) + overview.png: the ranked
    columns at the grid's scale side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    axes = [a.name for a in grid.table_axes]
    names = [",".join(r["labels"][a] for a in axes) or "all" for r in rows]
    agg = f" (mean ± std over {', '.join(grid.aggregate)})" if grid.aggregate else ""
    paths = []
    for col in grid.columns:
        means = [r["stats"][col.key].mean for r in rows]
        heights = [0.0 if m is None else m * col.scale for m in means]
        errs = [0.0 if r["stats"][col.key].std is None else r["stats"][col.key].std * col.scale for r in rows]
        colors = ["tab:orange" if r["best"][col.key] else "tab:blue" for r in rows]
        fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(rows) + 2), 3.6))
        ax.bar(range(len(rows)), heights, yerr=errs if any(errs) else None, color=colors, capsize=3)
        for i, m in enumerate(means):
            ax.annotate("–" if m is None else _fmt(m * col.scale, col.digits), (i, heights[i]), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(col.label)
        ax.set_title(f"{grid.name}: {col.label}{agg}", fontsize=9)
        fig.tight_layout()
        path = plot_dir / f"{_slug(col.label)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    shown = [c for c in grid.columns if c.better != "none" and c.scale == grid.scale] or grid.columns
    fig, ax = plt.subplots(figsize=(max(6.0, len(shown) * (0.8 + 0.15 * len(rows)) + 2), 4.0))
    width = 0.8 / max(1, len(rows))
    for i, (r, name) in enumerate(zip(rows, names)):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(shown))]
        hs = [0.0 if r["stats"][c.key].mean is None else r["stats"][c.key].mean * c.scale for c in shown]
        es = [0.0 if r["stats"][c.key].std is None else r["stats"][c.key].std * c.scale for c in shown]
        ax.bar(xs, hs, width, yerr=es if any(es) else None, label=name, capsize=2)
    ax.set_xticks(range(len(shown)), [c.label for c in shown], rotation=30, ha="right", fontsize=8)
    ax.set_title(f"{grid.name}{agg}", fontsize=9)
    ax.legend(fontsize=7, ncol=max(1, len(rows) // 6 + 1))
    fig.tight_layout()
    path = plot_dir / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def unresolved_columns(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Column key -> finished cells whose results have no number at that path."""
    out: dict[str, list[str]] = {}
    for r in records:
        for key in r["unresolved"]:
            out.setdefault(key, []).append(r["cell"])
    return out


def markdown_report(grid: Grid, rows: list[dict[str, Any]], records: list[dict[str, Any]], plots: list[Path],
                    relative_to: Path) -> str:
    """The grid's section for docs: title, provenance, table, notes on the cells, plots."""
    n_cells = len(records)
    done = sum(r["finished"] for r in records)
    source = grid.path.as_posix() if grid.path else "(in-memory grid)"
    command = grid.command or f"python eval/compare.py --grid {source} --only-report"
    lines = [f"## {grid.name}", ""]
    if grid.description:
        lines += [grid.description.strip(), ""]
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines += [(f"Grid `{source}`: {done}/{n_cells} runs finished; collected {when}. "
               f"Generated by `{command}`; no number is typed by hand."), ""]
    lines.append(markdown_table(grid, rows))
    lines.append("")
    notes = []
    if grid.aggregate:
        notes.append(f"mean ± sample std over {', '.join(grid.aggregate)}; `runs` = finished/planned runs per row")
    scales = sorted({c.scale for c in grid.columns})
    if scales == [100.0]:
        notes.append("values ×100 (recall etc. in %)")
    elif 100.0 in scales:
        notes.append("columns with a 0–1 metric are ×100")
    notes.append("bold: the best row per column (at the shown precision)")
    lines.append("; ".join(notes) + ".")
    lines.append("")
    settings = [f"`{a.name}={v.name}`: " + (" ".join(f"`{k}={format_value(x)}`" for k, x in v.set.items()) or "—")
                + (f" (base `{v.base}`)" if v.base else "") for a in grid.axes for v in a.values
                if a.name not in grid.aggregate and (v.set or v.base)]
    common = [f"base `{grid.base}`"] if grid.base else []
    if grid.overrides:
        common.append("overrides " + " ".join(f"`{o}`" for o in grid.overrides))
    if common:
        lines.append("Every run: " + ", ".join(common) + ".")
        lines.append("")
    if settings:
        lines += ["Settings: " + "; ".join(settings) + ".", ""]
    missing = [r["cell"] for r in records if not r["finished"]]
    stale = [r["cell"] for r in records if r["stale"]]
    if missing:
        lines += [f"Not finished: {', '.join(f'`{m}`' for m in missing)}.", ""]
    if stale:
        lines += [f"Stale (finished under another spec): {', '.join(f'`{s}`' for s in stale)}.", ""]
    for key, cells in unresolved_columns(records).items():
        where = ", ".join(f"`{c}`" for c in cells)
        lines += [(f"Column `{key}` has no number in finished runs {where} (a typo in the path, or a metric "
                   "the run does not report)."), ""]
    for p in plots:
        rel = os.path.relpath(p, relative_to)
        lines.append(f"![{p.stem}]({Path(rel).as_posix()})")
    return "\n".join(lines).rstrip() + "\n"


def write_report(grid: Grid, report: str | Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Collect every cell's results and write compare.md, compare.csv, cells.csv and plots/*.png under
    the grid's output_dir (and the Markdown also to `report`, with plot links relative to it)."""
    out = grid.output_dir
    out.mkdir(parents=True, exist_ok=True)
    records = collect(grid)
    rows = summarize(grid, records)
    plot_paths = write_plots(grid, rows, out / "plots") if plots else []
    md = markdown_report(grid, rows, records, plot_paths, out)
    atomic_write_text(out / "compare.md", md)
    write_csv(grid, rows, out / "compare.csv")
    write_cells_csv(grid, records, out / "cells.csv")
    summary_rows = [{"labels": r["labels"], "finished": r["finished"], "cells": r["cells"],
                     "stats": {k: vars(s) for k, s in r["stats"].items()}, "best": r["best"]} for r in rows]
    atomic_write_json(out / "compare.json", {"grid": str(grid.path) if grid.path else None, "records": records,
                                             "rows": summary_rows})
    written = {"markdown": out / "compare.md", "csv": out / "compare.csv", "cells_csv": out / "cells.csv",
               "json": out / "compare.json", "plots": plot_paths, "table": markdown_table(grid, rows),
               "rows": rows, "records": records}
    if report is not None:
        report = Path(report)
        # a report lives in docs/ and is committed; run folders are not: it gets its own copy of the
        # overview plot (the per-column bars stay in the run folder)
        shown = []
        overview = next((p for p in plot_paths if p.name == "overview.png"), None)
        if overview is not None:
            report.parent.mkdir(parents=True, exist_ok=True)
            shown = [report.with_name(f"{report.stem}_overview.png")]
            shutil.copyfile(overview, shown[0])
        atomic_write_text(report, markdown_report(grid, rows, records, shown, report.parent))
        # the rows beside the report: what docs/results.md's {{grid ...}} placeholders read (magclip.experiments.results_page)
        atomic_write_json(report.with_suffix(".json"), {"grid": str(grid.path) if grid.path else None,
                                                        "rows": summary_rows})
        written["report"] = report
    return written


__all__ = ["collect", "lookup", "markdown_table", "summarize", "unresolved_columns", "write_report"]
