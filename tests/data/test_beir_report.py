"""BEIR folders read as BEIR reads them, and what that reading did reported (issue 49, item 7).

A corpus line whose `_id` repeats replaces the earlier document (BEIR's GenericDataLoader fills a dict
line by line), and queries without judgements are left out: both happened unreported. Now the repeated
ids (the judged ones by id) and the queries left out are logged and kept in every BEIR entry of
eval/beir.py and of a text training run's results, and the nDCG equals pytrec_eval on what BEIR reads
(BEIR's own loader where it is installed, else its reading rules spelled out below).
"""

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from builders import beir_command_record, make_tiny_bert, write_beir_folder

from magclip.data.beir import load_beir

DOCS = [("d1", "cats sit on mats"), ("d2", "dogs run in the park"), ("d3", "protein cell study results"),
        ("d4", "the brain is white matter"), ("d5", "red blue green data"), ("d6", "gene model for cancer"),
        ("d1", "large small human results"),     # d1 again: BEIR keeps this text
        ("d7", "a cat and a dog"), ("d3", "protein cell study results")]   # d3 again, the same text
QUERIES = [("q1", "cats sit on mats"), ("q2", "dogs run in the park"), ("q3", "what is a gene"),
           ("q2", "where do dogs run")]          # q2 again: BEIR keeps this text
QRELS = [("q1", "d1", 1), ("q2", "d2", 1), ("q2", "d7", 0)]   # q3 is judged nowhere: left out


def write_odd_beir(folder: Path) -> Path:
    return write_beir_folder(folder, DOCS, QUERIES, QRELS)


def beir_reading(folder: Path, split: str = "test"):
    """(corpus, queries, qrels) as BEIR reads the folder: its GenericDataLoader where installed, else the same
    rules as in beir/datasets/data_loader.py (one dict assignment per line; queries kept where judged)."""
    try:
        from beir.datasets.data_loader import GenericDataLoader
    except ImportError:
        corpus, queries, qrels = {}, {}, {}
        for line in (folder / "corpus.jsonl").read_text().splitlines():
            row = json.loads(line)
            corpus[row.get("_id")] = {"text": row.get("text"), "title": row.get("title")}
        for line in (folder / "queries.jsonl").read_text().splitlines():
            row = json.loads(line)
            queries[row.get("_id")] = row.get("text")
        with open(folder / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_MINIMAL)
            next(reader)
            for query_id, corpus_id, score in reader:
                qrels.setdefault(query_id, {})[corpus_id] = int(score)
        return corpus, {q: queries[q] for q in qrels}, qrels
    return GenericDataLoader(str(folder)).load(split)


EXPECTED_REPORT = {"duplicate_doc_ids": 2, "duplicate_doc_ids_changed": 1, "duplicate_doc_ids_judged": 1,
                   "duplicate_doc_ids_judged_first": ["d1"], "duplicate_query_ids": 1,
                   "duplicate_query_ids_first": ["q2"], "unjudged_queries": 1, "unjudged_query_ids_first": ["q3"],
                   "repeated_qrels": 0, "repeated_qrels_changed": 0, "repeated_qrels_first": [],
                   "queries_all_zero": 0, "queries_all_zero_ids_first": []}


def test_the_folder_is_read_as_beir_reads_it_and_the_reading_is_reported(tmp_path, caplog):
    folder = write_odd_beir(tmp_path / "odd")
    with caplog.at_level(logging.INFO, logger="magclip.data.beir"):
        data = load_beir(folder)
    corpus, queries, qrels = beir_reading(folder)
    assert {d: (v["title"] or "", v["text"]) for d, v in corpus.items()} == \
        {d: (v["title"], v["text"]) for d, v in data.corpus.items()}
    assert list(data.corpus) == list(corpus)          # a repeated id keeps its first place, as in BEIR's dict
    assert data.queries == queries and data.qrels == qrels
    assert data.read_report == EXPECTED_REPORT
    assert data.subset(1).read_report == EXPECTED_REPORT
    assert "2 document ids repeat in corpus.jsonl (1 with another title or text)" in caplog.text
    assert "1 of them are judged in test: ['d1']" in caplog.text
    assert "1 queries have no judgement in test and are left out (as BEIR does), e.g. ['q3']" in caplog.text


def test_the_beir_command_reports_the_reading_and_scores_what_beir_reads(tmp_path, monkeypatch, capsys):
    """eval/beir.py on the folder: the read report is in its results entry, and nDCG@10 equals pytrec_eval
    on the same model's vectors of what BEIR reads (d1 is the replacing text, so q1's relevant document is
    not the copy of its own text that the first line held)."""
    import pytrec_eval
    import torch

    from magclip.models.text import BiEncoder

    folder = write_odd_beir(tmp_path / "odd")
    model_dir = make_tiny_bert(tmp_path / "bert")
    entry = beir_command_record(tmp_path, monkeypatch, model_dir, folder)
    assert entry["read_report"] == EXPECTED_REPORT and entry["queries"] == 2 and entry["docs"] == 7

    corpus, queries, qrels = beir_reading(folder)
    model = BiEncoder.from_pretrained(model_dir)
    dids, qids = list(corpus), list(queries)
    d = torch.nn.functional.normalize(model.encode([(corpus[i]["title"] + " " + corpus[i]["text"]).strip()
                                                    for i in dids], "passage"), dim=-1)
    q = torch.nn.functional.normalize(model.encode([queries[i] for i in qids], "query"), dim=-1)
    scores = q @ d.T
    run = {qid: {did: float(scores[i, j]) for j, did in enumerate(dids)} for i, qid in enumerate(qids)}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    assert entry["ndcg@10"] == pytest.approx(float(np.mean([v["ndcg_cut_10"] for v in per_query.values()])),
                                             abs=1e-6)
    first_line_kept = {**run, "q1": {**run["q1"], "d1": 1.0}}   # what keeping the first d1 would have given q1
    other = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(first_line_kept)
    assert float(np.mean([v["ndcg_cut_10"] for v in other.values()])) != pytest.approx(entry["ndcg@10"])


def test_a_text_run_keeps_the_read_report_of_its_beir_sets(tmp_path):
    from builders import toy_rows

    from magclip.config import load_text_config
    from magclip.training.text import train_text

    folder = write_odd_beir(tmp_path / "odd")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy_rows(8)))
    recipe = Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml"
    results = train_text(load_text_config(recipe, [
        f"model.name={make_tiny_bert(tmp_path / 'bert')}", "model.query_max_length=16", "model.passage_max_length=24",
        f"data.train={tmp_path / 'pairs.jsonl'}", "data.beir=null", f"output_dir={tmp_path / 'runs'}", "name=odd",
        "train.batch_size=4", "train.max_steps=1", "train.warmup_steps=0", "eval.at_start=false",
        f"eval.beir={{odd: {folder}}}", "eval.sts={}", "eval.rag={}", "eval.length_bins=0"]))
    assert results["eval_read_report"] == {"odd": EXPECTED_REPORT}
    saved = json.loads((tmp_path / "runs" / "odd" / "results.json").read_text())
    assert saved["eval_read_report"] == {"odd": EXPECTED_REPORT} and "odd/ndcg@10" in saved["metrics"]
