"""The interaction of a grid's start axis with its mode axis: does a fine-tuning mode's gain over the
baseline mode depend on the model it started from?

    I = (mode − baseline mode | start) − (mode − baseline mode | baseline start)

The paper's condition for magnitude (its QNorm gains come from Contriever, pretrained with a dot
product): the gain of qnorm or dnorm over cosine should be larger from a start whose geometry already
uses the norm (a dot-trained retriever) than from a cosine-trained one, I > 0.

I is formed per seed and per query from the four runs of that seed (same seed, the two starts x the
two modes), which must have been evaluated on the same queries (the digest every per-query array
carries): runs on other query sets are refused, never paired. Its statistics are those of every grid
comparison (magclip.experiments.stats.compare): the paired t interval over seeds, the query bootstrap
over the same seeds, the sign-flip permutation p, the MDE. A number with no per-query values (a
correlation over pairs, STS) gets the seed-level interval from the results' numbers alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from magclip.config import flatten
from magclip.experiments import stats
from magclip.experiments.grid import Grid
from magclip.experiments.report import format_p, interval, signed
from magclip.metrics.ranks import DIGEST_MARK, load_query_values, queries_path

LARGER, SMALLER = "larger gain from this start", "smaller gain from this start"
RunKey = tuple[str, str, str]        # (start, mode, seed) value names


@dataclass
class RunOutcomes:
    """One run's numbers (results.json flattened: `metrics.scifact/ndcg@10`) and per-query values."""

    name: str
    numbers: dict[str, Any]
    values: dict[str, Any]


@dataclass
class Interaction:
    key: str
    start: str
    mode: str
    gap_at_start: float           # mean over seeds of mode − baseline mode from `start`
    gap_at_baseline_start: float
    comparison: stats.Comparison  # of I (higher_is_better as the metric)
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "start": self.start, "mode": self.mode, "gap_at_start": self.gap_at_start,
                "gap_at_baseline_start": self.gap_at_baseline_start,
                **self.comparison.to_dict(), "verdict": self.verdict}   # the interaction's wording, not better/worse


def read_run(name: str, results: str | Path) -> RunOutcomes:
    """A finished run's results.json and the per-query values beside it."""
    results = Path(results)
    values = load_query_values(queries_path(results)) if queries_path(results).is_file() else {}
    return RunOutcomes(name, flatten(json.loads(results.read_text())), values)


def grid_runs(grid: Grid, start_axis: str, mode_axis: str, seed_axis: str = "seed") -> dict[RunKey, RunOutcomes]:
    """The finished cells of `grid` by (start, mode, seed); a cell without results is left out."""
    runs = {}
    for cell in grid.cells():
        results = next(iter(cell.results.values()))
        if cell.finished and results.is_file():
            key = (cell.values[start_axis], cell.values[mode_axis], cell.values.get(seed_axis, "0"))
            runs[key] = read_run(cell.name, results)
    return runs


def interaction(runs: Mapping[RunKey, RunOutcomes], key: str, *, start: str, baseline_start: str, mode: str,
                baseline_mode: str, higher_is_better: bool = True, n_resamples: int = stats.N_RESAMPLES
                ) -> Interaction:
    """I for metric `key` over every seed that has all four runs (ValueError with none, or where the
    four runs of a seed, or two seeds, were evaluated on different queries)."""
    corners = [(start, mode), (start, baseline_mode), (baseline_start, mode), (baseline_start, baseline_mode)]
    seeds = sorted({s for (_, _, s) in runs if all((a, m, s) in runs for a, m in corners)}, key=_seed_order)
    if not seeds:
        raise ValueError(f"no seed has the four runs {corners} (have: {sorted(runs)})")
    per_query = all(key in runs[(a, m, s)].values for a, m in corners for s in seeds)
    numbers = np.array([[_number(runs[(a, m, s)], key) for a, m in corners] for s in seeds])
    gaps = numbers[:, [0, 2]] - numbers[:, [1, 3]]
    item_diffs = None
    if per_query:
        digests = {(a, m, s): runs[(a, m, s)].values.get(key + DIGEST_MARK) for a, m in corners for s in seeds}
        if len(set(digests.values())) > 1:
            listed = ", ".join(f"{runs[k].name}: {d}" for k, d in digests.items())
            raise ValueError(f"{key}: the runs were evaluated on different queries (digests {listed}); "
                             "an interaction pairs the same queries only")
        v = np.array([[np.asarray(runs[(a, m, s)].values[key], dtype=np.float64) for a, m in corners] for s in seeds])
        item_diffs = (v[:, 0] - v[:, 1]) - (v[:, 2] - v[:, 3])                       # [seeds, queries]
    per_seed = item_diffs.mean(axis=1) if item_diffs is not None else gaps[:, 0] - gaps[:, 1]
    comparison = stats.compare(per_seed, item_diffs, higher_is_better=higher_is_better, n_resamples=n_resamples)
    verdict = {stats.BETTER: LARGER, stats.WORSE: SMALLER}.get(comparison.verdict, comparison.verdict)
    return Interaction(key, start, mode, float(gaps[:, 0].mean()), float(gaps[:, 1].mean()), comparison, verdict)


def _number(run: RunOutcomes, key: str) -> float:
    value = run.values.get(key)
    if value is not None:
        return float(np.mean(value))      # the results' number is this mean
    number = run.numbers.get(key)
    if isinstance(number, (int, float)):
        return float(number)
    raise ValueError(f"{run.name}: no number {key!r} in its results (numbers there: "
                     + ", ".join(k for k in list(run.numbers)[:8]) + ", ...)")


def _seed_order(seed: str) -> tuple[float, str]:
    return (int(seed), "") if seed.lstrip("-").isdigit() else (math.inf, seed)


def markdown_table(found: Sequence[Interaction], scales: Mapping[str, float] | None = None,
                   labels: Mapping[str, str] | None = None, digits: int = 2) -> str:
    """One row per interaction; each metric in its column's scale (×100 for a 0–1 metric, ×1 for Cohen's d)."""
    lines = [("| metric | mode | start | gap from this start | gap from the baseline start | I | 95 % CI (seeds) "
              "| 95 % CI (queries) | p (queries) | MDE (80 % power) | seeds | verdict |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in found:
        c, scale = x.comparison, (scales or {}).get(x.key, 100.0)
        item = _ci(c.item_low, c.item_high, scale, digits) if c.n_items else "–"
        lines.append(f"| {(labels or {}).get(x.key, x.key)} | {x.mode} | {x.start} | {signed(x.gap_at_start, scale, digits)} "
                     f"| {signed(x.gap_at_baseline_start, scale, digits)} | {signed(c.diff, scale, digits)} "
                     f"| {_ci(c.seed_low, c.seed_high, scale, digits)} | {item} "
                     f"| {format_p(c.p_items) if c.n_items else '–'} "
                     f"| {'–' if math.isnan(c.mde) else signed(c.mde, scale, digits).lstrip('+')} | {c.n_seeds} "
                     f"| {x.verdict} |")
    return "\n".join(lines)


def _ci(low: float, high: float, scale: float, digits: int) -> str:
    return "–" if math.isnan(low) or math.isnan(high) else interval(low, high, scale, digits)


def as_lookup(found: Sequence[Interaction]) -> dict[str, Any]:
    """The records keyed for a results page's `{{num FILE by_key.KEY.START.MODE.diff}}`."""
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for x in found:
        by_key.setdefault(x.key, {}).setdefault(x.start, {})[x.mode] = x.to_dict()
    return by_key


def plot_interaction(found: Sequence[Interaction], path: str | Path, labels: Mapping[str, str] | None = None,
                     scales: Mapping[str, float] | None = None) -> Path | None:
    """One panel per metric: each mode's gain over the baseline mode from the baseline start and from
    the other start (seed means), and I with its 95 % interval (over queries where the metric has
    per-query values, else over seeds), so the figure shows what the table's verdict rests on."""
    from magclip.diagnostics.plots import panels, save_figure

    keys = list(dict.fromkeys(x.key for x in found))
    if not keys:
        return None
    fig, axes = panels(len(keys))
    for ax, key in zip(axes, keys):
        shown, scale = [x for x in found if x.key == key], (scales or {}).get(key, 100.0)
        at = np.arange(len(shown), dtype=np.float64)
        ax.scatter(at - 0.2, [x.gap_at_baseline_start * scale for x in shown], marker="o", color="tab:grey",
                   label="mode − baseline mode, baseline start")
        ax.scatter(at, [x.gap_at_start * scale for x in shown], marker="^", color="tab:blue",
                   label="mode − baseline mode, this start")
        for i, x in enumerate(shown):
            c = x.comparison
            low, high = (c.item_low, c.item_high) if c.n_items else (c.seed_low, c.seed_high)
            err = None if math.isnan(low) else [[(c.diff - low) * scale], [(high - c.diff) * scale]]
            ax.errorbar([i + 0.2], [c.diff * scale], yerr=err, marker="s", color="tab:red", capsize=3, ls="none",
                        label="I (95 % CI)" if i == 0 else None)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlim(-0.6, len(shown) - 0.4)
        ax.set_xticks(at, [f"{x.mode}\n{x.start} start" for x in shown], fontsize=7)
        ax.set_title((labels or {}).get(key, key), fontsize=9)
        ax.set_ylabel(f"×{scale:g}" if scale != 1 else "")
        ax.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path)


__all__ = ["LARGER", "SMALLER", "Interaction", "RunOutcomes", "as_lookup", "grid_runs", "interaction",
           "markdown_table", "plot_interaction", "read_run"]
