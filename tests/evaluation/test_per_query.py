"""Per-query outcomes of the text evaluators, kept beside each results file (<stem>.queries.npz):
BEIR's per-query metrics reproduce pytrec_eval's aggregate, STS's per-pair scores reproduce the
reported correlations, RAG's per-question hits their recall, and zero-shot keeps its ranks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import pytrec_eval
from scipy.stats import spearmanr

from builders import make_tiny_bert, toy_rows, write_toy_eval, write_toy_qa
from magclip.cli import beir as eval_beir
from magclip.cli import rag as eval_rag
from magclip.cli import sts as eval_sts
from magclip.experiments.stats import compare, correlation_item_stats
from magclip.metrics.ir import DEFAULT_METRICS, parse_metric
from magclip.metrics.ranks import DIGEST_MARK, load_query_values, queries_path


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    rows = toy_rows(30, seed=3)
    beir, sts = write_toy_eval(folder, rows)
    with open(beir / "qrels" / "test.tsv", "a") as f:  # graded and several relevant documents: nDCG is not R@1
        f.write("q0\td1\t2\nq0\td2\t1\nq3\td7\t1\n")
    return {"model": str(make_tiny_bert(folder / "bert")), "beir": beir, "sts": sts,
            "qa": write_toy_qa(folder, rows[:20])}


def test_beir_per_query_values_average_to_pytrec_evals_aggregate(toy, tmp_path):
    out = tmp_path / "beir.json"
    eval_beir.main(["--model", toy["model"], "--data", str(toy["beir"]), "--mode", "cosine", "qnorm",
                    "--out", str(out)])
    results = json.loads(out.read_text())["toybeir"]
    values = load_query_values(queries_path(out))
    assert queries_path(out) == tmp_path / "beir.queries.npz"
    for label in ("cosine", "qnorm"):
        entry = results["modes"][label]
        for metric in DEFAULT_METRICS:
            per = values[f"toybeir.modes.{label}.{metric}"]
            assert len(per) == entry["evaluated_queries"] == 30
            assert float(np.mean(per)) == entry[metric]  # exactly: the reported mean is the mean of these
            family, k = parse_metric(metric)
            if family != "mrr":  # pytrec_eval's own aggregate of the same per-query values
                measure = {"ndcg": "ndcg_cut", "recall": "recall", "map": "map_cut"}[family]
                assert pytrec_eval.compute_aggregated_measure(f"{measure}_{k}", list(per)) == pytest.approx(
                    entry[metric], abs=1e-12)
    # the first mode's values also sit at the entry's top level; every array names the same queries
    assert np.array_equal(values["toybeir.ndcg@10"], values["toybeir.modes.cosine.ndcg@10"])
    assert not np.array_equal(values["toybeir.modes.cosine.ndcg@10"], values["toybeir.modes.qnorm.ndcg@10"])
    assert len({v for k, v in values.items() if k.endswith(DIGEST_MARK)}) == 1


def test_sts_per_pair_scores_reproduce_the_reported_spearman(toy, tmp_path):
    out = tmp_path / "sts.json"
    eval_sts.main(["--model", toy["model"], "--data", str(toy["sts"]), "--mode", "dnorm", "--out", str(out)])
    entry = json.loads(out.read_text())["toysts"]
    values = load_query_values(queries_path(out))
    ab, ba, gold = (values[f"toysts.{k}"] for k in ("pred_ab", "pred_ba", "gold"))
    assert len(gold) == entry["pairs"] == 30 and not np.allclose(ab, ba)  # dnorm is asymmetric
    assert spearmanr((ab + ba) / 2, gold).statistic == pytest.approx(entry["spearman"], abs=1e-12)
    assert spearmanr(ab, gold).statistic == pytest.approx(entry["spearman_ab"], abs=1e-12)
    assert spearmanr(ba, gold).statistic == pytest.approx(entry["spearman_ba"], abs=1e-12)


def test_rag_per_question_hits_average_to_the_recall(toy, tmp_path):
    out = tmp_path / "rag.json"
    eval_rag.main(["--model", toy["model"], "--data", str(toy["qa"]), "--out", str(out)])
    entry = json.loads(out.read_text())["toyqa"]
    values = load_query_values(queries_path(out))
    for k in (1, 5, 20):
        hits = values[f"toyqa.answer_recall@{k}"]
        assert len(hits) == entry["questions"] == 19 and set(np.unique(hits)) <= {0.0, 1.0}  # 1 has no answer
        assert float(np.mean(hits)) == pytest.approx(entry[f"answer_recall@{k}"], abs=1e-15)
    assert float(np.mean(values["toyqa.gold_passage_acc@1"])) == pytest.approx(entry["gold_passage_acc@1"])


def test_a_correlation_difference_is_bootstrapped_over_pairs():
    rng = np.random.default_rng(0)
    gold = rng.normal(size=300)
    good = np.stack([gold + rng.normal(scale=0.5, size=300) for _ in range(3)])   # 3 seeds of a better model
    poor = np.stack([gold + rng.normal(scale=1.5, size=300) for _ in range(3)])
    found = correlation_item_stats(gold, poor, good, "spearman", n_resamples=2000)
    observed = np.mean([spearmanr(g, gold).statistic - spearmanr(p, gold).statistic for g, p in zip(good, poor)])
    assert found.n_items == 300 and found.low < observed < found.high and found.low > 0 and found.p < 0.01
    same = correlation_item_stats(gold, poor, poor, "spearman", n_resamples=500)
    assert same.low == same.high == 0 and same.p == 1.0                  # a model against itself
    flipped = correlation_item_stats(gold, good, poor, "pearson", n_resamples=2000)
    assert flipped.high < 0
    cmp = compare([observed] * 2 + [observed * 0.9], item_stats=found)
    assert cmp.verdict == "better" and cmp.n_items == 300 and math.isclose(cmp.item_low, found.low)
    with pytest.raises(ValueError, match="for 299 gold scores"):
        correlation_item_stats(gold[:-1], poor, good)


@pytest.mark.parametrize("method", ["spearman", "pearson"])
def test_the_permutation_test_of_a_correlation_ignores_each_models_score_scale(method):
    """Two scoring modes score on different scales (cosine in [-1, 1], dot unbounded): the correlations,
    and so the test, must not depend on it. Swapping raw scores mixed the scales and inflated p."""
    rng = np.random.default_rng(1)
    gold = rng.normal(size=400)
    good = np.stack([gold + rng.normal(scale=0.85, size=400) for _ in range(3)])  # a small gain: p mid-range
    poor = np.stack([gold + rng.normal(scale=1.0, size=400) for _ in range(3)])
    plain = correlation_item_stats(gold, poor, good, method, n_resamples=2000)
    rescaled = correlation_item_stats(gold, poor, 50 * good + 7, method, n_resamples=2000)  # another scale, same ranks
    assert rescaled.p == plain.p and rescaled.low == pytest.approx(plain.low)
