"""The compare report's paired comparisons (per-seed and per-query, from the runs' ranks files), the
rows and comparisons JSON that docs/results.md reads, and the refusal to replace a richer report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from magclip.experiments import stats
from magclip.experiments.grid import GridError, load_grid
from magclip.experiments.collect import comparisons, per_query_outcomes
from magclip.experiments.report import write_report
from magclip.experiments.results_page import render
from magclip.metrics.retrieval import ranks_path, save_ranks

ROOT = Path(__file__).resolve().parents[2]
N_ITEMS = 120


def spec(out: Path, **extra) -> dict:
    return {"name": "paired", "output_dir": str(out), "base": "configs/clip/default.yaml",
            "axes": {"loss": [{"name": "cosine", "set": {"loss.i2t": "cosine"}},
                              {"name": "qnorm", "set": {"loss.i2t": "qnorm"}},
                              {"name": "dot", "set": {"loss.i2t": "dot"}}], "seed": [0, 1, 2]},
            "scale": 100, "baseline": {"loss": "cosine"},
            "columns": ["val.image_to_text_R@1", "val.image_to_text_R@5",
                        {"key": "val.image_to_text_mean_rank", "better": "min", "scale": 1},
                        {"key": "wall_time_s", "better": "none", "scale": 1}], **extra}


def finish(cell, ranks: np.ndarray | None, digest: str = "same") -> None:
    """A finished cell: results.json with the aggregates of `ranks` (+ the ranks file unless None)."""
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    metrics = {"image_to_text_R@1": float(np.mean(ranks < 1)), "image_to_text_R@5": float(np.mean(ranks < 5)),
               "image_to_text_mean_rank": float(ranks.mean() + 1)}
    (cell.run_dir / "results.json").write_text(json.dumps({"metrics": metrics, "wall_time_s": 1.0}))
    if digest is not None:
        save_ranks(ranks_path(cell.run_dir / "results.json"), {"metrics": {"image_to_text": ranks, "items": digest}})


def grid_with_runs(tmp_path: Path, with_ranks: bool = True):
    """cosine: every query at rank 2 or 0; qnorm: 30 more queries at rank 0 in every seed (better);
    dot: the same R@1 as cosine, some queries swapped (no difference)."""
    grid = load_grid(spec(tmp_path / "out"))
    rng = np.random.default_rng(0)
    cells = {c.name: c for c in grid.cells()}
    for seed in range(3):
        base = np.where(rng.random(N_ITEMS) < 0.4, 0, 2 + rng.integers(0, 8, N_ITEMS))
        better = base.copy()
        better[np.flatnonzero(base > 0)[:30 + seed]] = 0
        swapped = base.copy()
        hit, miss = np.flatnonzero(base == 0)[:5], np.flatnonzero(base > 0)[:5]
        swapped[hit], swapped[miss] = 3, 0
        for name, ranks in (("cosine", base), ("qnorm", better), ("dot", swapped)):
            finish(cells[f"loss={name},seed={seed}"], ranks, "same" if with_ranks else None)
    return grid


def test_every_row_against_the_baseline_per_seed_and_per_query(tmp_path):
    grid = grid_with_runs(tmp_path)
    written = write_report(grid, report=tmp_path / "docs" / "r.md", plots=False, n_resamples=2000)
    comps = {(c["labels"]["loss"], c["column"]): c for c in written["comparisons"]}
    assert set(comps) == {(row, col) for row in ("qnorm", "dot") for col in
                          ("val.image_to_text_R@1", "val.image_to_text_R@5", "val.image_to_text_mean_rank")}
    q = comps["qnorm", "val.image_to_text_R@1"]
    assert q["n_seeds"] == 3 and q["n_items"] == N_ITEMS and q["seeds"] == [["0"], ["1"], ["2"]]
    assert q["diff"] == pytest.approx(np.mean([(30 + s) / N_ITEMS for s in range(3)]))
    assert q["verdict"] == stats.BETTER and q["seed_low"] > 0 and q["item_low"] > 0 and q["p_items"] < 0.001
    assert comps["qnorm", "val.image_to_text_mean_rank"]["verdict"] == stats.BETTER   # lower rank: better
    d = comps["dot", "val.image_to_text_R@1"]
    assert d["diff"] == 0 and d["verdict"] == stats.NO_DIFFERENCE and d["mde"] > 0
    # the report says it, with both intervals
    md = (tmp_path / "docs" / "r.md").read_text()
    assert "### Differences to the baseline" in md and "| qnorm | val i→t R@1 | 3 | +25.83 |" in md
    assert "**better**" in md and "95 % CI (queries)" in md and "Query-level statistics unavailable" not in md
    # the JSON beside it: rows, each cell's values, the comparisons; the page renders a statement
    side = json.loads((tmp_path / "docs" / "r.json").read_text())
    assert side["baseline"] == {"loss": "cosine"} and len(side["cells"]) == 9 and side["comparisons"]
    line = render("{{diff docs/r.json loss=qnorm:loss=cosine val.image_to_text_R@1 x100 .1}}", tmp_path)
    assert line.startswith("+25.8 points, 95 % CI [") and "(3 seeds, paired); over queries [" in line
    assert line.endswith(f"({N_ITEMS} queries × 3 seeds) → better")
    assert render("{{diff docs/r.json loss=dot:loss=cosine val.image_to_text_R@1 x100 .1 verdict}}",
                  tmp_path) == stats.NO_DIFFERENCE


def test_per_query_outcomes_follow_the_column(tmp_path):
    grid = grid_with_runs(tmp_path)
    cell = grid.cells()[0]
    results = cell.run_dir / "results.json"
    cols = {c.key: c for c in grid.columns}
    r1, digest = per_query_outcomes(cols["val.image_to_text_R@1"], results)
    r5, _ = per_query_outcomes(cols["val.image_to_text_R@5"], results)
    mean_rank, _ = per_query_outcomes(cols["val.image_to_text_mean_rank"], results)
    saved = json.loads(results.read_text())["metrics"]
    assert digest == "same" and r1.mean() == saved["image_to_text_R@1"] and r5.mean() == saved["image_to_text_R@5"]
    assert mean_rank.mean() == pytest.approx(saved["image_to_text_mean_rank"])
    assert per_query_outcomes(cols["wall_time_s"], results) == "not a per-query metric"


def test_old_runs_without_ranks_get_the_seed_level_interval_only(tmp_path):
    grid = grid_with_runs(tmp_path, with_ranks=False)
    written = write_report(grid, plots=False, n_resamples=500)
    q = next(c for c in written["comparisons"] if c["labels"]["loss"] == "qnorm")
    assert q["n_items"] == 0 and q["item_low"] is None and q["seed_low"] > 0 and q["verdict"] == stats.BETTER
    assert "no per-query ranks" in q["items_unavailable"]
    md = (grid.output_dir / "compare.md").read_text()
    assert "Query-level statistics unavailable for some comparisons: no per-query ranks" in md


def test_runs_on_other_items_are_not_paired_per_query(tmp_path):
    grid = grid_with_runs(tmp_path)
    cell = next(c for c in grid.cells() if c.name == "loss=qnorm,seed=1")
    finish(cell, np.zeros(N_ITEMS, dtype=int), digest="other")
    comps = comparisons(grid, *_records_rows(grid))
    q = next(c for c in comps if c["labels"]["loss"] == "qnorm" and c["column"] == "val.image_to_text_R@1")
    assert q["items_unavailable"] == "the runs were evaluated on different items" and q["n_items"] == 0


def _records_rows(grid):
    from magclip.experiments.collect import collect, summarize

    records = collect(grid)
    return records, summarize(grid, records)


def test_unpaired_seeds_are_left_out_and_baseline_is_checked(tmp_path):
    grid = grid_with_runs(tmp_path)
    (next(c for c in grid.cells() if c.name == "loss=cosine,seed=2").run_dir / "results.json").unlink()
    comps = comparisons(grid, *_records_rows(grid), n_resamples=200)
    assert {c["n_seeds"] for c in comps} == {2} and all(c["seeds"] == [["0"], ["1"]] for c in comps)
    with pytest.raises(GridError, match="axis 'loss' has no value 'cos'"):
        load_grid(spec(tmp_path, baseline={"loss": "cos"}))
    with pytest.raises(GridError, match="not a tabulated axis"):
        load_grid(spec(tmp_path, baseline={"loss": "cosine", "seed": "0"}))
    assert load_grid(spec(tmp_path, baseline="qnorm")).baseline == {"loss": "qnorm"}


def test_page_pairs_rows_the_report_did_not_compare_from_the_cells(tmp_path):
    """dot − qnorm is not a report comparison (the baseline is cosine): the page pairs the two rows
    by seed from the per-cell values kept beside the report (seed level only)."""
    grid = grid_with_runs(tmp_path)
    write_report(grid, report=tmp_path / "docs" / "r.md", plots=False, n_resamples=200)
    cells = {c["cell"]: c["values"]["val.image_to_text_R@1"]
             for c in json.loads((tmp_path / "docs" / "r.json").read_text())["cells"]}
    per_seed = [cells[f"loss=dot,seed={s}"] - cells[f"loss=qnorm,seed={s}"] for s in range(3)]
    expected = stats.compare(per_seed)
    got = render("{{diff docs/r.json loss=dot:loss=qnorm val.image_to_text_R@1 x100 .2 short}}", tmp_path)
    assert got == (f"{100 * expected.diff:+.2f} points, 95 % CI [{100 * expected.seed_low:.2f}, "
                   f"{100 * expected.seed_high:.2f}] (3 seeds) → {stats.WORSE}").replace("-", "−")


def test_a_column_with_no_better_side_is_tested_with_a_direction(tmp_path):
    """`better: diff` (an effect size such as Cohen's d): compared with the baseline, the verdict says
    higher/lower, never better/worse, and no row is bold; `none` stays untested."""
    grid = load_grid(spec(tmp_path / "out", columns=[{"key": "metrics.d", "better": "diff", "scale": 1},
                                                     {"key": "metrics.e", "better": "none", "scale": 1}]))
    for cell in grid.cells():
        cell.run_dir.mkdir(parents=True, exist_ok=True)
        seed, loss = int(cell.values["seed"]), cell.values["loss"]
        d = {"cosine": 0.1, "qnorm": 0.5, "dot": 0.1}[loss] + 0.01 * seed + (0.02 * seed if loss == "dot" else 0)
        (cell.run_dir / "results.json").write_text(json.dumps({"metrics": {"d": d, "e": d}}))
    out = write_report(grid, plots=False, n_resamples=200)
    comps = {c["labels"]["loss"]: c for c in out["comparisons"]}
    assert {c["column"] for c in out["comparisons"]} == {"metrics.d"}
    assert comps["qnorm"]["verdict"] == stats.HIGHER and comps["qnorm"]["diff"] == pytest.approx(0.4)
    assert comps["dot"]["verdict"] == stats.NO_DIFFERENCE
    assert not any(r.best["metrics.d"] for r in out["rows"])
    assert f"**{stats.HIGHER}**" in out["markdown"].read_text()
