"""Same-id documents: kept by default where queries and documents are numbered independently
(Cranfield, MED: query 5 and document 5 are different texts), left out where the query *is* the
document (ArguAna, Quora: same id, same text), and counted either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytrec_eval

from magclip.cli import beir as eval_beir
from magclip.data.beir import identical_id_exclusions, load_beir
from magclip.evaluation.text import evaluate_beir_data
from magclip.metrics.ir import search_run
from magclip.models.text import BiEncoder
from builders import make_tiny_bert

DOCS = {"1": "cat sat on the mat", "2": "dog with a red ball", "3": "protein in the cell", "4": "brain white matter"}
NUMBERED_QUERIES = {"1": "dog red ball", "2": "cat mat", "3": "cell protein", "4": "white matter brain"}


def write_beir(folder: Path, queries: dict[str, str], qrels: dict[str, str]) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n"
                                                 for d, t in DOCS.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                              "".join(f"{q}\t{d}\t1\n" for q, d in qrels.items()))
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> BiEncoder:
    return BiEncoder.from_pretrained(str(make_tiny_bert(tmp_path_factory.mktemp("bert"))))


def test_the_rules():
    corpus = {d: {"title": "", "text": t} for d, t in DOCS.items()}
    assert identical_id_exclusions(NUMBERED_QUERIES, corpus, "self") == {}
    assert identical_id_exclusions(NUMBERED_QUERIES, corpus, "drop") == {q: q for q in NUMBERED_QUERIES}
    assert identical_id_exclusions(NUMBERED_QUERIES, corpus, "keep") == {}
    own = {"3": "  Protein in the CELL ", "9": "not in the corpus"}
    assert identical_id_exclusions(own, corpus, "self") == {"3": "3"}  # whitespace and case aside
    titled = {"a": {"title": "Topic", "text": "the argument"}}
    assert identical_id_exclusions({"a": "the argument"}, titled, "self") == {"a": "a"}
    assert identical_id_exclusions({"a": "Topic the argument"}, titled, "self") == {"a": "a"}
    with pytest.raises(ValueError, match="'ignore'.*self, keep, drop"):
        identical_id_exclusions(NUMBERED_QUERIES, corpus, "ignore")


def test_numbered_collections_keep_document_k_for_query_k(tmp_path, tiny_model):
    """Queries 3 and 4 are judged relevant to the documents with their own numbers (other texts): BEIR's
    rule drops those from their rankings, the default keeps them."""
    data = load_beir(write_beir(tmp_path / "numbered", NUMBERED_QUERIES, {"1": "2", "2": "1", "3": "3", "4": "4"}),
                     "test")
    default = evaluate_beir_data(tiny_model, data, "cosine")
    beir_rule = evaluate_beir_data(tiny_model, data, "cosine", identical_ids="drop")
    assert default["identical_ids"] == "self" and default["identical_id_queries"] == 4
    assert default["excluded_identical"] == 0 and default["removed_identical"] == 0
    assert beir_rule["excluded_identical"] == 4 and beir_rule["removed_identical"] == 4  # 4 documents: all retrieved
    # the default equals pytrec_eval on the plain ranking of every document; BEIR's rule loses queries 3 and 4
    q = tiny_model.encode(list(data.queries.values()), "query")
    d = tiny_model.encode(data.doc_texts(), "passage")
    run, _ = search_run(q, d, list(data.queries), list(data.corpus), "cosine", 100)
    ref = pytrec_eval.RelevanceEvaluator(data.qrels, {"ndcg_cut.10"}).evaluate(run)
    assert default["ndcg@10"] == pytest.approx(sum(v["ndcg_cut_10"] for v in ref.values()) / len(ref), abs=1e-12)
    assert beir_rule["ndcg@10"] < default["ndcg@10"]


def test_a_corpus_that_holds_its_queries_drops_them_and_counts_them(tmp_path, tiny_model):
    queries = {"2": "dog with a red ball", "3": "protein in the cell"}  # the documents 2 and 3 themselves
    data = load_beir(write_beir(tmp_path / "own", queries, {"2": "1", "3": "4"}), "test")
    out = evaluate_beir_data(tiny_model, data, "cosine")
    assert out["excluded_identical"] == 2 and out["removed_identical"] == 2 and out["identical_id_queries"] == 2
    q = tiny_model.encode(list(data.queries.values()), "query")
    d = tiny_model.encode(data.doc_texts(), "passage")
    run, _ = search_run(q, d, list(data.queries), list(data.corpus), "cosine", 100, exclude={"2": "2", "3": "3"})
    assert all(qid not in hits for qid, hits in run.items())
    kept = evaluate_beir_data(tiny_model, data, "cosine", identical_ids="keep")
    assert kept["excluded_identical"] == 0 and kept["removed_identical"] == 0


def test_the_command_defaults_to_self_and_takes_the_old_flag(tmp_path, tiny_model):
    folder = write_beir(tmp_path / "numbered", NUMBERED_QUERIES, {"1": "2", "2": "1", "3": "3", "4": "4"})
    model = tmp_path / "model"
    tiny_model.save_pretrained(model)
    for flags, rule, excluded in (([], "self", 0), (["--identical-ids", "drop"], "drop", 4),
                                  (["--keep-identical-ids"], "keep", 0)):
        out = tmp_path / f"{rule}.json"
        eval_beir.main(["--model", str(model), "--data", str(folder), "--mode", "cosine", "--out", str(out), *flags])
        entry = json.loads(out.read_text())["numbered"]
        assert (entry["identical_ids"], entry["excluded_identical"]) == (rule, excluded)


def test_beir_export_index_round_trip(tmp_path, tiny_model):
    """eval/beir.py --export-index: the prepared corpus searched with prepared queries ranks as magclip did."""
    from magclip.evaluation.index import load_index, prepare_queries

    folder = write_beir(tmp_path / "numbered", NUMBERED_QUERIES, {"1": "2", "2": "1", "3": "3", "4": "4"})
    model = tmp_path / "model"
    tiny_model.save_pretrained(model)
    out = tmp_path / "index"
    eval_beir.main(["--model", str(model), "--data", str(folder), "--mode", "qnorm", "--out", str(tmp_path / "r.json"),
                    "--export-index", str(out)])
    docs, ids, record = load_index(out / "numbered" / "qnorm")
    assert ids == list(DOCS) and record["mode"] == "qnorm" and record["documents"] == "passage"
    q = tiny_model.encode(list(NUMBERED_QUERIES.values()), "query")
    d = tiny_model.encode(list(DOCS.values()), "passage")
    run, _ = search_run(q, d, list(NUMBERED_QUERIES), list(DOCS), "qnorm", 4)
    scores = prepare_queries(record, q) @ docs.T
    for row, qid in zip(scores, NUMBERED_QUERIES):
        assert [ids[j] for j in (-row).argsort(kind="stable")] == list(run[qid]), qid
