"""A grid's report, rendered from what magclip.experiments.collect gathered (typed cell records, table
rows, paired differences to a baseline row with 95 % CIs and a verdict): Markdown/CSV tables, plots
and the rows JSON that docs/results.md looks numbers up in.

A report written to a file (`--report docs/results_x.md`) never silently replaces a richer one:
when the file it would replace records more finished runs, `write_report` refuses
(`ReportRefused`) unless told to overwrite."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

from magclip.diagnostics.plots import pyplot, save_figure
from magclip.experiments import stats
from magclip.experiments.collect import (
    CellRecord,
    Row,
    Stat,
    baseline_labels,
    collect,
    comparisons,
    item_noun,
    mixed_precisions,
    summarize,
    training_effects,
)
from magclip.experiments.grid import Column, Grid, format_value
from magclip.io import atomic_write_json, atomic_write_text

DECIDED = (stats.BETTER, stats.WORSE, stats.HIGHER, stats.LOWER)


class ReportRefused(ValueError):
    """Writing the report would replace a file that records more finished runs."""

def signed(x: float, scale: float, digits: int) -> str:
    """A difference as text with its sign and a true minus: "+2.20", "−0.75"."""
    return f"{x * scale:+.{digits}f}".replace("-", "−")


def interval(lo: float | None, hi: float | None, scale: float, digits: int) -> str:
    """A CI as "[a, b]" with true minus signs; "–" when there is none."""
    if lo is None or hi is None:
        return "–"
    return f"[{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]".replace("-", "−")


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def format_p(p: float | None) -> str:
    if p is None:
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def unit_of(col: Column) -> str:
    """" points" for a 0–1 metric shown ×100 (percentage points), "" for one shown as it is (Cohen's d, ρ)."""
    return " points" if col.scale == 100 else ""


def comparison_statement(c: dict[str, Any], col: Column, name: str | None = None, base: str | None = None) -> str:
    """One line: "qnorm − cosine = +2.20 points, 95 % CI [a, b] over 5 seeds; ... → verdict"."""
    scale, digits, unit = col.scale, col.digits, unit_of(col)
    head = f"{name} − {base} = " if name and base else ""
    text = f"{head}{signed(c['diff'], scale, digits)}{unit}"
    if c.get("seed_low") is not None:
        kind = "paired" if c.get("paired", True) else "unpaired"
        text += f", 95 % CI {interval(c['seed_low'], c['seed_high'], scale, digits)} ({c['n_seeds']} seeds, {kind})"
    else:
        text += f" ({seeds_text(c['n_seeds'])})"
    if c.get("n_items"):
        text += (f"; over {item_noun(col.path)} {interval(c['item_low'], c['item_high'], scale, digits)}, "
                 f"p = {format_p(c['p_items'])} ({c['n_items']} {item_noun(col.path)} × {seeds_text(c['n_seeds'])})")
    text += f" → {c['verdict']}"
    if c["verdict"] == stats.NO_DIFFERENCE and c.get("mde") is not None:
        text += f" (MDE at 80 % power {c['mde'] * scale:.{max(digits - 1, 1)}f}{unit}"
        if c.get("seeds_for_diff"):
            text += f"; a true {signed(c['diff'], scale, digits)} would need {c['seeds_for_diff']} seeds"
        text += ")"
    return text


def comparison_table(grid: Grid, comps: list[dict[str, Any]], levels: bool = False, against: bool = False) -> str:
    """Markdown: one line per (row, ranked column) against the baseline; `levels`: with the
    before and after means of a training effect; `against`: with the baseline of each line (contrasts)."""
    cols = {c.key: c for c in grid.columns}
    axes = [a.name for a in grid.table_axes]
    head = [*axes, *(["− baseline"] if against else []), "column", "seeds", *(["before", "after"] if levels else []),
            "Δ", "95 % CI (seeds)", "95 % CI (queries)", "p (queries)", "MDE (80 % power)", "seeds for Δ", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comps:
        col = cols[c["column"]]
        verdict = f"**{c['verdict']}**" if c["verdict"] in DECIDED else c["verdict"]
        shown = [_fmt(c[k] * col.scale, col.digits).replace("-", "−") for k in ("before", "after")] if levels else []
        baseline = [",".join(f"{k}={v}" for k, v in c["baseline"].items())] if against else []
        lines.append("| " + " | ".join([
            *(c["labels"][a] for a in axes), *baseline, col.label, str(c["n_seeds"]), *shown,
            signed(c["diff"], col.scale, col.digits),
            interval(c["seed_low"], c["seed_high"], col.scale, col.digits),
            interval(c["item_low"], c["item_high"], col.scale, col.digits) if c["n_items"] else "–",
            format_p(c["p_items"]) if c["n_items"] else "–",
            "–" if c["mde"] is None else f"{c['mde'] * col.scale:.{col.digits}f}",
            str(c["seeds_for_diff"] or "–"), verdict]) + " |")
    return "\n".join(lines)


def comparison_notes(grid: Grid, comps: list[dict[str, Any]], base: dict[str, str]) -> list[str]:
    name = ",".join(f"{k}={v}" for k, v in base.items())
    n_items = sorted({c["n_items"] for c in comps if c["n_items"]})
    missing = sorted({c["items_unavailable"] for c in comps if c["items_unavailable"]
                      and c["items_unavailable"] != "not a per-query metric"})
    lines = [f"Differences to `{name}` (row − baseline, in the table's units; runs paired by "
             f"{', '.join(grid.aggregate) or 'cell'}). 95 % CI (seeds): paired t interval of the per-seed differences "
             "(training noise). 95 % CI (queries): bootstrap over the evaluation queries, each query resampled "
             "with its outcomes in every seed (evaluation-set noise), and p: paired permutation test"
             + (f" ({', '.join(map(str, n_items))} queries per seed)" if n_items else "") + "; for a correlation "
             "over pairs (STS Spearman) the pairs are resampled and the correlation recomputed on each draw. "
             "Verdict: better/worse (higher/lower on a column with no better side, such as Cohen's d) only when "
             "every interval excludes 0 on the same side. MDE: the smallest true "
             "difference this grid would detect with 80 % power (the larger of the seed-level t test's and the "
             "query-level one); seeds for Δ: seeds per setting for the t test to detect a true difference of the "
             "observed size with 80 % power."]
    if missing:
        lines.append("Query-level statistics unavailable for some comparisons: " + "; ".join(missing) + ".")
    decided = [c for c in comps if c["verdict"] in DECIDED]
    tested = [c for c in comps if c["n_seeds"] >= 2]
    if len(tested) > 1:
        lines.append(f"{len(decided)} of {len(tested)} comparisons are decided; with {len(tested)} comparisons at 95 % "
                     f"about {0.05 * len(tested):.1f} would be decided by chance alone if no setting differed "
                     "(no correction for multiple comparisons is applied).")
    return lines


def _fmt(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _cell_text(stat: Stat, col: Column) -> str:
    if stat.mean is None:
        return "–"
    text = _fmt(stat.mean * col.scale, col.digits)
    if stat.std is not None:
        text += f" ± {_fmt(stat.std * col.scale, col.digits)}"
    return text


def markdown_table(grid: Grid, rows: list[Row]) -> str:
    axes = [a.name for a in grid.table_axes] or ["cells"]
    head = [*axes, "runs", *(c.label for c in grid.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        labels = [r.labels[a] for a in axes] if grid.table_axes else ["all"]
        vals = []
        for col in grid.columns:
            text = _cell_text(r.stats[col.key], col)
            vals.append(f"**{text}**" if r.best[col.key] else text)
        lines.append("| " + " | ".join([*labels, f"{r.finished}/{r.cells}", *vals]) + " |")
    return "\n".join(lines)


def write_csv(grid: Grid, rows: list[Row], path: Path) -> None:
    """One row per table row: axis labels, runs finished, and per column mean, std, n and best (1/0)."""
    axes = [a.name for a in grid.table_axes]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    header = [*axes, "runs_finished", "runs"]
    for col in grid.columns:
        header += [f"{col.label} mean", f"{col.label} std", f"{col.label} n", f"{col.label} best"]
    w.writerow(header)
    for r in rows:
        line: list[Any] = [r.labels[a] for a in axes] + [r.finished, r.cells]
        for col in grid.columns:
            s = r.stats[col.key]
            line += ["" if s.mean is None else repr(s.mean * col.scale),
                     "" if s.std is None else repr(s.std * col.scale), s.n, int(r.best[col.key])]
        w.writerow(line)
    atomic_write_text(path, buf.getvalue())


def write_cells_csv(grid: Grid, records: list[CellRecord], path: Path) -> None:
    """One row per cell (no aggregation): axis values, finished, stale, each column's scaled value."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["cell", *(a.name for a in grid.axes), "finished", "stale", *(c.label for c in grid.columns)])
    for r in records:
        w.writerow([r.cell, *(r.axis_values[a.name] for a in grid.axes), int(r.finished), int(r.stale),
                    *("" if r.values[c.key] is None else repr(r.values[c.key] * c.scale) for c in grid.columns)])
    atomic_write_text(path, buf.getvalue())


def _slug(text: str) -> str:
    text = text.replace("→", "2").replace("@", "at")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "column"


def write_plots(grid: Grid, rows: list[Row], plot_dir: Path) -> list[Path]:
    """One bar chart per column (mean, std error bars, best bar highlighted) + overview.png: the ranked
    columns at the grid's scale side by side."""
    plt = pyplot()

    plot_dir.mkdir(parents=True, exist_ok=True)
    axes = [a.name for a in grid.table_axes]
    names = [",".join(r.labels[a] for a in axes) or "all" for r in rows]
    agg = f" (mean ± std over {', '.join(grid.aggregate)})" if grid.aggregate else ""
    paths = []
    for col in grid.columns:
        means = [r.stats[col.key].mean for r in rows]
        heights = [0.0 if m is None else m * col.scale for m in means]
        errs = [0.0 if r.stats[col.key].std is None else r.stats[col.key].std * col.scale for r in rows]
        colors = ["tab:orange" if r.best[col.key] else "tab:blue" for r in rows]
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
        paths.append(save_figure(fig, path))
    shown = [c for c in grid.columns if c.better != "none" and c.scale == grid.scale] or grid.columns
    fig, ax = plt.subplots(figsize=(max(6.0, len(shown) * (0.8 + 0.15 * len(rows)) + 2), 4.0))
    width = 0.8 / max(1, len(rows))
    for i, (r, name) in enumerate(zip(rows, names)):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(shown))]
        hs = [0.0 if r.stats[c.key].mean is None else r.stats[c.key].mean * c.scale for c in shown]
        es = [0.0 if r.stats[c.key].std is None else r.stats[c.key].std * c.scale for c in shown]
        ax.bar(xs, hs, width, yerr=es if any(es) else None, label=name, capsize=2)
    ax.set_xticks(range(len(shown)), [c.label for c in shown], rotation=30, ha="right", fontsize=8)
    ax.set_title(f"{grid.name}{agg}", fontsize=9)
    ax.legend(fontsize=7, ncol=max(1, len(rows) // 6 + 1))
    fig.tight_layout()
    path = plot_dir / "overview.png"
    paths.append(save_figure(fig, path))
    return paths


def write_difference_plot(grid: Grid, comps: list[dict[str, Any]], path: Path) -> Path | None:
    """differences.png: per compared column, each row's difference to the baseline (dot) with its
    95 % CI over seeds (thick) and over queries (thin); a dashed line at 0."""
    shown = [c for c in grid.columns if any(x["column"] == c.key and x["seed_low"] is not None for x in comps)]
    if not shown:
        return None
    plt = pyplot()

    axes_names = [a.name for a in grid.table_axes]
    n = len(shown)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axs = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 0.45 * max(3, len(comps) // n) * nrows + 1.2),
                            squeeze=False)
    for ax, col in zip(axs.flat, shown):
        mine = [c for c in comps if c["column"] == col.key]
        for y, c in enumerate(mine):
            if c["item_low"] is not None:
                ax.plot([c["item_low"] * col.scale, c["item_high"] * col.scale], [y + 0.15, y + 0.15], color="k",
                        lw=1.2, zorder=3)
            if c["seed_low"] is not None:
                ax.plot([c["seed_low"] * col.scale, c["seed_high"] * col.scale], [y, y], color="tab:blue", lw=3,
                        alpha=0.6)
            color = {stats.BETTER: "tab:green", stats.WORSE: "tab:red", stats.HIGHER: "tab:purple",
                     stats.LOWER: "tab:purple"}.get(c["verdict"], "black")
            ax.plot([c["diff"] * col.scale], [y], "o", color=color, zorder=4)
        ax.axvline(0, color="k", ls="--", lw=0.8)
        ax.set_yticks(range(len(mine)), [",".join(c["labels"][a] for a in axes_names) for c in mine], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(col.label, fontsize=9)
    for ax in list(axs.flat)[n:]:
        ax.axis("off")
    base = next(iter(comps))["baseline"]
    fig.suptitle(f"{grid.name}: row − {','.join(f'{k}={v}' for k, v in base.items())} (95 % CI: over seeds "
                 "blue, over queries black; green/red: better/worse, purple: a decided higher/lower)", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def unresolved_columns(records: list[CellRecord]) -> dict[str, list[str]]:
    """Column key -> finished cells whose results have no number at that path."""
    out: dict[str, list[str]] = {}
    for r in records:
        for key in r.unresolved:
            out.setdefault(key, []).append(r.cell)
    return out


TRAINING_EFFECT_NOTE = (
    "After − before: each run's trained model against the model it started from (`zero_shot`, evaluated on "
    "the same queries), paired by run; 95 % CI (queries): the queries resampled with both their outcomes (STS: "
    "the pairs, the correlation recomputed on each draw). The start is the same model in every seed, so "
    "the seed interval excludes 0 only when training moved the metric by more than the trained runs' "
    "seed-to-seed spread; better/worse (higher/lower): training moved it up/down beyond both the seed and "
    "the query noise.")


def split_contrasts(comps: list[dict[str, Any]], base: dict[str, str] | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the comparisons against the grid's baseline, the other contrasts)."""
    return [c for c in comps if c["baseline"] == base], [c for c in comps if c["baseline"] != base]


def markdown_report(grid: Grid, rows: list[Row], records: list[CellRecord], plots: list[Path],
                    relative_to: Path, comps: list[dict[str, Any]] | None = None,
                    effects: list[dict[str, Any]] | None = None) -> str:
    """The grid's section for docs: title, provenance, table, notes on the cells, plots."""
    n_cells = len(records)
    done = sum(r.finished for r in records)
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
    base = baseline_labels(grid, rows)
    comps, contrasts = split_contrasts(comps or [], base)
    if any(c["n_seeds"] >= 2 or c["n_items"] for c in comps):
        lines += ["### Differences to the baseline", "", comparison_table(grid, comps), ""]
        for note in comparison_notes(grid, comps, base):
            lines += [note, ""]
    elif base is not None and len(rows) > 1:
        lines += [(f"No differences to the baseline `{','.join(f'{k}={v}' for k, v in base.items())}` with an "
                   "interval: that needs at least 2 finished seeds per setting, paired with the baseline's, or "
                   "runs that kept their per-query ranks."), ""]
    if any(c["n_seeds"] >= 2 or c["n_items"] for c in contrasts):
        lines += ["### Other contrasts (the grid's `contrasts`)", "", comparison_table(grid, contrasts, against=True),
                  "", "Row − the line's baseline, with the statistics and verdicts of the differences above.", ""]
    if effects:
        lines += ["### What training moved (each run against the model it started from)", "",
                  comparison_table(grid, effects, levels=True), "", TRAINING_EFFECT_NOTE, ""]
    missing = [r.cell for r in records if not r.finished]
    stale = [r for r in records if r.stale]
    if missing:
        lines += [f"Not finished: {', '.join(f'`{m}`' for m in missing)}.", ""]
    if stale:
        lines += ["Stale (finished, but not the experiment the grid runs now; in the table all the same): "
                  + "; ".join(f"`{r.cell}` ({', '.join(r.stale_reasons)})" for r in stale) + ".", ""]
    mixed = mixed_precisions(records)
    if mixed:
        lines += ["Trained in different precisions (`train.precision: auto` resolves per machine; pin it in the "
                  "grid to compare like with like): "
                  + "; ".join(f"{p} {', '.join(f'`{c}`' for c in cells)}" for p, cells in mixed.items()) + ".", ""]
    for key, cells in unresolved_columns(records).items():
        where = ", ".join(f"`{c}`" for c in cells)
        lines += [(f"Column `{key}` has no number in finished runs {where} (a typo in the path, or a metric "
                   "the run does not report)."), ""]
    for p in plots:
        rel = os.path.relpath(p, relative_to)
        lines.append(f"![{p.stem}]({Path(rel).as_posix()})")
    return "\n".join(lines).rstrip() + "\n"


def finished_in_report(report: Path) -> int | None:
    """How many finished runs an existing report records (its JSON's rows, else the Markdown's
    "N/M runs finished" line); None when there is no report or it says nothing."""
    side = report.with_suffix(".json")
    try:
        data = json.loads(side.read_text())
        return int(sum(int(r.get("finished", 0)) for r in data.get("rows", [])))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    try:
        m = re.search(r"([0-9]+)/[0-9]+ runs finished", report.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def check_report_target(report: str | Path, finished: int, total: int) -> None:
    """Refuse (ReportRefused) to replace a report that records more finished runs than `finished`."""
    before = finished_in_report(Path(report))
    if before is not None and finished < before:
        raise ReportRefused(
            f"{report} records {before} finished runs, this report only {finished}/{total} (are the run folders "
            "here? see the grid's output_dir, or pass --output-dir); refusing to replace the richer report -- "
            "pass --overwrite-report to replace it anyway")


def write_report(grid: Grid, report: str | Path | None = None, plots: bool = True,
                 overwrite_report: bool = False, n_resamples: int = stats.N_RESAMPLES) -> dict[str, Any]:
    """Collect every cell's results and write compare.md, compare.csv, cells.csv, compare.json and
    plots/*.png under the grid's output_dir (and the Markdown also to `report`, with plot links
    relative to it, and its rows and comparisons to the JSON beside it). A `report` that records
    more finished runs than this one is refused before anything is written, unless
    `overwrite_report`."""
    out = grid.output_dir
    records = collect(grid)
    if report is not None and not overwrite_report:
        check_report_target(report, sum(r.finished for r in records), len(records))
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(grid, records)
    base = baseline_labels(grid, rows)
    comps = comparisons(grid, records, rows, n_resamples=n_resamples)
    effects = training_effects(grid, records, rows, n_resamples=n_resamples)
    plot_paths = write_plots(grid, rows, out / "plots") if plots else []
    if plots:
        diff_plot = write_difference_plot(grid, split_contrasts(comps, base)[0], out / "plots" / "differences.png")
        plot_paths += [diff_plot] if diff_plot else []
    md = markdown_report(grid, rows, records, plot_paths, out, comps, effects)
    atomic_write_text(out / "compare.md", md)
    write_csv(grid, rows, out / "compare.csv")
    write_cells_csv(grid, records, out / "cells.csv")
    summary_rows = [r.to_dict() for r in rows]
    records_json = [r.to_dict() for r in records]
    cells = [{k: v for k, v in r.items() if k not in ("results", "unresolved")} for r in records_json]
    atomic_write_json(out / "compare.json", {"grid": str(grid.path) if grid.path else None, "records": records_json,
                                             "rows": summary_rows, "baseline": base, "comparisons": comps,
                                             "training_effects": effects})
    written = {"markdown": out / "compare.md", "csv": out / "compare.csv", "cells_csv": out / "cells.csv",
               "json": out / "compare.json", "plots": plot_paths, "table": markdown_table(grid, rows),
               "rows": rows, "records": records, "comparisons": comps, "training_effects": effects,
               "comparison_table": comparison_table(grid, split_contrasts(comps, base)[0]) if comps else ""}
    if report is not None:
        report = Path(report)
        # a report lives in docs/ and is committed; run folders are not: it gets its own copy of the
        # overview and differences plots (the per-column bars stay in the run folder)
        shown = []
        for plot in plot_paths:
            if plot.name in ("overview.png", "differences.png"):
                report.parent.mkdir(parents=True, exist_ok=True)
                shown.append(report.with_name(f"{report.stem}_{plot.name}"))
                shutil.copyfile(plot, shown[-1])
        atomic_write_text(report, markdown_report(grid, rows, records, shown, report.parent, comps, effects))
        # beside the report: the rows, each cell's values and the comparisons -- what docs/results.md's
        # {{grid ...}} and {{diff ...}} placeholders read (magclip.experiments.results_page)
        atomic_write_json(report.with_suffix(".json"), {"grid": str(grid.path) if grid.path else None,
                                                        "rows": summary_rows, "cells": cells, "baseline": base,
                                                        "comparisons": comps, "training_effects": effects})
        written["report"] = report
    return written


__all__ = ["ReportRefused", "check_report_target", "comparison_statement", "comparison_table", "markdown_report",
           "markdown_table", "unresolved_columns", "write_report"]
