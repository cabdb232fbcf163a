"""BEIR qrels read as BEIR reads them, and what that did reported (issue 55).

A query whose judgements are all 0 has no relevant document: BEIR keeps it and it scores 0 in the mean
(pytrec_eval's nDCG of a query without a relevant document). A (query, document) pair judged on two rows
keeps the last row's score (BEIR fills a dict row by row). Both happened without a word; now both are
counted in the read report and logged, and eval/beir.py's nDCG@10 equals pytrec_eval on BEIR's reading.
"""

import csv
import logging

import numpy as np
import pytest
from builders import beir_command_record, make_tiny_bert, write_beir_folder

from magclip.data.beir import load_beir

DOCS = [("d1", "cats sit on mats"), ("d2", "dogs run in the park"), ("d3", "protein cell study"),
        ("d4", "the brain is white matter"), ("d5", "gene model for cancer")]
QUERIES = [("q1", "where do cats sit"), ("q2", "what is a gene"), ("q3", "protein in cells"), ("q4", "dogs")]
QRELS = [("q1", "d1", 1), ("q2", "d5", 0), ("q2", "d4", 0),    # q2: judged, nothing relevant
         ("q3", "d3", 0), ("q3", "d3", 2),                     # repeated, the last (2) wins
         ("q4", "d2", 1), ("q4", "d2", 1)]                     # repeated, the same score


def write_beir(folder):
    return write_beir_folder(folder, DOCS, QUERIES, QRELS)


def beir_qrels(folder) -> dict:
    """BEIR's GenericDataLoader._load_qrels: csv rows into a dict, one assignment per row."""
    qrels: dict = {}
    with open(folder / "qrels" / "test.tsv", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_MINIMAL)
        next(reader)
        for query_id, corpus_id, score in reader:
            qrels.setdefault(query_id, {})[corpus_id] = int(score)
    return qrels


def test_all_zero_queries_and_repeated_rows_are_counted(tmp_path, caplog):
    folder = write_beir(tmp_path / "set")
    with caplog.at_level(logging.WARNING, logger="magclip.data.beir"):
        data = load_beir(folder)
    assert data.qrels == beir_qrels(folder) and list(data.queries) == ["q1", "q2", "q3", "q4"]
    report = data.read_report
    assert (report["repeated_qrels"], report["repeated_qrels_changed"]) == (2, 1)
    assert report["repeated_qrels_first"] == ["q3\td3", "q4\td2"]
    assert (report["queries_all_zero"], report["queries_all_zero_ids_first"]) == (1, ["q2"])
    assert "2 (query, document) pairs are judged on more than one row (1 with another score)" in caplog.text
    assert "1 of 4 queries have only judgements of 0 (no relevant document); they stay in the evaluation" \
        in caplog.text


def test_the_mean_counts_all_zero_queries_as_pytrec_eval_does(tmp_path, monkeypatch):
    import pytrec_eval
    import torch

    from magclip.models.text import BiEncoder

    folder = write_beir(tmp_path / "set")
    model_dir = make_tiny_bert(tmp_path / "bert")
    entry = beir_command_record(tmp_path, monkeypatch, model_dir, folder)
    assert entry["queries"] == 4 and entry["read_report"]["queries_all_zero"] == 1

    model = BiEncoder.from_pretrained(model_dir)
    q = torch.nn.functional.normalize(model.encode([t for _, t in QUERIES], "query"), dim=-1)
    d = torch.nn.functional.normalize(model.encode([t for _, t in DOCS], "passage"), dim=-1)
    scores = q @ d.T
    run = {qid: {did: float(scores[i, j]) for j, (did, _) in enumerate(DOCS)} for i, (qid, _) in enumerate(QUERIES)}
    per_query = pytrec_eval.RelevanceEvaluator(beir_qrels(folder), {"ndcg_cut.10"}).evaluate(run)
    assert per_query["q2"]["ndcg_cut_10"] == 0.0 and len(per_query) == 4
    assert entry["ndcg@10"] == pytest.approx(float(np.mean([v["ndcg_cut_10"] for v in per_query.values()])), abs=1e-6)
