"""Training pairs in the field's column names (issue 49, item 2).

A triplet file with sentence-transformers' `anchor`/`positive`/`negative` was read as records with an
empty query (all skipped) and the run died with a StopIteration; with `query`/`positive`/`negative` the
singular `negative` was ignored and random in-batch fills replaced it. Now the field's names are read,
records that name neither query nor positive are read by sentence-transformers' column order (checked
against its own data collator), the columns used are logged and reported, and files that cannot be
read are refused in one line naming the file.
"""

import json
import logging
from pathlib import Path

import pytest

from magclip.data.pairs import read_pairs, read_pairs_with_columns, record_columns

ROWS = [("what do cats sit on", "cats sit on mats", ["dogs run in parks", "fish swim"]),
        ("where is the brain", "the brain is in the head", ["genes are in cells", "the sky is blue"]),
        ("red or blue", "blue is a colour", ["seven is a number", "tea is a drink"])]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    """A table, the form in which sentence-transformers reads columns by their order."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def as_tuples(records) -> list[tuple[str, list[str], list[str]]]:
    return [(r.query, r.positives, r.negatives) for r in records]


@pytest.mark.parametrize("layout", ["triplet", "query_negative", "n_tuple", "negatives_list"])
def test_the_field_s_names_are_read(tmp_path, layout, caplog):
    def row(q, p, negs):
        return {"triplet": {"anchor": q, "positive": p, "negative": negs[0]},
                "query_negative": {"query": q, "positive": p, "negative": negs[0]},
                "n_tuple": {"anchor": q, "positive": p, **{f"negative_{i + 1}": n for i, n in enumerate(negs)}},
                "negatives_list": {"query": q, "positive": [p], "negatives": negs, "query_id": "x"}}[layout]

    path = write_jsonl(tmp_path / "pairs.jsonl", [row(*r) for r in ROWS])
    with caplog.at_level(logging.INFO, logger="magclip.data"):
        read = read_pairs_with_columns(path)
    single = layout in ("triplet", "query_negative")
    assert as_tuples(read.records) == [(q, [p], negs[:1] if single else negs) for q, p, negs in ROWS]
    assert not read.skipped
    [report] = read.columns
    description = {"triplet": "query<-anchor, positive<-positive, negatives<-negative",
                   "query_negative": "query<-query, positive<-positive, negatives<-negative",
                   "n_tuple": "query<-anchor, positive<-positive, negatives<-negative_1+negative_2",
                   "negatives_list": "query<-query, positive<-positive, negatives<-negatives"}[layout]
    assert report == {"file": str(path), "records": 3, "columns": {description: 3},
                      "ignored": ["query_id"] if layout == "negatives_list" else []}
    assert f"{path}: 3 records, columns {description} (3)" in caplog.text


def test_negatives_under_several_names_are_taken_together_once_each(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"query": "q", "positive": "p", "negatives": ["a", "b"],
                                                  "negative": "b", "negative_1": "c"}])
    [record], _ = read_pairs(path)
    assert record.negatives == ["a", "b", "c"]    # in the record's key order, each text once


def sentence_transformers_roles(row: dict) -> list[str]:
    """The columns sentence-transformers' own data collator feeds a loss, in order (anchor, positive, negatives...)."""
    collator_module = pytest.importorskip("sentence_transformers.sentence_transformer.data_collator")
    collator = collator_module.SentenceTransformerDataCollator(preprocess_fn=lambda inputs, **kwargs: {"x": inputs})
    return [key[:-len("_x")] for key in collator([{k: (0 if k in ("label", "score") else v) for k, v in row.items()}])
            if key.endswith("_x")]


@pytest.mark.parametrize("row", [
    {"query": "q", "answer": "p"},                                   # sentence-transformers/natural-questions
    {"question": "q", "answer": "p"},                                # gooaq
    {"sentence_a": "q", "sentence_b": "p", "label": 1},              # a label column is not a text
    {"premise": "q", "hypothesis": "p", "contradiction": "n", "score": 0.5},
    {"text": "q", "positive": "p", "hard_1": "n1", "hard_2": "n2", "dataset_name": "x"},
])
def test_records_without_both_names_are_read_in_sentence_transformers_order(tmp_path, row):
    path = write_parquet(tmp_path / "order.parquet", [row])
    read = read_pairs_with_columns(path)
    [record] = read.records
    roles = sentence_transformers_roles(row)   # the peer's reading of the same record
    assert record.query == row[roles[0]] and record.positives == [row[roles[1]]]
    assert record.negatives == [row[k] for k in roles[2:]]
    [description] = read.columns[0]["columns"]
    assert description.endswith("(by column order)") and description.startswith(f"query<-{roles[0]}, ")
    # a JSON record is never read by its key order (issue 61): the same record as a JSON line is refused
    jsonl = write_jsonl(tmp_path / "order.jsonl", [row])
    with pytest.raises(ValueError) as err:
        read_pairs(jsonl)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{jsonl}: record 1 (keys: ")
    assert "never by key order" in str(err.value) and "DPR biencoder JSON" in str(err.value)


def test_named_records_agree_with_sentence_transformers_order_where_it_holds():
    row = {"anchor": "q", "positive": "p", "negative_1": "n1", "negative_2": "n2"}
    columns = record_columns(row)
    assert [columns.query, columns.positive, *columns.negatives] == sentence_transformers_roles(row)


@pytest.mark.parametrize("row, expected", [
    ({"query": "q", "anchor": "a", "positive": "p"}, "both 'query' and 'anchor'"),
    ({"query": "q", "positive": "p", "positives": ["p2"]}, "both 'positive' and 'positives'"),
    ({"anchor": "q", "negative": "n"}, "column 'negative' in position 2"),
    ({"id": "7", "text": "q", "other": "p"}, "id-like column 'id'"),
    ({"question": "q", "answer": "p", "doc_id": "d"}, "id-like column 'doc_id'"),
])
def test_contradicting_columns_refuse_the_file_in_one_line(tmp_path, row, expected):
    path = write_parquet(tmp_path / "bad.parquet", [row])
    with pytest.raises(ValueError) as err:
        read_pairs(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: record 1 has ") and expected in message
    path = write_jsonl(tmp_path / "bad.jsonl", [{"query": "fine", "positive": "fine"}, row])
    with pytest.raises(ValueError) as err:
        read_pairs(path)
    message = str(err.value)
    named = expected.startswith("both")  # by name in JSON too; the rest would need the key order: no layout
    assert "\n" not in message and message.startswith(f"{path}: record 2 {'has ' if named else '(keys: '}")


def test_a_file_without_a_usable_record_is_refused_naming_its_keys(tmp_path):
    path = write_jsonl(tmp_path / "none.jsonl", [{"query": "", "positive": "p"}, {"anchor": "q", "positives": []}])
    with pytest.raises(ValueError) as err:
        read_pairs(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: no usable pair record")
    assert "keys found: query, positive, anchor, positives" in message and "'empty_query': 1" in message
    assert "'no_positive': 1" in message
    # one good file and one bad: the bad one is named
    good = write_jsonl(tmp_path / "good.jsonl", [{"anchor": "q", "positive": "p"}])
    with pytest.raises(ValueError, match=f"^{tmp_path / 'none.jsonl'}: no usable"):
        read_pairs(f"{good}::{path}")


def test_a_text_run_reports_its_columns_and_refuses_too_few_records(tmp_path):
    """The triplet file that used to end in a StopIteration traceback trains, with its negatives, and
    results.json says which columns were used; a file smaller than one step is refused before the run."""
    from builders import make_tiny_bert, toy_rows, write_toy_eval

    from magclip.config import ConfigError, load_text_config
    from magclip.training.text import train_text

    rows = toy_rows(16)
    triplets = write_jsonl(tmp_path / "triplets.jsonl", [
        {"anchor": r["query"], "positive": r["positive"], "negative": r["negatives"][0]} for r in rows])
    beir, _ = write_toy_eval(tmp_path, rows[:8])
    recipe = Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml"
    overrides = [f"model.name={make_tiny_bert(tmp_path / 'bert')}", "model.query_max_length=16",
                 "model.passage_max_length=24", "data.beir=null", "data.group_size=2",
                 f"output_dir={tmp_path / 'runs'}", "train.batch_size=4", "train.max_steps=1",
                 "train.warmup_steps=0", "eval.at_start=false", f"eval.beir={{toy: {beir}}}", "eval.sts={}",
                 "eval.rag={}", "eval.length_bins=0"]
    results = train_text(load_text_config(recipe, [*overrides, f"data.train={triplets}", "name=triplets"]))
    assert results["records"] == 16 and results["negative_shortfall"]["none_random_fill"] == 0
    assert results["train_columns"] == [{"file": str(triplets), "records": 16, "ignored": [], "columns": {
        "query<-anchor, positive<-positive, negatives<-negative": 16}}]
    saved = json.loads((tmp_path / "runs" / "triplets" / "results.json").read_text())
    assert saved["train_columns"] == results["train_columns"]
    few = write_jsonl(tmp_path / "few.jsonl", [{"anchor": r["query"], "positive": r["positive"]} for r in rows[:3]])
    with pytest.raises(ConfigError, match=r"3 usable training records, fewer than one step takes \(4 = "):
        train_text(load_text_config(recipe, [*overrides, f"data.train={few}", "name=few"]))
    assert not (tmp_path / "runs" / "few").exists()
