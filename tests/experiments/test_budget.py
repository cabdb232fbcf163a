"""The budget curve (magclip.experiments.budget) on a tiny real text grid: two modes, one seed, evaluated
at the start and after steps 1 and 3. Each point is mode − baseline of the runs' own step evaluations
(the start's: zero_shot.json) with a query-level interval; the command writes the table, the answers and
the figure; `trend` reads curves as documented."""

from __future__ import annotations

import json
import math

import pytest
from builders import toy_text_grid

from magclip.cli.budget import main as budget_main
from magclip.experiments.budget import BudgetPoint, budget_points, step_files, trend
from magclip.experiments.grid import load_grid
from magclip.experiments.runner import run_grid

NDCG, STS = "metrics.toybeir/ndcg@10", "metrics.toysts/spearman"


@pytest.fixture(scope="module")
def long_grid(tmp_path_factory):
    modes = [{"name": "cosine", "set": {"loss.mode": "cosine"}}, {"name": "dot", "set": {"loss.mode": "dot"}}]
    path = toy_text_grid(tmp_path_factory.mktemp("budget"), "tiny_budget", {"loss": modes, "seed": [0]},
                         columns=[NDCG, STS], rows_seed=11, baseline={"loss": "cosine"},
                         **{"train.max_steps": 3, "train.val_at": [1], "eval.at_start": True})
    grid = load_grid(path)
    assert run_grid(grid, jobs=2, echo=lambda s: None)["failed"] == []
    return grid, path


def test_every_evaluated_step_is_paired_by_query(long_grid):
    grid, _ = long_grid
    points = budget_points(grid, n_resamples=300)
    assert sorted({(p.key, p.step) for p in points}) == [(k, step) for k in (NDCG, STS) for step in (0, 1, 3)]
    cells = {c.values["loss"]: c for c in grid.cells()}
    for p in points:
        where = "zero_shot" if p.step == 0 else "metrics"      # the start: the run's evaluation of its start
        base, row = (json.loads(step_files(cells[m].run_dir)[p.step].read_text())[where]
                     for m in ("cosine", "dot"))
        name = p.key.split(".", 1)[1]
        assert p.mode == "dot" and p.n_seeds == 1 and p.n_items == 16
        assert p.diff == pytest.approx(row[name] - base[name], abs=1e-9)
        assert p.low <= p.high and 0 < p.p <= 1


def test_the_command_writes_table_answers_and_figure(long_grid, tmp_path):
    _, path = long_grid
    report, figure, out = tmp_path / "budget.md", tmp_path / "budget.png", tmp_path / "budget.json"
    budget_main(["--grid", str(path), "--resamples", "200", "--report", str(report), "--figure", str(figure),
                 "--out", str(out)])
    text = report.read_text()
    assert "| val toybeir ndcg@10 | dot | 3 | 1 |" in text and "- val toysts spearman, dot − cosine:" in text
    assert "| val toybeir ndcg@10 | dot | 0 | 1 |" in text
    written = json.loads(out.read_text())
    assert figure.stat().st_size > 5000 and len(written["points"]) == 6
    at_3 = next(p for p in written["points"] if p["key"] == NDCG and p["step"] == 3)
    assert written["curves"][NDCG]["dot"]["3"] == at_3          # keyed for the results page's lookups
    assert written["answers"][NDCG]["dot"] == trend([BudgetPoint(**p) for p in written["points"] if p["key"] == NDCG])


def point(step, diff, low, high, decided=None):
    decided = (low > 0 or high < 0) if decided is None else decided
    return BudgetPoint("k", "dot", step, 1, 0.5, 0.5 + diff, diff, low, high, 0.01, 100, decided)


def test_a_metric_without_an_interval_is_not_called_undetected():
    """Cohen's d of document norms has no per-query outcomes: with one run per mode it has no interval,
    which the table and the answer say; the start (step 0) is not read as a budget."""
    pts = [point(0, -0.7, math.nan, math.nan, False), point(160, -0.8, math.nan, math.nan, False),
           point(1500, -0.3, math.nan, math.nan, False)]
    assert [p.gap for p in pts] == ["no interval"] * 3
    assert trend(pts) == ("no interval (one run per mode, no per-query outcomes): −0.8 after step 160, "
                          "−0.3 after step 1500")
    assert trend([point(0, -5, -7, -3), point(160, -5, -7, -3), point(500, -1, -3, 1)]).startswith("closes")


@pytest.mark.parametrize("curve, answer", [
    ([(160, -5, -7, -3), (500, -1, -3, 1)], "closes (no gap detected at the last budget)"),
    ([(160, -5, -7, -3), (500, -2, -4, -0.5), (1500, 2, 0.5, 3.5)], "crosses zero"),
    ([(160, -5, -7, -3), (500, -4, -6, -2), (1500, -4.2, -6, -2.4)], "levels off"),
    ([(160, -1, -3, 1), (1500, -4, -6, -2)], "opens"),
    ([(160, -1, -3, 1), (1500, 1, -1, 3)], "no gap detected at any budget"),
    ([(160, -5, -6, -4), (500, -3, -3.5, -2.5), (1500, -1, -1.4, -0.6)], "narrows"),
])
def test_trend_reads_a_curve_from_its_first_budget_to_its_last(curve, answer):
    assert trend([point(*c) for c in curve]) == answer
