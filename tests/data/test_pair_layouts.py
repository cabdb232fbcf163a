"""Training pairs in the retrieval field's own files, read as their tools read them (issue 61).

- MS MARCO's `triples.train.small.tsv` (no header) lost its first row to a guessed header; quotes in a TSV
  were CSV quoting (`"Hamlet" is a play` trained as `Hamlet is a play`, an unclosed quote merged rows).
  Now a TSV is split on tabs, line by line, as ir_datasets' TSV readers split MS MARCO's files.
- DPR's `nq-train.json` was read by key order (the query became `nq_train_psgs_w100`). Now it is read by
  DPR's names, with DPR's counts of queries, positives and hard negatives.
- tevatron's jsonl was refused. Now it is read by its names, with tevatron's counts.
"""

import json
import logging
import random

import pytest

from magclip.data.layouts import passage_text
from magclip.data.pairs import read_pairs, read_pairs_with_columns


def split_tsv(path) -> list[list[str]]:
    """ir_datasets' reading of MS MARCO's TSVs: each line stripped of its newline and split on tabs."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def test_ms_marco_triples_keep_every_row_and_every_quote(tmp_path, caplog):
    rows = [[f'"Hamlet" is a play {i}?', f"a play by Shakespeare {i}", f"a pig {i}"] for i in range(22)]
    rows.insert(5, ['an "open quote never closes', "its positive", "its negative"])
    rows.insert(9, ["commas, and 'single' quotes", 'he said "yes"', 'x"'])
    path = tmp_path / "triples.train.small.tsv"
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="magclip.data"):
        records, skipped = read_pairs(path)
    peer = split_tsv(path)
    assert len(records) == len(peer) == 24 and not skipped
    assert [(r.query, r.positives, r.negatives) for r in records] == [(q, [p], [n]) for q, p, n in peer]
    assert "read as MS MARCO triples" in caplog.text and "query<-1, positive<-2, negative<-3; 24 rows" in caplog.text


def test_a_tsv_with_a_named_header_is_read_by_name_and_a_line_of_another_width_is_counted(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text('anchor\tpositive\n"quoted" query\tits positive\none\ttwo\tthree\nq2\tp2\n')
    read = read_pairs_with_columns(path)
    assert [(r.query, r.positives) for r in read.records] == [('"quoted" query', ["its positive"]), ("q2", ["p2"])]
    assert dict(read.skipped) == {"bad_row": 1}


@pytest.mark.parametrize("first, expected", [
    ("1185869\t8841662\t4\n", "three ids"),                                  # MS MARCO qidpidtriples
    ("question\tanswer\thard\n", "looks like a header but names no pair layout"),
    ("a query\ta positive\n", "2 tab-separated columns, no header naming query and positive"),
])
def test_a_tsv_in_no_layout_is_refused_in_one_line(tmp_path, first, expected):
    path = tmp_path / "x.tsv"
    path.write_text(first + "more text\tand more\tand more\n")
    with pytest.raises(ValueError) as err:
        read_pairs(path)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{path}: ") and expected in str(err.value)


def ctx(rng, kind, i):
    return {"title": f"{kind} title {i}", "text": f"{kind} passage {i} {rng.random():.3f}", "score": 1.0,
            "title_score": 0, "passage_id": str(rng.randrange(10**6))}


def dpr_records(n=23, seed=0):
    """Records as DPR's nq-train.json holds them, key order as DPR writes it; one without `dataset`, one
    without positives (DPR's loader drops it)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        record = {"dataset": "nq_train_psgs_w100", "question": f"who wrote play {i}", "answers": [f"author {i}"],
                  "positive_ctxs": [ctx(rng, "pos", j) for j in range(rng.randint(1, 2))],
                  "negative_ctxs": [ctx(rng, "neg", j) for j in range(rng.randint(0, 3))],
                  "hard_negative_ctxs": [ctx(rng, "hard", j) for j in range(rng.randint(0, 4))]}
        records.append(record)
    del records[3]["dataset"]
    records[7]["positive_ctxs"] = []
    return records


def dpr_reading(records):
    """DPR's JsonQADataset: records without positive_ctxs dropped; BiEncoderSample's query, positive passages
    and hard negative passages (what DPR trains on with its defaults: hard negatives 1, other negatives 0)."""
    kept = [r for r in records if len(r["positive_ctxs"]) > 0]
    return [(r["question"], [passage_text(c) for c in r["positive_ctxs"]],
             [passage_text(c) for c in r.get("hard_negative_ctxs", [])]) for r in kept]


def test_dpr_json_is_read_by_its_names_with_dpr_s_counts(tmp_path):
    records = dpr_records()
    path = tmp_path / "nq-train.json"
    path.write_text(json.dumps(records, indent=4))
    read = read_pairs_with_columns(path)
    peer = dpr_reading(records)
    ours = [(r.query, r.positives, r.negatives) for r in read.records]
    assert ours == peer
    counts = (len(ours), sum(len(p) for _, p, _ in ours), sum(len(n) for *_, n in ours))
    assert counts == (len(peer), sum(len(p) for _, p, _ in peer), sum(len(n) for *_, n in peer))
    assert dict(read.skipped) == {"no_positive": 1}
    assert any("DPR" in description for description in read.columns[0]["columns"])


def test_tevatron_jsonl_is_read_by_its_names_with_tevatron_s_counts(tmp_path):
    rng = random.Random(1)
    rows = [{"query_id": str(i), "query": f"query {i}",
             "positive_passages": [{"docid": f"p{i}{j}", "title": "" if j else f"T{i}", "text": f"pos {i} {j}"}
                                   for j in range(rng.randint(1, 3))],
             "negative_passages": [{"docid": f"n{i}{j}", "title": f"N{j}", "text": f"neg {i} {j}"}
                                   for j in range(rng.randint(0, 5))]} for i in range(17)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, skipped = read_pairs(path)
    # tevatron's TrainDataset: group['query'], group['positive_passages'], group['negative_passages'], each
    # passage title + ' ' + text
    peer = [(r["query"], [passage_text(p) for p in r["positive_passages"]],
             [passage_text(p) for p in r["negative_passages"]]) for r in rows]
    assert [(r.query, r.positives, r.negatives) for r in records] == peer and not skipped
    assert records[0].positives[0] == "T0 pos 0 0"
