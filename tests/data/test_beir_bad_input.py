"""Bad input to the BEIR reader (load_beir) and the QA reader (load_qa): a clear error naming the file
and id, or a counted warning, never a silent zero.

- missing qrels file. load_beir: FileNotFoundError naming the path and the splits that exist.
  load_qa: gold passages from qa.jsonl's passage_id (logged, `gold_source`); without passage_id,
  FileNotFoundError naming the path.
- query id with no text. load_beir: counted warning `queries_without_text`, the query and its
  judgements dropped (all of them: ValueError). load_qa: counted `questions_without_text`, dropped.
- qrels line naming an unknown document. load_beir: counted `qrels_unknown_docs` (kept, as BEIR
  keeps them: they count against recall) and `queries_without_known_relevant` (they score 0); all
  of them unknown: ValueError. load_qa: counted `gold_unknown_passages` and `questions_without_gold`
  (left out of the gold-passage metrics, kept for answer recall); all unknown: ValueError.
- empty corpus: ValueError naming corpus.jsonl (both readers, and distractor folders).
"""

import json
import logging
from pathlib import Path

import pytest

from magclip.data.beir import load_beir
from magclip.metrics.ir import evaluate_run
from magclip.data.qa import load_qa


def write_beir(folder: Path, docs=None, queries=None, qrels="q1\td1\t1\nq2\td2\t1\n", split="test") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = [{"_id": "d1", "title": "Cats", "text": "cats sit"}, {"_id": "d2", "title": "", "text": "dogs run"}] \
        if docs is None else docs
    queries = [{"_id": "q1", "text": "where do cats sit"}, {"_id": "q2", "text": "do dogs run"}] \
        if queries is None else queries
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    if qrels is not None:
        (folder / "qrels").mkdir(exist_ok=True)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return folder


def write_qa(folder: Path, rows, qrels: str | None = "q1\td1\t1\nq2\td2\t1\n", docs=None) -> Path:
    write_beir(folder, docs=docs, qrels=qrels)
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


QA_ROWS = [{"id": "q1", "question": "where do cats sit", "answers": ["sit"], "passage_id": "d1"},
           {"id": "q2", "question": "do dogs run", "answers": ["dogs"], "passage_id": "d2"}]


# ---------------------------------------------------------------------------- missing qrels file
def test_missing_qrels_file_is_an_error_naming_it(tmp_path):
    folder = write_beir(tmp_path / "toy", split="train")
    with pytest.raises(FileNotFoundError) as err:
        load_beir(folder, "test")
    assert str(folder / "qrels" / "test.tsv") in str(err.value) and "splits found: train" in str(err.value)
    with pytest.raises(FileNotFoundError, match="qrels"):
        load_beir(write_beir(tmp_path / "none", qrels=None), "test")


def test_missing_qrels_file_for_qa(tmp_path, caplog):
    rows = [{k: v for k, v in r.items() if k != "passage_id"} for r in QA_ROWS]
    with pytest.raises(FileNotFoundError) as err:
        load_qa(write_qa(tmp_path / "nogold", rows, qrels=None))
    assert str(tmp_path / "nogold" / "qrels" / "test.tsv") in str(err.value) and "passage_id" in str(err.value)
    with caplog.at_level(logging.INFO, logger="magclip.rag"):  # passage_id present: used, and said so
        data = load_qa(write_qa(tmp_path / "pid", QA_ROWS, qrels=None))
    assert data.gold_source == "qa.jsonl passage_id" and data.gold == {"q1": ["d1"], "q2": ["d2"]}
    assert "passage_id" in caplog.text


def test_empty_and_malformed_qrels_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no judgements"):
        load_beir(write_beir(tmp_path / "empty", qrels=""))
    with pytest.raises(ValueError, match=r"test\.tsv:3: expected query-id"):
        load_beir(write_beir(tmp_path / "bad", qrels="q1\td1\t1\nq2 d2 1\n"))


# ---------------------------------------------------------------------------- query with no text
def test_query_without_text_is_dropped_and_counted(tmp_path, caplog):
    folder = write_beir(tmp_path / "toy", queries=[{"_id": "q1", "text": "where do cats sit"}, {"_id": "q2"}])
    with caplog.at_level(logging.WARNING, logger="magclip.data.beir"):
        data = load_beir(folder)
    assert data.warnings == {"queries_without_text": 1}
    assert list(data.queries) == ["q1"] and "q2" not in data.qrels       # not scored as a miss
    assert "1 judged queries have no text" in caplog.text and "q2" in caplog.text
    assert data.subset(1).warnings == data.warnings                      # the count survives subsetting
    blank = write_beir(tmp_path / "blank", queries=[{"_id": "q1", "text": "  "}, {"_id": "q2", "text": ""}])
    with pytest.raises(ValueError, match=r"none of the 2 queries .* has text, e.g. \['q1', 'q2'\]"):
        load_beir(blank)


def test_question_without_text_or_answer_is_dropped_and_counted(tmp_path, caplog):
    rows = [{"id": "q1", "question": "", "answers": ["sit"], "passage_id": "d1"},
            {"id": "q2", "question": "do dogs run", "answers": ["dogs"], "passage_id": "d2"},
            {"id": "q3", "question": "what?", "answers": ["The", "."]}]
    with caplog.at_level(logging.WARNING, logger="magclip.rag"):
        data = load_qa(write_qa(tmp_path / "toy", rows, qrels="q1\td1\t1\nq2\td2\t1\n"))
    assert list(data.questions) == ["q2"]
    assert data.warnings == {"questions_without_text": 1, "questions_without_answer": 1}
    assert "q1" in caplog.text and "q3" in caplog.text
    with pytest.raises(ValueError, match="occurs more than once"):
        load_qa(write_qa(tmp_path / "dup", [QA_ROWS[0], QA_ROWS[0]]))


# ---------------------------------------------------------------------------- qrels naming an unknown document
def test_qrels_naming_unknown_document_is_counted(tmp_path, caplog):
    folder = write_beir(tmp_path / "toy", qrels="q1\td1\t1\nq2\td2\t1\nq2\tghost\t1\nq1\tgone\t2\n"
                                                  "q3\tgone\t1\n", queries=None)
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in [
        {"_id": "q1", "text": "cats"}, {"_id": "q2", "text": "dogs"}, {"_id": "q3", "text": "birds"}]))
    with caplog.at_level(logging.WARNING, logger="magclip.data.beir"):
        data = load_beir(folder)
    assert data.warnings == {"qrels_unknown_docs": 3, "queries_without_known_relevant": 1}
    assert data.qrels["q2"] == {"d2": 1, "ghost": 1}                      # kept, as BEIR keeps them
    assert "ghost" in caplog.text and "1 queries have no relevant document" in caplog.text
    # what "kept" means downstream: a perfect run still misses the unknown documents
    run = {"q1": {"d1": 2.0}, "q2": {"d2": 2.0}, "q3": {"d1": 1.0}}
    assert evaluate_run(data.qrels, run, ["recall@10"])["recall@10"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    with pytest.raises(ValueError, match=r"none of the judged documents .* 'nope'"):
        load_beir(write_beir(tmp_path / "wrong", qrels="q1\tnope\t1\nq2\tnada\t1\n"))


def test_qa_gold_naming_unknown_passage_is_counted(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="magclip.rag"):
        data = load_qa(write_qa(tmp_path / "toy", QA_ROWS, qrels="q1\td1\t1\nq2\tghost\t1\nq9\td1\t1\n"))
    assert data.gold == {"q1": ["d1"], "q2": []} and list(data.questions) == ["q1", "q2"]
    assert data.warnings == {"qrels_unknown_questions": 1, "gold_disagrees_with_passage_id": 1,
                             "gold_unknown_passages": 1, "questions_without_gold": 1}
    assert "ghost" in caplog.text and "q9" in caplog.text
    with pytest.raises(ValueError, match=r"none of the gold passages .* 'nope'"):
        load_qa(write_qa(tmp_path / "wrong", QA_ROWS, qrels="q1\tnope\t1\nq2\tnada\t1\n"))


# ---------------------------------------------------------------------------- empty corpus
def test_empty_corpus_is_an_error_naming_it(tmp_path):
    folder = write_beir(tmp_path / "toy", docs=[])
    with pytest.raises(ValueError, match=r"corpus\.jsonl: empty corpus") as err:
        load_beir(folder)
    assert str(folder / "corpus.jsonl") in str(err.value)
    with pytest.raises(ValueError, match=r"corpus\.jsonl: empty corpus"):
        load_qa(write_qa(tmp_path / "qa", QA_ROWS, docs=[]))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "corpus.jsonl").write_text("\n\n")
    from magclip.data.qa import load_distractors
    with pytest.raises(ValueError, match="empty corpus"):
        load_distractors([tmp_path / "blank"])


# ---------------------------------------------------------------------------- cloned without its LFS files
@pytest.mark.parametrize("name", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_a_git_lfs_pointer_in_place_of_a_file_is_named(tmp_path, name):
    folder = write_beir(tmp_path / "toy")
    (folder / name).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 4096\n")
    with pytest.raises(ValueError, match=f"{folder / name} is a Git LFS pointer, not a BEIR file"):
        load_beir(folder, "test")
