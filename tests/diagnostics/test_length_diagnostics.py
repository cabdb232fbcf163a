"""Length confounds (magclip.diagnostics.length): correlations against a hand rank computation,
within-bin Cohen's d against the textbook d on each bin, the stratified metric against the plain one,
and a constructed confound where the plain d is all length and the within-bin d is not."""

import numpy as np
import pytest
import torch

from magclip.diagnostics import length as L
from magclip.diagnostics.magnitude import cohens_d
from magclip.evaluation.text import retrieve
from magclip.metrics.ir import evaluate_run


def ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), by hand."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def test_length_correlation_is_pearson_of_ranks():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, 200)
    lengths[:20] = 50  # ties
    norms = 10 / np.sqrt(lengths) + rng.normal(0, 0.05, 200)
    got = L.length_correlation(norms, lengths)
    want = np.corrcoef(ranks(norms), ranks(lengths.astype(float)))[0, 1]
    assert got["spearman"] == pytest.approx(want, abs=1e-12) and got["spearman"] < -0.8 and got["n"] == 200
    vecs = torch.randn(200, 8) * torch.tensor(norms, dtype=torch.float32)[:, None] / torch.randn(200, 8).norm(dim=1, keepdim=True)
    assert L.length_correlation(vecs, lengths)["n"] == 200  # 2-D input: row norms
    assert np.isnan(L.length_correlation([1.0, 1.0, 1.0], [1, 2, 3])["spearman"])
    with pytest.raises(ValueError, match="lengths"):
        L.length_correlation([1.0, 2.0], [1, 2, 3])


def test_quantile_bins_never_split_ties():
    v = np.array([1, 1, 1, 1, 2, 3, 4, 5])
    edges = L.quantile_edges(v, 4)
    bins = L.assign_bins(v, edges)
    assert len(set(bins[v == 1])) == 1
    assert L.quantile_edges(v, 1).size == 0 and (L.assign_bins(v, L.quantile_edges(v, 1)) == 0).all()
    with pytest.raises(ValueError):
        L.quantile_edges(v, 0)


def test_within_bin_d_equals_textbook_d_per_bin_and_removes_a_pure_length_effect():
    rng = np.random.default_rng(1)
    # relevant documents are short, and the norm depends on length only: all of the plain d is length
    # (four distinct lengths, so each bin holds one length and nothing of the confound is left in it)
    la = rng.choice([20, 50], 400)
    lb = rng.choice([20, 50, 100, 200], 4000)
    norm = lambda n: 20 / np.sqrt(n) + rng.normal(0, 0.2, n.size)  # noqa: E731
    a, b = norm(la), norm(lb)
    r = L.within_bin_cohens_d(a, la, b, lb, n_bins=4)
    assert r["d_plain"] == pytest.approx(cohens_d(a, b)) and r["d_plain"] > 0.5
    assert abs(r["d_within"]) < 0.1 and len(r["bins"]) == 4
    edges = L.quantile_edges(np.concatenate([la, lb]), 4)
    for i, entry in enumerate(r["bins"]):
        ia, ib = L.assign_bins(la, edges) == i, L.assign_bins(lb, edges) == i
        assert entry["n_a"] == ia.sum() and entry["n_b"] == ib.sum()
        if entry["n_a"] and entry["n_b"]:
            assert entry["d"] == pytest.approx(cohens_d(a[ia], b[ib]))
    # a real relevance signal at fixed length survives the binning
    a2 = a + 1.0
    assert L.within_bin_cohens_d(a2, la, b, lb, n_bins=4)["d_within"] > 2.0
    # one bin: the within-bin d is the plain d
    one = L.within_bin_cohens_d(a, la, b, lb, n_bins=1)
    assert one["d_within"] == pytest.approx(one["d_plain"])


def toy_run(rng, nq=40, nd=300):
    qrels = {f"q{i}": {f"d{j}": int(rng.integers(1, 3)) for j in rng.choice(nd, 3, replace=False)} for i in range(nq)}
    qrels["q0"][f"d{nd - 1}"] = 0  # a judged non-relevant document
    run = {f"q{i}": {f"d{j}": float(s) for j, s in enumerate(rng.normal(size=nd))} for i in range(nq)}
    lengths = {f"d{j}": int(rng.integers(5, 500)) for j in range(nd)}
    return qrels, run, lengths


def test_stratified_metric_with_one_bin_is_the_plain_metric():
    qrels, run, lengths = toy_run(np.random.default_rng(2))
    metrics = ("ndcg@10", "recall@100", "mrr@10")
    one = L.length_stratified_metrics(qrels, run, lengths, n_bins=1, metrics=metrics)
    plain = evaluate_run(qrels, run, metrics)
    assert len(one["bins"]) == 1
    for m in metrics:
        assert one["bins"][0][m] == pytest.approx(plain[m], abs=1e-12)
    assert one["bins"][0]["queries"] == plain["evaluated_queries"]


def test_stratified_bins_restrict_qrels_to_their_documents_and_slope_shows_a_length_bias():
    rng = np.random.default_rng(3)
    qrels, _, lengths = toy_run(rng)
    # a run that ranks documents by shortness: short relevant documents are found, long ones not
    run = {q: {d: -float(n) for d, n in lengths.items()} for q in qrels}
    r = L.length_stratified_metrics(qrels, run, lengths, n_bins=3, metrics=("recall@100",))
    edges = L.quantile_edges([lengths[d] for docs in qrels.values() for d, s in docs.items() if s > 0], 3)
    for i, b in enumerate(r["bins"]):
        lo = -np.inf if i == 0 else edges[i - 1]
        hi = np.inf if i == len(edges) else edges[i]
        sub = {q: {d: s for d, s in docs.items() if lo < lengths[d] <= hi} for q, docs in qrels.items()}
        want = evaluate_run({q: v for q, v in sub.items() if v}, run, ("recall@100",))["recall@100"]
        assert b["recall@100"] == pytest.approx(want)
    assert r["recall@100_slope"] < -0.2
    rl = L.retrieved_length(run, qrels, lengths, depth=10)
    assert rl["ratio_to_corpus"] < 0.2


def test_length_report_on_a_search():
    torch.manual_seed(0)
    nq, nd = 30, 120
    docs = torch.randn(nd, 16)
    queries = docs[:nq] + 0.3 * torch.randn(nq, 16)
    qids, dids = [f"q{i}" for i in range(nq)], [f"d{j}" for j in range(nd)]
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(nq)}
    vec = {"query": queries, "passage": docs}
    r = retrieve(lambda texts, side: vec[side], dict(zip(qids, qids)), dict(zip(dids, dids)), "dot", 10)
    dl = torch.randint(5, 400, (nd,)).tolist()
    summary, samples = L.length_report(r, qrels, [10] * nq, dl, "dot", n_bins=2, max_length=256)
    flat = L.flat_length_metrics(summary)
    assert set(flat) >= {"len_rho_docs", "len_d_within", "len_d_plain", "len_ndcg@10_slope", "len_top10_ratio",
                         "len_ndcg@10_bin1", "len_ndcg@10_bin2"}
    assert np.isnan(flat["len_rho_queries"])  # constant query lengths: undefined, not 0
    assert summary["lengths"]["documents"]["over_max"] == pytest.approx(np.mean(np.array(dl) > 256))
    assert samples["relevant"].sum() == nq
    # the magnitude report's samples of the same search give the same report (no second pass)
    from magclip.diagnostics.magnitude import relevance_from_ids, relevance_norms

    rel = relevance_norms(queries, docs, relevance_from_ids(qids, dids, qrels), "dot", k=10)
    again, _ = L.length_report(r, qrels, [10] * nq, dl, "dot", n_bins=2, max_length=256, relevance_samples=rel)
    assert again["within_bin_d"] == summary["within_bin_d"]
    with pytest.raises(ValueError, match="one length"):
        L.length_report(r, qrels, [10] * (nq - 1), dl, "dot")
    table = L.format_length_table({"toy": {"scorer": {"mode": "dot"}, "length": summary}})
    assert "| toy | dot |" in table
