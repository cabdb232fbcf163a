"""A real text grid (2 modes × 2 seeds of a few steps): its report gives the text columns the paired
statistics the CLIP grids have — seed interval, query-level bootstrap (a correlation recomputed over
resampled pairs for STS), permutation p, MDE — refuses to pair runs evaluated on other queries, and
says what training moved (each run against the model it started from)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from builders import make_tiny_bert, toy_rows, write_toy_eval, write_toy_qa

from magclip.experiments import stats
from magclip.experiments.grid import load_grid
from magclip.experiments.report import write_report
from magclip.experiments.runner import run_grid
from magclip.metrics.ranks import DIGEST_MARK, queries_path

COLUMNS = ["metrics.toybeir/ndcg@10", "metrics.toysts/spearman", "metrics.toyqa/answer_recall@1"]


@pytest.fixture(scope="module")
def text_grid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("textgrid")
    rows = toy_rows(24, seed=5)
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    beir, sts = write_toy_eval(folder, rows[:16])
    grid = load_grid({
        "name": "tiny_text", "output_dir": str(folder / "runs"), "launcher": "text", "env": {"OMP_NUM_THREADS": "1"},
        "base": "configs/text/scifact.yaml",
        "overrides": {"model.name": str(make_tiny_bert(folder / "bert")), "model.query_max_length": 16,
                      "model.passage_max_length": 24, "data.train": str(folder / "pairs.jsonl"), "data.beir": None,
                      "train.batch_size": 4, "train.max_steps": 2, "train.lr": 1.0e-3, "train.warmup_steps": 0,
                      "eval.at_start": True, "eval.length_bins": 0, "eval.beir": {"toybeir": str(beir)},
                      "eval.sts": {"toysts": str(sts)}, "eval.rag": {"toyqa": str(write_toy_qa(folder, rows[:16]))}},
        "axes": {"loss": [{"name": "cosine", "set": {"loss.mode": "cosine"}},
                          {"name": "dnorm", "set": {"loss.mode": "dnorm"}}],
                 "seed": [0, 1]},
        "scale": 100, "columns": COLUMNS})
    assert run_grid(grid, jobs=2, echo=lambda s: None)["failed"] == []  # 2 cells at a time: one per core
    return grid


def test_text_columns_get_query_level_statistics(text_grid):
    out = write_report(text_grid, plots=False, n_resamples=500)
    comps = {c["column"]: c for c in out["comparisons"]}
    assert set(comps) == set(COLUMNS)
    for key, c in comps.items():
        assert c["labels"] == {"loss": "dnorm"} and c["n_seeds"] == 2 and c["items_unavailable"] is None, c
        assert c["seed_low"] is not None and c["n_items"] == {"metrics.toyqa/answer_recall@1": 15}.get(key, 16)
        assert c["item_low"] <= c["item_high"] and 0 < c["p_items"] <= 1
        assert c["verdict"] in (stats.BETTER, stats.WORSE, stats.NO_DIFFERENCE)
    # the toy retrieval saturates (both modes rank alike: a zero difference has no MDE); STS does not
    sts = comps[COLUMNS[1]]
    assert sts["item_low"] < sts["item_high"] and sts["mde"] is not None and sts["diff"] != 0
    # the seed-level difference is that of the results' numbers; the STS one recomputes Spearman per draw
    records = {r.cell: r for r in out["records"]}
    per_seed = [records[f"loss=dnorm,seed={s}"].values[COLUMNS[1]] - records[f"loss=cosine,seed={s}"].values[COLUMNS[1]]
                for s in (0, 1)]
    assert comps[COLUMNS[1]]["diff"] == pytest.approx(np.mean(per_seed))
    assert "correlation recomputed on each draw" in out["markdown"].read_text()


def test_runs_evaluated_on_other_queries_are_not_paired(text_grid, tmp_path):
    """One seed's nDCG values stand for another query set (their digest differs): that column loses its
    query-level interval, with the reason, and keeps the seed-level one; the others are untouched."""
    results = next(c for c in text_grid.cells() if c.name == "loss=dnorm,seed=1").results["main"]
    path = queries_path(results)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    key = "metrics.toybeir/ndcg@10" + DIGEST_MARK
    original = dict(arrays)
    arrays[key] = np.asarray("another query set")
    np.savez_compressed(path, **arrays)
    try:
        comps = {c["column"]: c for c in write_report(text_grid, plots=False, n_resamples=200)["comparisons"]}
    finally:
        np.savez_compressed(path, **original)
    c = comps["metrics.toybeir/ndcg@10"]
    assert c["items_unavailable"] == "the runs were evaluated on different items" and c["n_items"] == 0
    assert c["seed_low"] is not None
    assert comps["metrics.toysts/spearman"]["n_items"] == 16


def test_training_effects_pair_each_run_with_its_start(text_grid):
    """after − before per run is the results' own `metrics.K − zero_shot.K`; the query-level interval
    comes from the same queries evaluated twice; the report prints the section and a docs placeholder
    reads it."""
    from magclip.experiments.results_page import render

    out = write_report(text_grid, report=text_grid.output_dir / "report.md", plots=False, n_resamples=500)
    effects = {(e["labels"]["loss"], e["column"]): e for e in out["training_effects"]}
    assert set(effects) == {(loss, col) for loss in ("cosine", "dnorm") for col in COLUMNS}
    for (loss, col), e in effects.items():
        runs = [json.loads(c.results["main"].read_text()) for c in text_grid.cells() if c.values["loss"] == loss]
        key = col.removeprefix("metrics.")
        per_run = [r["metrics"][key] - r["zero_shot"][key] for r in runs]
        assert e["baseline"] == {"model": "zero_shot"} and e["n_seeds"] == 2
        assert e["diff"] == pytest.approx(np.mean(per_run)) and e["seed_sd"] == pytest.approx(np.std(per_run, ddof=1))
        assert e["before"] == pytest.approx(np.mean([r["zero_shot"][key] for r in runs]))
        assert e["n_items"] == {"metrics.toyqa/answer_recall@1": 15}.get(col, 16) and e["items_unavailable"] is None
        assert e["verdict"] in (stats.BETTER, stats.WORSE, stats.NO_DIFFERENCE)
    assert "### What training moved" in out["markdown"].read_text()
    e = effects[("dnorm", COLUMNS[1])]
    line = render("{{diff report.json loss=dnorm:before metrics.toysts/spearman x100 .2 short}}", text_grid.output_dir)
    assert line.startswith(f"{100 * e['diff']:+.2f}".replace("-", "−")) and e["verdict"] in line
    # what the query-level statistics resampled is named: STS pairs, retrieval queries
    assert "× 16 pairs)" in line and " points" in line
    # a number shown as it is (x1: Cohen's d, a correlation) is no percentage: no "points"
    unscaled = render("{{diff report.json loss=dnorm:before metrics.toysts/spearman x1 .3 short}}", text_grid.output_dir)
    assert unscaled.startswith(f"{e['diff']:+.3f}, 95 % CI [".replace("-", "−")) and "points" not in unscaled
    assert "× 16 queries)" in render("{{diff report.json loss=dnorm:loss=cosine metrics.toybeir/ndcg@10 x100 .2 short}}",
                                     text_grid.output_dir)
    assert "over pairs [" in render("{{diff report.json loss=dnorm:loss=cosine metrics.toysts/spearman x100 .2 line}}",
                                    text_grid.output_dir)


def test_contrasts_compare_other_pairs_of_rows_like_the_baseline(text_grid):
    """A grid's `contrasts` (here cosine − dnorm, the reverse of the baseline comparison) get the same
    paired statistics: the difference, the seed and query intervals mirrored, the same p; listed in
    their own table and read by the docs' placeholders like any comparison."""
    import dataclasses

    from magclip.experiments.results_page import render

    grid = dataclasses.replace(text_grid, contrasts=[({"loss": "cosine"}, {"loss": "dnorm"})])
    out = write_report(grid, report=grid.output_dir / "contrasts.md", plots=False, n_resamples=500)
    forward = {c["column"]: c for c in out["comparisons"] if c["baseline"] == {"loss": "cosine"}}
    reverse = {c["column"]: c for c in out["comparisons"] if c["baseline"] == {"loss": "dnorm"}}
    assert set(forward) == set(reverse) == set(COLUMNS)
    for key, c in reverse.items():
        f = forward[key]
        assert c["labels"] == {"loss": "cosine"} and c["n_seeds"] == 2 and c["n_items"] == f["n_items"]
        assert c["diff"] == pytest.approx(-f["diff"]) and c["seed_low"] == pytest.approx(-f["seed_high"])
        if f["item_low"] != f["item_high"]:   # a saturated toy metric has a zero-width interval either way
            assert c["p_items"] == pytest.approx(f["p_items"])
    md = out["markdown"].read_text()
    assert "### Other contrasts" in md and "| cosine | loss=dnorm |" in md
    line = render("{{diff contrasts.json loss=cosine:loss=dnorm metrics.toysts/spearman x100 .2 short}}", grid.output_dir)
    assert line.startswith(f"{100 * reverse[COLUMNS[1]]['diff']:+.2f}".replace("-", "−")) and "× 16 pairs)" in line
