"""Retrieval files in the field's layouts, read as their own tools read them (issue 61).

MS MARCO's qrels (`qid<TAB>0<TAB>pid<TAB>1`, TREC's four columns) were read as BEIR's three: every query
judged passage `0`, nDCG@10 a tenth of pytrec_eval's, with no warning. BEIR's hub copies (`.jsonl.gz`),
MTEB's parquet layout and MS MARCO's folder were refused as "corpus.jsonl is missing". Now each is
recognised by its signature and gives pytrec_eval's numbers on pytrec_eval's own reading of the file.
"""

import gzip
import io
import json
import logging

import numpy as np
import pytest
from builders import beir_command_record, make_tiny_bert, write_beir_folder

from magclip.data.beir import load_beir, read_qrels
from magclip.data.layouts import LAYOUTS, layout_table

pytrec_eval = pytest.importorskip("pytrec_eval")

# MS MARCO numbers its passages from 0, so a qrels row read as BEIR's columns names a passage that exists
DOCS = [(str(i), text) for i, text in enumerate([
    "the cat sat on the mat", "dogs run in the park", "proteins fold in cells", "the brain is white matter",
    "genes code for proteins", "rain falls in spring", "cats chase mice", "a park has trees"])]
QUERIES = [("100", "where do cats sit"), ("101", "what do genes code"), ("102", "where do dogs run"),
           ("103", "what is in the brain")]
TREC_ROWS = [("100", "0", "0", "1"), ("100", "0", "6", "1"), ("101", "0", "4", "1"), ("102", "0", "1", "1"),
             ("103", "0", "3", "1")]


def pytrec_qrels(text: str) -> dict:
    """pytrec_eval's own reading of a TREC qrels file."""
    return pytrec_eval.parse_qrel(io.StringIO(text))


def test_ms_marco_qrels_are_read_as_trec_columns_as_pytrec_eval_reads_them(tmp_path, caplog):
    for name, sep in (("tabs.tsv", "\t"), ("spaces.txt", " ")):
        text = "".join(sep.join(row) + "\n" for row in TREC_ROWS)
        path = tmp_path / name
        path.write_text(text)
        with caplog.at_level(logging.WARNING, logger="magclip.data"):
            qrels = read_qrels(path)
        assert qrels == pytrec_qrels(text)
        assert f"{path}: read as TREC qrels" in caplog.text and "doc-id<-3, relevance<-4; 5 rows" in caplog.text


def test_beir_qrels_with_and_without_header_keep_beir_positions(tmp_path):
    rows = "q1\td1\t1\nq1\td2\t0\n"
    (tmp_path / "h.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    (tmp_path / "n.tsv").write_text(rows)
    assert read_qrels(tmp_path / "h.tsv") == read_qrels(tmp_path / "n.tsv") == {"q1": {"d1": 1, "d2": 0}}


@pytest.mark.parametrize("line", ["q1\td1\n", "q1 0 d1 1 extra\n", "q1\t0\td1\t1\tx\n"])
def test_a_qrels_file_in_no_layout_is_refused_in_one_line_listing_the_layouts(tmp_path, line):
    (tmp_path / "q.tsv").write_text(line)
    with pytest.raises(ValueError) as err:
        read_qrels(tmp_path / "q.tsv")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'q.tsv'}: line 1")
    assert "TREC qrels" in message and "BEIR qrels" in message


def test_a_line_of_another_width_than_the_first_is_refused_at_that_line(tmp_path):
    (tmp_path / "q.tsv").write_text("1\t0\t7\t1\n2\t9\t1\n")
    with pytest.raises(ValueError, match=r"q\.tsv:2: expected query-id iteration doc-id relevance"):
        read_qrels(tmp_path / "q.tsv")


def write_ms_marco(folder, split="dev.small"):
    folder.mkdir(parents=True)
    (folder / "collection.tsv").write_text("".join(f"{i}\t{t}\n" for i, t in DOCS))
    (folder / f"queries.{split}.tsv").write_text("".join(f"{i}\t{t}\n" for i, t in QUERIES))
    (folder / f"qrels.{split}.tsv").write_text("".join("\t".join(row) + "\n" for row in TREC_ROWS))
    return folder


def write_hub_copy(folder):
    """BEIR's hub copy: the JSON lines gzipped, qrels/SPLIT.tsv as BEIR writes it."""
    beir = write_beir_folder(folder, DOCS, QUERIES, [(q, d, int(s)) for q, _, d, s in TREC_ROWS])
    for name in ("corpus.jsonl", "queries.jsonl"):
        with gzip.open(beir / f"{name}.gz", "wt", encoding="utf-8") as f:
            f.write((beir / name).read_text())
        (beir / name).unlink()
    return beir


def write_mteb(folder):
    """MTEB's hub layout: corpus/, queries/ and the qrels as parquet files, BEIR's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for sub in ("corpus", "queries", "qrels"):
        (folder / sub).mkdir(parents=True)
    pq.write_table(pa.table({"_id": [i for i, _ in DOCS], "title": [""] * len(DOCS), "text": [t for _, t in DOCS]}),
                   folder / "corpus" / "corpus-00000-of-00001.parquet")
    pq.write_table(pa.table({"_id": [i for i, _ in QUERIES], "text": [t for _, t in QUERIES]}),
                   folder / "queries" / "queries-00000-of-00001.parquet")
    pq.write_table(pa.table({"query-id": [q for q, *_ in TREC_ROWS], "corpus-id": [d for _, _, d, _ in TREC_ROWS],
                             "score": [int(s) for *_, s in TREC_ROWS]}), folder / "qrels" / "test.parquet")
    return folder


def test_hub_copies_mteb_parquet_and_ms_marco_folders_read_the_same_set(tmp_path):
    plain = load_beir(write_beir_folder(tmp_path / "beir", DOCS, QUERIES,
                                        [(q, d, int(s)) for q, _, d, s in TREC_ROWS]))
    for data in (load_beir(write_hub_copy(tmp_path / "hub")), load_beir(write_mteb(tmp_path / "mteb")),
                 load_beir(write_ms_marco(tmp_path / "msmarco"), "dev.small")):
        assert (data.corpus, data.queries, data.qrels) == (plain.corpus, plain.queries, plain.qrels)


def test_a_folder_of_no_layout_is_refused_naming_what_was_looked_for(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError) as err:
        load_beir(tmp_path / "x")
    assert "corpus.jsonl.gz" in str(err.value) and "MTEB hub folder" in str(err.value) and "\n" not in str(err.value)


def test_an_ms_marco_folder_evaluates_to_pytrec_eval_s_numbers(tmp_path, monkeypatch):
    import torch

    from magclip.models.text import BiEncoder

    folder = write_ms_marco(tmp_path / "msmarco", split="test")
    model_dir = make_tiny_bert(tmp_path / "bert")
    entry = beir_command_record(tmp_path, monkeypatch, model_dir, folder)
    model = BiEncoder.from_pretrained(model_dir)
    q = torch.nn.functional.normalize(model.encode([t for _, t in QUERIES], "query"), dim=-1)
    d = torch.nn.functional.normalize(model.encode([t for _, t in DOCS], "passage"), dim=-1)
    scores = q @ d.T
    run = {qid: {did: float(scores[i, j]) for j, (did, _) in enumerate(DOCS)} for i, (qid, _) in enumerate(QUERIES)}
    qrels = pytrec_qrels((folder / "qrels.test.tsv").read_text())
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    assert entry["queries"] == len(QUERIES)
    assert entry["ndcg@10"] == pytest.approx(float(np.mean([v["ndcg_cut_10"] for v in per_query.values()])), abs=1e-6)


def test_every_layout_names_its_peer_and_the_readme_table_lists_them_all():
    assert all(x.peer and x.signature for x in LAYOUTS) and len({x.name for x in LAYOUTS}) == len(LAYOUTS)
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert layout_table() in readme


def test_json_lines_of_a_beir_corpus_are_read_by_name(tmp_path):
    folder = write_beir_folder(tmp_path / "b", DOCS, QUERIES, [("100", "0", 1)])
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t, "title": "T", "_id": i}) + "\n"
                                                 for i, t in DOCS))
    assert load_beir(folder).corpus["0"] == {"title": "T", "text": DOCS[0][1]}
