"""Training pairs from the files sentence-transformers users hold, read with `datasets` (issue 55, item 1).

A `save_to_disk` folder was refused ("no pair files found"), a `.parquet` file was read as JSON lines and
ended in a utf-8 decode error naming no file, a `.csv` was read as JSON lines (every row a bad row). Now
the same rows written by `datasets` as parquet, csv, tsv, json, jsonl, save_to_disk (a Dataset and a
DatasetDict) are read to the same records with the same columns and skip counts, and the columns
magclip reads in order are those sentence-transformers' own data collator feeds its loss.
"""

import json
import logging
import sys
from pathlib import Path

import pytest

from magclip.data.pairs import read_pairs, read_pairs_with_columns

datasets = pytest.importorskip("datasets")

NAMED = {"anchor": ["what do cats sit on", "where is the brain", "", "red or blue"],
         "positive": ["cats sit on mats", "the brain is in the head", "no query", "blue is a colour"],
         "negative": ["dogs run in parks", "genes are in cells", "x", "tea is a drink"]}
BY_ORDER = {"question": ["q one", "q two", "q three"], "answer": ["a one", "a two", "a three"],
            "hard": ["h one", "h two", "h three"], "label": [1, 0, 1]}


def write_all(table: dict, folder: Path) -> dict[str, Path]:
    """The same rows in every format `datasets` writes."""
    folder.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict(table)
    paths = {"jsonl": folder / "t.jsonl", "parquet": folder / "t.parquet", "csv": folder / "t.csv",
             "tsv": folder / "t.tsv", "json_array": folder / "array.json", "jsonl_gz": folder / "t.jsonl.gz",
             "saved": folder / "saved", "saved_dict": folder / "saved_dict"}
    ds.to_json(str(paths["jsonl"]))
    ds.to_json(str(paths["jsonl_gz"]), compression="gzip")
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.to_csv(str(paths["tsv"]), index=False, sep="\t")
    paths["json_array"].write_text(json.dumps(ds.to_list()))
    ds.save_to_disk(str(paths["saved"]))
    datasets.DatasetDict({"train": ds, "dev": ds.select([0])}).save_to_disk(str(paths["saved_dict"]))
    return paths


def as_tuples(records):
    return [(r.query, r.positives, r.negatives) for r in records]


def collator_roles(columns: list[str]) -> list[str]:
    """The columns sentence-transformers' trainer feeds its loss, in order, for a dataset with `columns`."""
    collator_module = pytest.importorskip("sentence_transformers.sentence_transformer.data_collator")
    collator = collator_module.SentenceTransformerDataCollator(preprocess_fn=lambda inputs, **kwargs: {"x": inputs})
    row = {c: (0 if c in ("label", "score") else "t") for c in columns}
    return [key[:-len("_x")] for key in collator([row]) if key.endswith("_x")]


@pytest.mark.parametrize("table", [NAMED, BY_ORDER], ids=["named", "by_order"])
def test_every_format_reads_the_same_pairs_as_sentence_transformers_sees_them(tmp_path, table):
    paths = write_all(table, tmp_path)
    if table is BY_ORDER:  # only a table is read by column order; a JSON record or a TSV line never (issue 61)
        for kind in ("jsonl", "jsonl_gz", "json_array", "tsv"):
            with pytest.raises(ValueError, match="matches no pairs layout read"):
                read_pairs(paths.pop(kind))
    reads = {kind: read_pairs_with_columns(path) for kind, path in paths.items()}
    reference = reads["parquet"]
    assert len(reference.records) == len(table["positive" if "positive" in table else "answer"]) - (table is NAMED)
    for kind, read in reads.items():
        assert as_tuples(read.records) == as_tuples(reference.records), kind
        assert read.skipped == reference.skipped, kind
        assert read.columns[0]["columns"] == reference.columns[0]["columns"], kind
    if table is NAMED:
        assert dict(reference.skipped) == {"empty_query": 1}
    # what the trainer sees: the dataset as a sentence-transformers user loads each file
    loaded = {"parquet": datasets.load_dataset("parquet", data_files=str(paths["parquet"]), split="train"),
              "csv": datasets.load_dataset("csv", data_files=str(paths["csv"]), split="train"),
              "saved": datasets.load_from_disk(str(paths["saved"])),
              "saved_dict": datasets.load_from_disk(str(paths["saved_dict"]))["train"]}
    [description] = reference.columns[0]["columns"]
    for kind, ds in loaded.items():
        roles = collator_roles(ds.column_names)
        expected = f"query<-{roles[0]}, positive<-{roles[1]}, negatives<-{'+'.join(roles[2:])}"
        assert description.startswith(expected), (kind, description, roles)


def test_a_dataset_dict_is_read_at_its_split_or_refused_naming_its_splits(tmp_path, caplog):
    paths = write_all(NAMED, tmp_path)
    with caplog.at_level(logging.WARNING, logger="magclip.data"):
        assert len(read_pairs(paths["saved_dict"], split="dev")[0]) == 1
    # the split read and the ones left, each with its rows (issue 61: the other split went unnamed)
    assert "a DatasetDict; its split 'dev' is read (1 rows), not 'train' (4 rows)" in caplog.text
    with pytest.raises(ValueError) as err:
        read_pairs(paths["saved_dict"], split="validation")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{paths['saved_dict']}: a DatasetDict without the split")
    assert "its splits: train, dev" in message and "data.train_split" in message
    # a folder of files and saved datasets: each read, sorted
    records, _ = read_pairs(tmp_path)
    assert len(records) == 3 * 8    # 6 files of 3 usable rows, then saved/ and saved_dict/ (its train split)


@pytest.mark.parametrize("name, content", [("pairs.txt", b"anchor\tpositive\n"), ("pairs.xlsx", b"PK\x03\x04"),
                                           ("bad.parquet", "é not parquet".encode("latin-1") * 40),
                                           ("bad.csv", b"a,b\n\"unterminated,x\n1,2,3,4,5\n")])
def test_unreadable_files_are_refused_in_one_line_naming_the_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        read_pairs(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    if name.endswith((".txt", ".xlsx")):
        assert "it reads a datasets save_to_disk folder" in message and ".parquet" in message


def test_the_training_command_refuses_an_unreadable_table_with_exit_2(tmp_path, monkeypatch, capsys):
    from magclip.cli.train_text import console

    bad = tmp_path / "train.parquet"
    bad.write_bytes("é not parquet".encode("latin-1") * 40)
    recipe = Path(__file__).resolve().parents[2] / "configs" / "text" / "scifact.yaml"
    monkeypatch.setattr(sys, "argv", ["magclip-train-text", "--config", str(recipe), f"data.train={bad}",
                                      "data.beir=null", f"output_dir={tmp_path / 'runs'}", "eval.beir={}",
                                      "eval.sts={}", "eval.rag={}"])
    with pytest.raises(SystemExit) as stop:
        console()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.startswith(f"error: {bad}: not a readable parquet file")
