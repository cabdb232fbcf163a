"""Two evaluation outputs compared query by query (eval/paired.py): the difference is that of the
outputs' own means, a real difference over queries is decided and a reshuffled one is not, keys pair
by prefix, and outputs evaluated on other queries are never paired."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from magclip.cli.paired import main
from magclip.experiments import stats
from magclip.experiments.paired import HIGHER, compare_outputs
from magclip.metrics.ranks import DIGEST_MARK, queries_path


def output(folder: Path, name: str, values: dict[str, np.ndarray], digest: str = "q300") -> Path:
    """An evaluation output: results JSON with the means, per-query values beside it."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({k: float(v.mean()) for k, v in values.items()}))
    arrays = {**values, **{k + DIGEST_MARK: np.asarray(digest) for k in values}}
    np.savez_compressed(queries_path(path), **arrays)
    return path


@pytest.fixture
def outputs(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.random(300)
    better = np.clip(base + 0.08 + 0.02 * rng.standard_normal(300), 0, 1)   # every query gains
    shuffled = base[rng.permutation(300)]                                     # same mean, no pairing
    a = output(tmp_path, "start", {"scifact.modes.cosine.ndcg@10": base, "scifact.modes.dot.ndcg@10": base})
    b = output(tmp_path, "trained", {"scifact.ndcg@10": better, "scifact.recall@100": shuffled})
    return a, b, base, better


def test_a_gain_on_every_query_is_decided_and_equals_the_outputs_means(outputs):
    a, b, base, better = outputs
    found, skipped = compare_outputs(a, b, "scifact.modes.cosine.", "scifact.", n_resamples=2000)
    assert [(m.base_key, m.row_key) for m in found] == [("scifact.modes.cosine.ndcg@10", "scifact.ndcg@10")]
    m = found[0]
    means = json.loads(b.read_text())["scifact.ndcg@10"] - json.loads(a.read_text())["scifact.modes.cosine.ndcg@10"]
    assert m.diff == pytest.approx(means) and m.n_queries == 300 and not skipped
    assert m.low > 0 and m.p < 0.05 and m.verdict == HIGHER
    boot = stats.bootstrap_ci((better - base)[None, :], n_resamples=2000)
    assert (m.low, m.high) == (pytest.approx(boot["low"]), pytest.approx(boot["high"]))


def test_the_same_values_in_another_order_are_not_a_difference(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.random(200)
    a = output(tmp_path, "a", {"m": x}, "d")
    b = output(tmp_path, "b", {"m": x[rng.permutation(200)]}, "d")
    (m,), _ = compare_outputs(a, b, n_resamples=1000)
    assert m.diff == pytest.approx(0, abs=1e-12) and m.low < 0 < m.high and m.verdict == stats.NO_DIFFERENCE


def test_other_queries_are_listed_not_paired(tmp_path):
    x = np.linspace(0, 1, 50)
    a = output(tmp_path, "a", {"m": x, "n": x}, "set-1")
    b = output(tmp_path, "b", {"m": x + 0.1, "n": x[:40]}, "set-2")
    found, skipped = compare_outputs(a, b, n_resamples=200)
    assert found == [] and len(skipped) == 2 and all("different queries" in s for s in skipped)
    with pytest.raises(ValueError, match="no per-query metric"):
        compare_outputs(a, b, "nope.", n_resamples=200)
    lonely = tmp_path / "lonely.json"
    lonely.write_text("{}")
    with pytest.raises(FileNotFoundError, match="lonely.queries.npz"):
        compare_outputs(lonely, b)


def test_the_command_prints_the_table_and_writes_the_records(outputs, tmp_path, capsys):
    a, b, *_ = outputs
    out = tmp_path / "paired.json"
    main([str(a), str(b), "--base-prefix", "scifact.modes.cosine.", "--row-prefix", "scifact.",
          "--resamples", "500", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| scifact.modes.cosine.ndcg@10 | scifact.ndcg@10 | 300 |" in printed and HIGHER in printed
    record = json.loads(out.read_text())
    assert record["paired"][0]["verdict"] == HIGHER and record["not_paired"] == []
    from magclip.experiments.collect import lookup  # what a results page's {{num}} reads
    assert lookup(record, "by_key.scifact.ndcg@10.diff") == record["paired"][0]["diff"]


def test_sts_pair_scores_are_paired_as_their_spearman_never_as_means(tmp_path):
    """An STS output keeps per-pair scores (pred_ab, pred_ba) and the gold: the paired number is the
    Spearman difference the evaluations report, and a rescaled copy of the scores (dot's scale against
    cosine's) is no difference at all, however far apart their means."""
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    gold = rng.uniform(0, 5, 400)
    good = gold + rng.normal(0, 1.0, 400)
    worse = gold + rng.normal(0, 3.0, 400)
    def sts(name, pred):
        return output(tmp_path, name, {"metrics.stsb/pred_ab": pred, "metrics.stsb/pred_ba": pred,
                                       "metrics.stsb/gold": gold})
    base, row, scaled = sts("worse", worse), sts("good", good), sts("good_x40", 40 * good + 7)
    found, skipped = compare_outputs(base, row)
    assert [m.base_key for m in found] == ["metrics.stsb/spearman"] and not skipped
    (m,) = found
    assert m.diff == pytest.approx(spearmanr(good, gold).statistic - spearmanr(worse, gold).statistic)
    assert m.verdict == HIGHER and m.low > 0 and m.n_queries == 400
    (same,), _ = compare_outputs(row, scaled)
    assert same.diff == pytest.approx(0) and same.verdict == stats.NO_DIFFERENCE
    other = output(tmp_path, "other_gold", {"metrics.stsb/pred_ab": good, "metrics.stsb/pred_ba": good,
                                            "metrics.stsb/gold": gold[::-1].copy()})
    found, skipped = compare_outputs(base, other)
    why = "metrics.stsb/spearman / metrics.stsb/spearman: scored on other pairs or against other gold scores"
    assert not found and skipped == [why]
