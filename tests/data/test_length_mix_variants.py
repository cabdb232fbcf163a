"""The length-mixing variants: shares, nested seeded choices, short forms, queries and qrels untouched, the record."""

import json
from pathlib import Path

import pytest

from magclip.data.beir import doc_text, load_beir, read_corpus
from magclip.data.length_mix import (
    first_sentence,
    has_own_titles,
    replaced_ids,
    short_forms,
    write_variants,
)


def write_beir(folder: Path, docs: list[dict]) -> Path:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"query {i}"}) + "\n"
                                                  for i in range(4)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td0\t1\nq1\td3\t2\nq2\td5\t1\n")
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq3\td1\t1\n")
    return folder


def titled(n: int = 20) -> list[dict]:
    return [{"_id": f"d{i}", "title": f"title number {i}",
             "text": f"First sentence of document {i} here. A second one follows it. And a third."} for i in range(n)]


def test_first_sentence_rule():
    assert first_sentence("Short. Then the first real sentence ends here. More.") == \
        "Short. Then the first real sentence ends here."       # an end that closes < 4 words does not count
    assert first_sentence("We used e.g. four words here. Next.") == "We used e.g. four words here."
    assert first_sentence("lower case style sentence ends here . next one .") == "lower case style sentence ends here ."
    assert first_sentence("no end at all") == "no end at all"
    assert first_sentence('He said "it works well now." Then more.') == 'He said "it works well now."'


def test_title_rule_needs_titles_of_their_own():
    corpus = {d["_id"]: d for d in titled()}
    assert has_own_titles(corpus)
    shorts, rules = short_forms(corpus)
    assert shorts["d3"] == {"title": "title number 3", "text": ""} and set(rules.values()) == {"title"}
    shared = {i: {**d, "title": "One_Article"} for i, d in corpus.items()}   # XQuAD-like: one title, many records
    assert not has_own_titles(shared)
    shorts, rules = short_forms(shared)
    assert shorts["d3"] == {"title": "One_Article", "text": "First sentence of document 3 here."}
    assert set(rules.values()) == {"first_sentence"}


def test_choice_is_seeded_nested_and_sized():
    ids = [f"d{i}" for i in range(40)]
    assert replaced_ids(ids, 0.25, 3) == replaced_ids(ids, 0.25, 3)
    assert replaced_ids(ids, 0.25, 3) != replaced_ids(ids, 0.25, 4)
    assert [len(replaced_ids(ids, p, 0)) for p in (0, 0.25, 0.5, 0.75)] == [0, 10, 20, 30]
    assert set(replaced_ids(ids, 0.25, 1)) <= set(replaced_ids(ids, 0.5, 1)) <= set(replaced_ids(ids, 0.75, 1))
    with pytest.raises(ValueError, match="share"):
        replaced_ids(ids, 1.5, 0)


def test_variants_on_disk(tmp_path):
    docs = titled()
    docs[7] = {"_id": "d7", "title": "", "text": "only one sentence in this record."}   # no title: first sentence = whole
    source = write_beir(tmp_path / "toy", docs)
    manifest = write_variants(source, tmp_path / "out", shares=(0, 0.5), seeds=(0, 1, 2))
    root = tmp_path / "out" / "toy"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["p=0", "p=0.5,seed=0", "p=0.5,seed=1",
                                                                     "p=0.5,seed=2"]
    assert manifest["short_forms"]["short_is_whole"] == 1 and manifest["short_forms"]["short_is_whole_ids"] == ["d7"]
    assert json.loads((root / "length_mix.json").read_text()) == json.loads(json.dumps(manifest))
    original = read_corpus(source)
    assert read_corpus(root / "p=0") == original
    for seed in (0, 1, 2):
        v = root / f"p=0.5,seed={seed}"
        for name in ("queries.jsonl", "qrels/test.tsv", "qrels/train.tsv"):
            assert (v / name).read_bytes() == (source / name).read_bytes()
        corpus = read_corpus(v)
        assert list(corpus) == list(original)
        record = [json.loads(line) for line in (v / "replaced.jsonl").read_text().splitlines()]
        assert [r["_id"] for r in record] == replaced_ids(list(original), 0.5, seed)
        assert len(record) == 10 == manifest["variants"][f"p=0.5,seed={seed}"]["replaced"]
        changed = {i for i in corpus if corpus[i] != original[i]}
        assert changed == {r["_id"] for r in record} - {"d7"}
        for r in record:
            assert r["full_words"] == len(doc_text(original[r["_id"]]).split())
            assert r["short_words"] == len(doc_text(corpus[r["_id"]]).split()) < r["full_words"] or r["short_is_whole"]
        assert load_beir(v, "test").qrels == load_beir(source, "test").qrels
    choices = [json.loads((root / f"p=0.5,seed={s}" / "replaced.jsonl").read_text().splitlines()[0])["_id"]
               for s in (0, 1, 2)]
    assert len(set(choices)) > 1   # the seeds choose differently


def test_relevance_aware_choice_draws_each_class_at_its_own_share_nested():
    from magclip.data.length_mix import relevant_ids, replaced_ids_by_relevance

    ids = [f"d{i}" for i in range(40)]
    relevant = relevant_ids({"q0": {"d0": 1, "d3": 2, "d9": 0}, "q1": {"d5": 1, "d7": 1, "d11": 1, "d13": 1,
                                                                        "d17": 1, "d19": 1, "d21": 1}})
    assert relevant == {"d0", "d3", "d5", "d7", "d11", "d13", "d17", "d19", "d21"} and "d9" not in relevant
    chosen = replaced_ids_by_relevance(ids, relevant, 0.5, 0.0, seed=3)
    assert len(chosen) == round(0.5 * 31) and not set(chosen) & relevant
    both = replaced_ids_by_relevance(ids, relevant, 0.5, 1 / 3, seed=3)
    assert set(chosen) < set(both) and len(set(both) & relevant) == 3
    more = replaced_ids_by_relevance(ids, relevant, 0.75, 1 / 3, seed=3)
    assert set(both) < set(more) and set(more) & relevant == set(both) & relevant   # nested; the other class fixed
    assert replaced_ids_by_relevance(ids, relevant, 0.5, 1 / 3, seed=4) != both
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        replaced_ids_by_relevance(ids, relevant, 0.5, 1.5, seed=0)
