"""The start x mode interaction (magclip.experiments.interaction) on a tiny real grid: two starting
models x two fine-tuning modes x two seeds of a few steps. It yields an interval and a verdict, equals
the difference of differences of the runs' own numbers, and refuses runs evaluated on other queries."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import make_tiny_bert, toy_text_grid

from magclip.cli.interaction import main as interaction_main
from magclip.experiments import stats
from magclip.experiments.grid import default_label, load_grid
from magclip.experiments.interaction import LARGER, SMALLER, grid_runs, interaction
from magclip.experiments.runner import run_grid
from magclip.metrics.ranks import DIGEST_MARK

NDCG = "metrics.toybeir/ndcg@10"
MODES = [{"name": "cosine", "set": {"loss.mode": "cosine"}}, {"name": "dnorm", "set": {"loss.mode": "dnorm"}}]


@pytest.fixture(scope="module")
def geometry_grid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("geometry")
    starts = [{"name": name, "set": {"model.name": str(make_tiny_bert(folder / name, seed=seed))}}
              for name, seed in (("cosine_start", 0), ("dot_start", 1))]
    path = toy_text_grid(folder, "tiny_geometry", {"start": starts, "loss": MODES, "seed": [0, 1]},
                         columns=[NDCG, "metrics.toysts/spearman"], rows_seed=7, model=starts[0]["set"]["model.name"])
    grid = load_grid(path)
    assert run_grid(grid, jobs=2, echo=lambda s: None)["failed"] == []
    return grid, path


def test_the_interaction_has_an_interval_and_a_verdict(geometry_grid):
    grid, _ = geometry_grid
    runs = grid_runs(grid, "start", "loss")
    assert len(runs) == 8
    found = interaction(runs, NDCG, start="dot_start", baseline_start="cosine_start", mode="dnorm",
                        baseline_mode="cosine", n_resamples=500)
    c = found.comparison
    assert c.n_seeds == 2 and c.n_items == 16 and not np.isnan(c.seed_low) and c.item_low <= c.item_high
    assert found.verdict in (LARGER, SMALLER, stats.NO_DIFFERENCE)
    # I is the difference of differences of the runs' own numbers, seed by seed
    n = {(a, m, s): runs[(a, m, s)].numbers[NDCG] for (a, m, s) in runs}
    by_seed = [(n[("dot_start", "dnorm", s)] - n[("dot_start", "cosine", s)])
               - (n[("cosine_start", "dnorm", s)] - n[("cosine_start", "cosine", s)]) for s in ("0", "1")]
    assert c.diff == pytest.approx(np.mean(by_seed), abs=1e-9)
    # a correlation has no per-query values: the seed-level interaction of the results' numbers
    sts = interaction(runs, "metrics.toysts/spearman", start="dot_start", baseline_start="cosine_start",
                      mode="dnorm", baseline_mode="cosine", n_resamples=200)
    assert sts.comparison.n_items == 0 and sts.comparison.n_seeds == 2


def test_runs_evaluated_on_other_queries_are_refused(geometry_grid):
    grid, _ = geometry_grid
    runs = grid_runs(grid, "start", "loss")
    runs[("dot_start", "dnorm", "1")].values[NDCG + DIGEST_MARK] = "another query set"
    with pytest.raises(ValueError, match="evaluated on different queries"):
        interaction(runs, NDCG, start="dot_start", baseline_start="cosine_start", mode="dnorm",
                    baseline_mode="cosine", n_resamples=100)


def test_the_command_writes_the_table(geometry_grid, tmp_path):
    _, path = geometry_grid
    report, out, figure = tmp_path / "interaction.md", tmp_path / "interaction.json", tmp_path / "interaction.png"
    interaction_main(["--grid", str(path), "--baseline-start", "cosine_start", "--resamples", "200",
                      "--report", str(report), "--out", str(out), "--figure", str(figure)])
    written = json.loads(out.read_text())
    records = written["records"]
    assert written["by_key"][NDCG]["dot_start"]["dnorm"] == records[0]
    assert records[0]["verdict"] in (LARGER, SMALLER, stats.NO_DIFFERENCE)   # the interaction's wording
    assert figure.stat().st_size > 10_000 and figure.read_bytes()[:4] == b"\x89PNG"
    assert [(r["key"], r["start"], r["mode"]) for r in records] == [
        (NDCG, "dot_start", "dnorm"), ("metrics.toysts/spearman", "dot_start", "dnorm")]
    assert f"| {default_label(NDCG)} | dnorm | dot_start |" in report.read_text()   # the column's label
