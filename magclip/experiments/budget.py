"""The budget curve: a grid's modes against its baseline mode at every evaluated step of their runs.

A text run with `train.val_at` keeps each evaluation after step N in `RUN/evals/step_N.json` with its
per-query outcomes beside it (magclip.training.text.write_step_evaluation), the final one included.
For every grid column (`metrics.xquad/answer_recall@1`, `metrics.stsb/spearman`, ...) and every step
that the baseline's and the mode's runs of a seed both evaluated, mode − baseline is paired by seed
and query exactly as a grid report pairs two cells (magclip.experiments.collect: a mean over queries
is bootstrapped over queries, a correlation recomputed over resampled pairs), with its 95 % intervals
and the permutation p. With one seed per mode the interval is the evaluation set's (queries) only:
two particular runs differ, not yet two settings.

The start (step 0) is each run's evaluation of the model it started from (`eval.at_start`:
`RUN/zero_shot.json` and its per-query outcomes), scored with the run's own mode: the gap before any
training, drawn left of the log axis. The one-line answer per set and mode (`trend`) reads the curve
from its first trained budget to its last: the gap crosses zero, closes (no longer detected), opens,
levels off, narrows or widens; a metric with no per-query outcomes and one run per mode (Cohen's d of
document norms) has no interval, and the answer says so instead of calling a gap undetected.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from magclip.experiments import stats
from magclip.experiments.collect import lookup, paired_comparison, per_query_outcomes
from magclip.experiments.grid import Column, Grid
from magclip.experiments.report import format_p, interval, signed

STEP_FILE = re.compile(r"^step_(\d+)\.json$")
EVALS_DIR = "evals"
START_FILE = "zero_shot.json"   # eval.at_start's evaluation, {"zero_shot": metrics}, beside its .queries.npz
START_STEP = 0


@dataclass
class BudgetPoint:
    """mode − baseline on one column after `step` (raw units)."""

    key: str
    mode: str
    step: int
    n_seeds: int
    base: float
    row: float
    diff: float
    low: float          # the query-level (evaluation set) interval, the seed one where there are seeds
    high: float
    p: float
    n_items: int
    decided: bool

    @property
    def sign(self) -> int:
        return (self.diff > 0) - (self.diff < 0)

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    @property
    def gap(self) -> str:
        if not self.has_interval:
            return "no interval"
        return "decided" if self.decided else "none detected"


def step_files(run_dir: Path) -> dict[int, Path]:
    """{step: evals/step_N.json} of a run folder, and {0: zero_shot.json} where it evaluated its start."""
    folder = run_dir / EVALS_DIR
    found = {int(m[1]): p for p in folder.glob("step_*.json") if (m := STEP_FILE.match(p.name))}
    if (run_dir / START_FILE).is_file():
        found[START_STEP] = run_dir / START_FILE
    return dict(sorted(found.items()))


def _at_step(col: Column, step: int) -> Column:
    """The column as the step's file holds it: the start's file keeps `metrics.X` under `zero_shot.X`."""
    if step != START_STEP or not col.path.startswith("metrics."):
        return col
    return replace(col, key="zero_shot." + col.path[len("metrics."):])


def budget_points(grid: Grid, mode_axis: str = "loss", baseline: str | None = None, seed_axis: str = "seed",
                  columns: Sequence[Column] | None = None, n_resamples: int = stats.N_RESAMPLES) -> list[BudgetPoint]:
    """Every (column, mode, step) the grid's finished cells allow, the baseline mode's cells paired with
    each mode's by seed (the other axes, if any, must match too)."""
    baseline = baseline or (grid.baseline or {}).get(mode_axis)
    if baseline is None:
        raise ValueError(f"{grid.name}: name the baseline {mode_axis} (the grid's baseline: or --baseline)")
    columns = [c for c in (columns or grid.columns) if c.path.startswith("metrics.")]
    cells = {}
    for cell in grid.cells():
        other = tuple(sorted((k, v) for k, v in cell.values.items() if k != mode_axis))
        cells[(cell.values[mode_axis], other)] = cell
    points = []
    modes = [v.name for a in grid.axes if a.name == mode_axis for v in a.values if v.name != baseline]
    for mode in modes:
        pairs = [(cells[(baseline, other)], cells[(m, other)]) for (m, other) in cells
                 if m == mode and (baseline, other) in cells]
        by_step: dict[int, list[tuple[Path, Path]]] = {}
        for base_cell, row_cell in pairs:
            base_steps, row_steps = step_files(base_cell.run_dir), step_files(row_cell.run_dir)
            for step in sorted(set(base_steps) & set(row_steps)):
                by_step.setdefault(step, []).append((base_steps[step], row_steps[step]))
        for step, files in sorted(by_step.items()):
            for col in columns:
                point = _point(_at_step(col, step), mode, step, files, n_resamples, key=col.path)
                if point is not None:
                    points.append(point)
    return points


def _point(col: Column, mode: str, step: int, files: list[tuple[Path, Path]], n_resamples: int,
           key: str) -> BudgetPoint | None:
    numbers = [(lookup(_read(b), col.path), lookup(_read(r), col.path)) for b, r in files]
    if any(not isinstance(x, (int, float)) for pair in numbers for x in pair):
        return None
    per_cell = [(per_query_outcomes(col, b), per_query_outcomes(col, r)) for b, r in files]
    cmp = paired_comparison(col, [r - b for b, r in numbers], per_cell, n_resamples)
    if cmp["n_items"]:
        low, high, p = cmp["item_low"], cmp["item_high"], cmp["p_items"]
        decided = (low > 0 or high < 0) and p < 1 - stats.CONFIDENCE
    else:
        low, high, p, decided = cmp["seed_low"], cmp["seed_high"], math.nan, False
    if len(files) >= 2:       # with seeds, the grid's rule: both intervals on one side
        decided = cmp["verdict"] not in (stats.NO_DIFFERENCE, stats.ONE_SEED)
    return BudgetPoint(key, mode, step, len(files), sum(b for b, _ in numbers) / len(numbers),
                       sum(r for _, r in numbers) / len(numbers), cmp["diff"], _num(low), _num(high), _num(p),
                       cmp["n_items"], bool(decided))


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def trend(points: Sequence[BudgetPoint]) -> str:
    """How the gap moves from the first trained budget to the last (points of one column and mode; the
    start, step 0, is shown, not read here: it is the gap before training)."""
    pts = sorted((p for p in points if p.step != START_STEP), key=lambda p: p.step)
    if not pts:
        return "no evaluated step"
    first, last = pts[0], pts[-1]
    if len(pts) == 1:
        return "one budget only"
    if not any(p.has_interval for p in pts):
        return (f"no interval (one run per mode, no per-query outcomes): {_minus(f'{first.diff:+.3g}')} "
                f"after step {first.step}, {_minus(f'{last.diff:+.3g}')} after step {last.step}")
    if not any(p.decided for p in pts):
        return "no gap detected at any budget"
    if first.decided and last.decided and first.sign != last.sign:
        return "crosses zero"
    if first.decided and not last.decided:
        return "closes (no gap detected at the last budget)"
    if not first.decided and last.decided:
        return "opens"
    if not last.decided:
        return "a gap at some budgets only, none at the first or the last"
    prev = pts[-2]
    if prev.decided and prev.sign == last.sign and prev.low <= last.high and last.low <= prev.high:
        return "levels off"
    return "widens" if abs(last.diff) > abs(first.diff) else "narrows"


def answers(points: Sequence[BudgetPoint]) -> dict[tuple[str, str], str]:
    """{(column, mode): its `trend`}."""
    out = {}
    for key, mode in dict.fromkeys((p.key, p.mode) for p in points):
        pts = sorted((p for p in points if p.key == key and p.mode == mode), key=lambda p: p.step)
        out[(key, mode)] = trend(pts)
    return out


def plot_budget(points: Sequence[BudgetPoint], path: str | Path, labels: dict[str, str] | None = None,
                scale: float = 100.0) -> Path | None:
    """mode − baseline against steps (log axis) with its 95 % band, one panel per column."""
    from magclip.diagnostics.plots import panels, save_figure

    keys = list(dict.fromkeys(p.key for p in points))
    if not keys:
        return None
    fig, axes = panels(len(keys))
    trained = [p.step for p in points if p.step != START_STEP]
    start_x = min(trained) / 3 if trained else 1.0    # where the start is drawn, left of the log axis
    for ax, key in zip(axes, keys):
        for mode in dict.fromkeys(p.mode for p in points if p.key == key):
            pts = sorted((p for p in points if p.key == key and p.mode == mode), key=lambda p: p.step)
            line, = ax.plot([p.step for p in pts if p.step != START_STEP],
                            [p.diff * scale for p in pts if p.step != START_STEP], marker="o", label=mode)
            banded = [p for p in pts if p.step != START_STEP and p.has_interval]
            ax.fill_between([p.step for p in banded], [p.low * scale for p in banded],
                            [p.high * scale for p in banded], color=line.get_color(), alpha=0.18)
            for p in (p for p in pts if p.step == START_STEP):
                err = [[(p.diff - p.low) * scale], [(p.high - p.diff) * scale]] if p.has_interval else None
                ax.errorbar([start_x], [p.diff * scale], yerr=err, marker="s", color=line.get_color(), capsize=3,
                            ls="none")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        if any(p.step == START_STEP for p in points):
            ticks = [start_x, *sorted(set(trained))]
            ax.set_xticks(ticks, ["start", *(str(t) for t in ticks[1:])], fontsize=7)
            ax.minorticks_off()
        ax.set_xlabel("training steps")
        ax.set_title((labels or {}).get(key, key), fontsize=9)
        ax.set_ylabel(f"mode − baseline (×{scale:g})" if scale != 1 else "mode − baseline")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def markdown(points: Sequence[BudgetPoint], baseline: str, labels: dict[str, str] | None = None,
             scales: dict[str, float] | None = None, digits: int = 2) -> str:
    """One table of every point, then the one-line answers."""
    lines = [(f"| set / metric | mode | step (0: the start) | seeds | {baseline} | mode | Δ | 95 % CI "
              "| p (queries) | gap |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {key: i for i, key in enumerate(dict.fromkeys(p.key for p in points))}
    for p in sorted(points, key=lambda p: (order[p.key], p.mode, p.step)):     # each set's curve together
        s = (scales or {}).get(p.key, 100.0)
        lines.append(f"| {(labels or {}).get(p.key, p.key)} | {p.mode} | {p.step} | {p.n_seeds} "
                     f"| {_plain(p.base, s, digits)} | {_plain(p.row, s, digits)} | {signed(p.diff, s, digits)} "
                     f"| {'–' if math.isnan(p.low) else interval(p.low, p.high, s, digits)} "
                     f"| {'–' if math.isnan(p.p) else format_p(p.p)} | {p.gap} |")
    lines.append("")
    for (key, mode), answer in answers(points).items():
        lines.append(f"- {(labels or {}).get(key, key)}, {mode} − {baseline}: {answer}.")
    return "\n".join(lines)


def _plain(x: float, scale: float, digits: int) -> str:
    return _minus(f"{x * scale:.{digits}f}")


def _minus(text: str) -> str:
    return text.replace("-", "−")


def as_records(points: Sequence[BudgetPoint]) -> list[dict[str, Any]]:
    return [asdict(p) for p in points]


def as_curves(points: Sequence[BudgetPoint]) -> dict[str, Any]:
    """The points keyed for lookups (a results page's `{{num FILE curves.KEY.MODE.STEP.diff}}`):
    {"curves": {column: {mode: {step: point}}}, "answers": {column: {mode: trend}}}."""
    curves: dict[str, dict[str, dict[str, Any]]] = {}
    for p in points:
        curves.setdefault(p.key, {}).setdefault(p.mode, {})[str(p.step)] = asdict(p)
    found: dict[str, dict[str, str]] = {}
    for (key, mode), answer in answers(points).items():
        found.setdefault(key, {})[mode] = answer
    return {"curves": curves, "answers": found}
