"""Mined negatives kept as ids alone (write_negative_ids) rebuild the very pairs they came from
(pairs_from_negative_ids), through the command too, and a file that does not fit the folder is refused
with the line that does not fit."""

import gzip
import json

import pytest
from builders import make_tiny_bert, toy_rows, write_toy_eval

from magclip.cli.train_text import main as train_text_main
from magclip.data.retrieval_folder import read_jsonl
from magclip.evaluation.mining import mine_hard_negatives, pairs_from_negative_ids, write_negative_ids
from magclip.models.text import BiEncoder


def test_the_ids_rebuild_the_mined_pairs(tmp_path):
    beir, _ = write_toy_eval(tmp_path, toy_rows(20, seed=3))
    mined = mine_hard_negatives(BiEncoder.from_pretrained(str(make_tiny_bert(tmp_path / "bert"))), beir, "test",
                                negatives=2, skip_top=1)
    ids = tmp_path / "mined.ids.jsonl.gz"
    write_negative_ids(mined, ids)
    assert pairs_from_negative_ids(beir, ids, "test") == mined
    out = tmp_path / "again.jsonl"
    train_text_main(["--make-pairs", str(out), "--beir", str(beir), "--split", "test", "--negatives-from", str(ids)])
    assert list(read_jsonl(out)) == mined


def test_ids_that_do_not_fit_the_folder_are_refused(tmp_path):
    beir, _ = write_toy_eval(tmp_path, toy_rows(6))
    bad = tmp_path / "bad.ids.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"query_id": "q0", "negative_ids": ["d1"]}\n'
                                  b'{"query_id": "q1", "negative_ids": ["d99"]}\n'))
    with pytest.raises(ValueError, match=r"bad.ids.jsonl.gz:2: documents \['d99'\] are not in"):
        pairs_from_negative_ids(beir, bad, "test")
    bad.write_bytes(gzip.compress(json.dumps({"query_id": "q42", "negative_ids": []}).encode() + b"\n"))
    with pytest.raises(ValueError, match="bad.ids.jsonl.gz:1: query 'q42' has no usable positive"):
        pairs_from_negative_ids(beir, bad, "test")
