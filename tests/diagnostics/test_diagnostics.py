"""Magnitude diagnostics (Cohen's d, bootstrap, relevance samples, plots) and the Fisher predictor
(analytic Fisher on linear towers, Gram vs direct spectrum, invariances, model wiring, launcher)."""

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from magclip.diagnostics import fisher as fim
from magclip.diagnostics import magnitude as mag
from magclip.similarity import Scorer
from builders import make_tiny_bert

ROOT = Path(__file__).resolve().parents[2]


# ============================================================================ Cohen's d


def test_cohens_d_equals_pooled_sd_formula():
    a = [2.0, 4.0, 4.0, 5.0, 7.0, 9.0]
    b = [1.0, 1.5, 3.0, 3.5, 4.0]
    na, nb = len(a), len(b)
    sp = math.sqrt(((na - 1) * statistics.variance(a) + (nb - 1) * statistics.variance(b)) / (na + nb - 2))
    expected = (statistics.mean(a) - statistics.mean(b)) / sp
    assert mag.cohens_d(a, b) == pytest.approx(expected, rel=1e-12)
    assert mag.cohens_d(b, a) == pytest.approx(-expected, rel=1e-12)
    assert mag.cohens_d(torch.tensor(a), np.array(b)) == pytest.approx(expected, rel=1e-12)
    # a shifted copy: d is exactly shift / SD
    x = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    assert mag.cohens_d(x + 2.5, x) == pytest.approx(2.5 / x.std(ddof=1), rel=1e-12)
    assert math.isnan(mag.cohens_d([1.0], [2.0]))
    assert math.isnan(mag.cohens_d([1.0, 1.0], [1.0, 1.0]))


def test_cohens_d_known_separation_and_bootstrap_ci():
    rng = np.random.default_rng(0)
    a = rng.normal(1.8, 2.0, 4000)   # true d = (1.8 - 1.0) / 2 = 0.4
    b = rng.normal(1.0, 2.0, 6000)
    r = mag.bootstrap_cohens_d(a, b, n_boot=400, seed=1)
    assert r["d"] == pytest.approx(0.4, abs=0.06)
    assert r["ci_low"] < r["d"] < r["ci_high"] and r["ci_low"] > 0.3 and r["ci_high"] < 0.5
    assert r["n_boot_valid"] == 400
    again = mag.bootstrap_cohens_d(a, b, n_boot=400, seed=1)
    assert again["ci_low"] == r["ci_low"]  # deterministic given the seed
    neg = mag.bootstrap_cohens_d(b, a, n_boot=200, seed=1)
    assert neg["d"] == pytest.approx(-r["d"]) and neg["ci_high"] < 0


def test_cluster_bootstrap_resamples_whole_clusters():
    rng = np.random.default_rng(0)
    # 30 clusters, each with a cluster-level offset shared by its a and b values
    ca, cb, a, b = [], [], [], []
    for c in range(30):
        off = rng.normal(0, 3)
        a += list(off + 1 + rng.normal(0, 1, 3))
        b += list(off + rng.normal(0, 1, 10))
        ca += [c] * 3
        cb += [c] * 10
    r = mag.bootstrap_cohens_d(a, b, clusters_a=ca, clusters_b=cb, n_boot=300, seed=0)
    assert r["d"] == pytest.approx(mag.cohens_d(a, b))
    assert r["resampled"] == "clusters (30)"
    assert r["ci_low"] < r["d"] < r["ci_high"]
    with pytest.raises(ValueError):
        mag.bootstrap_cohens_d(a, b, clusters_a=ca)


def _constructed_retrieval(relevant_norm: float, n_q: int = 20, n_d: int = 200, dim: int = 16, seed: int = 0):
    """Each query's relevant document shares its direction (plus noise); relevant documents have
    norms around `relevant_norm` (10 % spread), every other document around 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, dim, generator=g)
    docs = torch.randn(n_d, dim, generator=g)
    docs = docs / docs.norm(dim=-1, keepdim=True) * (1 + 0.1 * torch.randn(n_d, 1, generator=g))
    relevance = []
    for i in range(n_q):
        v = q[i] / q[i].norm() + 0.05 * torch.randn(dim, generator=g)
        docs[i] = relevant_norm * (1 + 0.1 * torch.randn(1, generator=g)) * v / v.norm()
        relevance.append({i})
    return q, docs, relevance


@pytest.mark.parametrize("relevant_norm,sign", [(2.0, 1), (0.5, -1)])
def test_magnitude_report_sign_on_constructed_retrieval(relevant_norm, sign):
    q, docs, rel = _constructed_retrieval(relevant_norm)
    summary, samples = mag.magnitude_report(q, docs, rel, "cosine", k=5, n_boot=200)
    d = summary["doc_side"]["doc_topk"]
    # norms ~2 (or ~0.5) vs ~1: a large separation, diluted a little because another query's relevant
    # document can be among this query's top-5 non-relevant ones
    assert sign * d["d"] > 1.5 and sign * d["ci_low"] > 0.5
    assert d["n_a"] == 20 and d["n_b"] == 100
    assert sign * summary["doc_side"]["doc_corpus"]["d"] > 3
    assert summary["doc_side"]["hit1_rate"] == 1.0  # cosine finds every relevant document
    assert (samples["doc_side"]["rel_rank"] == 1).all()
    assert summary["norms"]["document"]["n"] == 200
    # query side: anchors are the 20 relevant documents, candidates the queries
    assert summary["query_side"]["queries_with_relevant"] == 20
    assert summary["query_side"]["doc_topk"]["n_a"] == 20


def test_relevance_helpers_and_ranks():
    rel = mag.relevance_from_ids(["q1", "q2"], ["d1", "d2", "d3"], {"q1": {"d2": 1, "d3": 0}, "q2": {"dx": 2}})
    assert rel == [{1}, set()]
    assert mag.relevance_from_labels(["a", "b"], ["b", "a", "a"]) == [{1, 2}, {0}]
    assert mag.transpose_relevance([{1, 2}, {0}], 3) == [{1}, {0}, {0}]
    q = torch.tensor([[1.0, 0.0]])
    docs = torch.tensor([[3.0, 0.1], [0.9, 0.0], [0.0, 1.0]])
    # dot ranks doc 0 first; the relevant doc 1 is second. cosine ranks doc 1 first.
    r = mag.relevance_norms(q, docs, [{1}], "dot", k=1)
    assert r["rel_rank"].tolist() == [2] and not r["hit1"][0]
    assert r["neg_norm"] == pytest.approx([float(docs[0].norm())])
    r = mag.relevance_norms(q, docs, [{1}], "cosine", k=1)
    assert r["rel_rank"].tolist() == [1] and r["hit1"][0]


def test_norm_stats():
    s = mag.norm_stats(torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 2.0]]))
    assert s["n"] == 3 and s["mean"] == pytest.approx(8 / 3) and s["max"] == 5 and s["q50"] == 2
    assert s["std"] == pytest.approx(np.std([5, 1, 2], ddof=1))


def test_plots_write_pngs(tmp_path):
    q, docs, rel = _constructed_retrieval(2.0)
    summary, samples = mag.magnitude_report(q, docs, rel, "cosine", k=5, n_boot=50)
    assert mag.plot_norm_histograms(samples, summary, tmp_path / "h.png").stat().st_size > 1000
    assert mag.plot_norm_vs_rank(samples, summary, tmp_path / "r.png").stat().st_size > 1000
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0, "logit_scale": 1 + s, "gamma_q_i2t": 0.5 + 0.01 * s, "gamma_d_i2t": 0.5,
             "norm_image": 3.0, "skipped": {}} for s in range(0, 50, 10)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    series = mag.training_curves(mag.read_metrics(log))
    assert set(series) == {"logit_scale", "gamma_q_i2t", "gamma_d_i2t", "norm_image"}
    assert series["logit_scale"][-1] == (40, 41.0)
    assert mag.plot_training_curves(log, tmp_path / "t.png").stat().st_size > 1000
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert mag.plot_training_curves(empty, tmp_path / "none.png") is None


# ============================================================================ Fisher: linear towers


def _analytic_grads(A, B, X, Y, gq, gd, tau):
    """Closed-form per-query gradients of log p(d_i | q_i) for q = A x, d = B y, s = <q/|q|^gq, d/|d|^gd>."""
    Q, D = X @ A.T, Y @ B.T

    def prep(Z, g):
        return Z / np.linalg.norm(Z, axis=1, keepdims=True) ** g

    def jac(z, g):  # d(z/|z|^g)/dz = |z|^-g (I - g zhat zhat^T)
        n = np.linalg.norm(z)
        zh = z / n
        return n ** (-g) * (np.eye(z.size) - g * np.outer(zh, zh))

    U, V = prep(Q, gq), prep(D, gd)
    L = tau * U @ V.T
    P = np.exp(L - L.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    rows = []
    for i in range(X.shape[0]):
        a = tau * (V[i] - P[i] @ V)
        dA = np.outer(jac(Q[i], gq) @ a, X[i])
        dB = sum(np.outer(jac(D[j], gd) @ (tau * ((i == j) - P[i, j]) * U[i]), Y[j]) for j in range(Y.shape[0]))
        rows.append(np.concatenate([dA.ravel(), dB.ravel()]))
    return np.stack(rows)


def _linear_setup(n=6, k=3, m=4, p=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(k, m)), rng.normal(size=(k, p)), rng.normal(size=(n, m)), rng.normal(size=(n, p))


def _fisher_linear(A, B, X, Y, mode, tau, chunk_size=32, gammas=None):
    pa = nn.Parameter(torch.tensor(A))
    pb = nn.Parameter(torch.tensor(B))
    feats = {"q": torch.tensor(X) @ pa.T, "d": torch.tensor(Y) @ pb.T}
    spec = Scorer("fixed", *gammas) if gammas else mode
    return fim.fisher_by_mode(feats, [pa, pb], [("q", "d", False)], [spec], logit_scale=tau, keep_grads=True,
                              chunk_size=chunk_size, candidates=())


@pytest.mark.parametrize("mode,gq,gd", [("cosine", 1, 1), ("dot", 0, 0), ("qnorm", 1, 0), ("dnorm", 0, 1),
                                        ("fixed", 0.25, 0.75)])  # exact in float32
def test_fisher_matches_analytic_on_linear_towers(mode, gq, gd):
    A, B, X, Y = _linear_setup()
    tau = 2.0
    r = _fisher_linear(A, B, X, Y, mode, tau, gammas=(gq, gd) if mode == "fixed" else None)
    grads = r["grads"][mode].numpy()
    expected = _analytic_grads(A, B, X, Y, gq, gd, tau)
    np.testing.assert_allclose(grads, expected, rtol=1e-9, atol=1e-12)
    F = fim.empirical_fisher(torch.tensor(grads)).numpy()
    np.testing.assert_allclose(F, expected.T @ expected / X.shape[0], rtol=1e-9, atol=1e-12)
    # spectrum: P = 12 + 15 = 27 > N = 6 rows -> Gram form; equals the nonzero eigenvalues of F
    res = r["modes"][mode]
    assert res["form"] == "gram" and res["n_rows"] == 6 and res["n_params"] == 27
    ev_direct = np.sort(np.linalg.eigvalsh(F))[::-1][:6]
    np.testing.assert_allclose(res["eigenvalues"], ev_direct, rtol=1e-8, atol=1e-12 * ev_direct[0])
    nonnull = ev_direct[ev_direct > res["rtol"] * ev_direct[0]]
    assert res["kappa"] == pytest.approx(nonnull[0] / nonnull[-1], rel=1e-6)


def test_batched_and_looped_per_example_grads_agree():
    A, B, X, Y = _linear_setup(n=9)
    a = _fisher_linear(A, B, X, Y, "qnorm", 1.5, chunk_size=4)["grads"]["qnorm"]
    b = _fisher_linear(A, B, X, Y, "qnorm", 1.5, chunk_size=1)["grads"]["qnorm"]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_gram_spectrum_equals_direct_spectrum():
    g = torch.Generator().manual_seed(0)
    for shape in ((7, 20), (20, 7)):
        G = torch.randn(*shape, generator=g, dtype=torch.float64)
        gram, f1 = fim.fisher_eigenvalues(G, "gram")
        direct, f2 = fim.fisher_eigenvalues(G, "direct")
        assert (f1, f2) == ("gram", "direct") and gram.numel() == direct.numel() == 7
        torch.testing.assert_close(gram, direct, rtol=1e-10, atol=1e-12)
        assert fim.fisher_spectrum(G).form == ("gram" if shape[1] > shape[0] else "direct")


def test_non_null_cut_on_rank_deficient_gradients():
    g = torch.Generator().manual_seed(1)
    G = torch.randn(10, 4, generator=g, dtype=torch.float64) @ torch.randn(4, 50, generator=g, dtype=torch.float64)
    s = fim.fisher_spectrum(G)
    assert s.n_nonnull == 4 and len(s.eigenvalues) == 10
    ev = np.sort(np.linalg.eigvalsh((G.T @ G / 10).numpy()))[::-1]
    assert s.kappa == pytest.approx(ev[0] / ev[3], rel=1e-8)
    assert s.rtol == pytest.approx(1000 * 10 * np.finfo(np.float64).eps)
    assert fim.fisher_spectrum(G.float()).rtol == pytest.approx(1000 * 10 * np.finfo(np.float32).eps)
    assert 1 <= s.effective_rank <= 4


def test_kappa_invariant_to_scaling_the_gradients():
    g = torch.Generator().manual_seed(2)
    G = torch.randn(8, 30, generator=g, dtype=torch.float64)
    s1, s2 = fim.fisher_spectrum(G), fim.fisher_spectrum(37.0 * G)
    assert s2.kappa == pytest.approx(s1.kappa, rel=1e-10)
    assert s2.lambda_max == pytest.approx(37.0 ** 2 * s1.lambda_max, rel=1e-10)


def _F(A, B, X, Y, mode, tau):
    return fim.empirical_fisher(_fisher_linear(A, B, X, Y, mode, tau)["grads"][mode])


def test_data_rescaling_invariance_follows_the_normalized_side():
    A, B, X, Y = _linear_setup(n=8, k=4, m=5, p=3, seed=3)
    tau, a = 3.0, 7.5
    # cosine: both sides normalized -> F unchanged by scaling either tower's input
    F0 = _F(A, B, X, Y, "cosine", tau)
    torch.testing.assert_close(_F(A, B, a * X, Y, "cosine", tau), F0, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(_F(A, B, X, a * Y, "cosine", tau), F0, rtol=1e-9, atol=1e-12)
    # qnorm: the query side is normalized (invariant), the document side raw (not invariant)
    F0 = _F(A, B, X, Y, "qnorm", tau)
    torch.testing.assert_close(_F(A, B, a * X, Y, "qnorm", tau), F0, rtol=1e-9, atol=1e-12)
    k0 = fim.fisher_spectrum(F0 @ torch.eye(F0.shape[0], dtype=F0.dtype)).kappa
    k1 = fim.fisher_spectrum(_F(A, B, X, a * Y, "qnorm", tau)).kappa
    assert abs(math.log(k1 / k0)) > 0.01
    # dot: scaling the query input by a acts like a temperature; the logit scale / a restores F
    F0 = _F(A, B, X, Y, "dot", tau)
    assert not torch.allclose(_F(A, B, a * X, Y, "dot", tau), F0, rtol=1e-3)
    torch.testing.assert_close(_F(A, B, a * X, Y, "dot", tau / a), F0, rtol=1e-9, atol=1e-12)


def test_scorer_keeps_float64_for_the_fisher():
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(5, 8, generator=g) * 3, torch.randn(7, 8, generator=g) * 0.2
    for mode in ("cosine", "dot", "qnorm", "dnorm"):
        s = Scorer(mode)
        s64 = s(q.double(), d.double())
        assert s64.dtype == torch.float64
        torch.testing.assert_close(s64.float(), s(q, d), rtol=1e-5, atol=1e-6)
    s = Scorer("fixed", 0.3, 0.8)
    torch.testing.assert_close(s(q.double(), d.double()).float(), s(q, d), rtol=1e-5, atol=1e-6)


def test_recommend_picks_smaller_kappa_and_reports_common_k():
    res = {"qnorm": {"kappa": 100.0, "n_nonnull": 3, "effective_rank": 2.0, "eigenvalues": [10.0, 1.0, 0.1, 0.0]},
           "dnorm": {"kappa": 1000.0, "n_nonnull": 4, "effective_rank": 2.5, "eigenvalues": [10.0, 5.0, 1.0, 0.01]},
           "cosine": {"kappa": 50.0, "n_nonnull": 4, "effective_rank": 3.0, "eigenvalues": [1.0, 0.5, 0.1, 0.02]}}
    rec = fim.recommend(res)
    assert rec["mode"] == "qnorm" and rec["kappa_ratio"] == pytest.approx(10.0) and rec["best_overall"] == "cosine"
    assert rec["kappa_common"]["k"] == 3 and rec["kappa_common"]["dnorm"] == pytest.approx(10.0)
    assert rec["mode_by_kappa_common"] == "dnorm" and rec["agree"] is False and rec["stable"] is False
    for r in res.values():
        r["kappa_at_rtol"] = {"1e-4": r["kappa"] / 10}
    assert fim.recommend(res)["mode_at_rtol"] == {"1e-4": "qnorm"}


def test_logit_scale_rules():
    q, d = torch.randn(4, 3) * 5, torch.randn(4, 3) * 2
    assert fim.resolve_logit_scale("default", "cosine", Scorer("cosine"), q, d, 20.0) == 20.0
    assert fim.resolve_logit_scale("default", "qnorm", Scorer("qnorm"), q, d, 20.0) == 1.0
    assert fim.resolve_logit_scale(3.0, "qnorm", Scorer("qnorm"), q, d, 20.0) == 3.0
    m = fim.resolve_logit_scale("matched", "qnorm", Scorer("qnorm"), q, d, 20.0)
    assert m == pytest.approx(20.0 / float(d.norm(dim=-1).mean()), rel=1e-5)
    with pytest.raises(ValueError):
        fim.resolve_logit_scale("bogus", "qnorm", Scorer("qnorm"), q, d, 20.0)


# ============================================================================ Fisher: real model wiring


def test_clip_fisher_on_tiny_resnet_projection_block():
    from magclip.models.clip import create_clip

    torch.manual_seed(0)
    bundle = create_clip("tiny-resnet", None)
    before = {n: p.detach().clone() for n, p in bundle.model.named_parameters()}
    flags = {n: p.requires_grad for n, p in bundle.model.named_parameters()}
    images = torch.randn(6, 3, 32, 32)
    texts = bundle.tokenizer([f"{c} {s}" for c, s in zip("abcdef", ["circle", "square", "cross", "star", "dot", "x"])])
    r = fim.clip_fisher(bundle.model, images, texts, modes=["qnorm", "dnorm"], batchnorm="batch")
    assert r["setup"]["block"]["parameters"] == ["clip.visual.attnpool.c_proj.weight",
                                                 "clip.visual.attnpool.c_proj.bias", "clip.text_projection"]
    assert r["setup"]["rows"] == 12 and r["modes"]["qnorm"]["n_rows"] == 12
    assert r["modes"]["qnorm"]["n_params"] == 64 * 512 + 64 + 128 * 64
    assert r["recommendation"]["mode"] in ("qnorm", "dnorm")
    for n, p in bundle.model.named_parameters():  # the model itself is untouched
        assert torch.equal(p, before[n]) and p.requires_grad == flags[n]


def _tiny_beir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = ["the cat sat", "a dog sat on the mat", "protein cell study", "gene study of the brain",
            "red blue green", "the query passage", "cell of the brain", "a green cat", "blue dog", "mat of the cat"]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n"
                                                 for i, t in enumerate(docs)))
    queries = ["cat", "dog mat", "protein", "gene brain", "red green", "query"]
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": t}) + "\n"
                                                  for i, t in enumerate(queries)))
    (folder / "qrels").mkdir(exist_ok=True)
    rows = [f"q{i}\td{i}\t1" for i in range(6)] + ["q3\td6\t1", "q0\td9\t0"]
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    return folder


def test_text_fisher_on_tiny_bert_loop_equals_batched(tmp_path):
    from magclip.models.text import BiEncoder

    model = BiEncoder.from_pretrained(make_tiny_bert(tmp_path / "bert"))
    q, d = ["cat", "dog mat", "protein", "gene brain"], ["the cat sat", "a dog sat", "protein cell", "gene study"]
    r1 = fim.text_fisher(model, q, d, modes=["qnorm", "dnorm"], chunk_size=1, doc_to_query=True)
    r4 = fim.text_fisher(model, q, d, modes=["qnorm", "dnorm"], chunk_size=4, doc_to_query=True)
    assert r1["setup"]["block"]["parameters"] == ["query_model.encoder.layer.1.output.dense.weight",
                                                  "query_model.encoder.layer.1.output.dense.bias"]
    assert r1["setup"]["rows"] == 8
    for m in ("qnorm", "dnorm"):
        np.testing.assert_allclose(r1["modes"][m]["eigenvalues"], r4["modes"][m]["eigenvalues"], rtol=1e-8,
                                   atol=1e-14)
    assert r1["modes"]["qnorm"]["logit_scale"] == 1.0
    assert fim.resolve_logit_scale("default", "cosine", Scorer("cosine"), torch.ones(1, 2), torch.ones(1, 2), 20.0) == 20


def test_beir_pairs_use_distinct_documents(tmp_path):
    from magclip.data.beir import load_beir

    data = load_beir(_tiny_beir(tmp_path / "beir"))
    q, _d, qids, dids = fim.beir_pairs(data, 10, seed=0)
    assert len(q) == 6 and len(set(dids)) == 6 and "d9" not in dids
    assert all(data.qrels[qi][di] >= 1 for qi, di in zip(qids, dids))


def test_diagnose_launcher_text(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "eval"))
    import diagnose

    bert, beir = make_tiny_bert(tmp_path / "bert"), _tiny_beir(tmp_path / "beir")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "gamma_q": 0.5, "gamma_d": 0.4 + s / 100, "logit_scale": 2.0})
                               + "\n" for s in range(5)))
    out = tmp_path / "diag"
    res = diagnose.main(["--text-model", str(bert), "--beir", str(beir), "--k", "3", "--n-boot", "50",
                         "--fisher-modes", "qnorm", "dnorm", "--logit-scale", "default", "matched",
                         "--metrics", str(metrics), "--out", str(out)])
    saved = json.loads((out / "diagnostics.json").read_text())
    assert saved["magnitude"]["data"]["queries"] == 6 and saved["magnitude"]["data"]["relevant_pairs"] == 7
    assert set(saved["fisher"]) == {"default", "matched"}
    assert saved["fisher"]["default"]["recommendation"]["mode"] in ("qnorm", "dnorm")
    for name in ("norm_hist.png", "norm_vs_rank.png", "fisher_spectrum.png", "training.png"):
        assert (out / name).stat().st_size > 1000
    text = capsys.readouterr().out
    assert "Cohen's d" in text and "recommends" in text
    assert res["kind"] == "text"
