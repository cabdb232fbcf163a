"""Caption tables as the field's tools write them (open_clip's tab-separated .csv, quoted captions, a BOM,
Excel's Latin-1) read by make_shards as pandas.read_csv — and so open_clip's CsvDataset — reads them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest
from builders import ROOT, png

from magclip.cli.make_shards import main as make_shards
from magclip.data.convert import convert_to_shards, open_table, parse_separator

CAPTIONS = [
    "a plain caption",
    "a caption with a\ttab inside",
    "a caption with a comma, and a semicolon; too",
    'a "quoted" word',
    "a caption over\ntwo lines",
    "ünïcødé café 🐱",
]


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(len(CAPTIONS)):
        (folder / f"img{i}.png").write_bytes(png(i))
    return folder


def shard_rows(out: Path, image_column: str = "file") -> list[tuple[str, str]]:
    """(image path, caption) of every sample, in the order written: each KEY.json's path, KEY.txt."""
    rows = []
    for name in json.loads((out / "sizes.json").read_text()):
        with tarfile.open(out / name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for key in sorted({n.split(".")[0] for n in members}):
            meta = json.loads(members[f"{key}.json"])
            rows.append((meta[image_column], members[f"{key}.txt"].decode("utf-8")))
    return rows


def pandas_rows(table: Path, sep: str, image_column: str = "file", caption_column: str = "caption",
                **kwargs) -> list[tuple[str, str]]:
    """The peer reading: pandas.read_csv as open_clip's CsvDataset calls it, values kept as text."""
    frame = pd.read_csv(table, sep=sep, dtype=str, keep_default_na=False, **kwargs)
    return list(zip(frame[image_column], frame[caption_column]))


def write_table(path: Path, header: list[str], rows: list[tuple[str, str]], delimiter: str,
                encoding: str = "utf-8", lineterminator: str = "\n") -> Path:
    with open(path, "w", newline="", encoding=encoding) as f:
        writer = csv.writer(f, delimiter=delimiter, lineterminator=lineterminator)
        writer.writerow(header)
        writer.writerows(rows)
    return path


ROWS = [(f"img{i}.png", caption) for i, caption in enumerate(CAPTIONS)]


@pytest.mark.parametrize("name, delimiter, encoding, lineterminator", [
    ("quoted.tsv", "\t", "utf-8", "\n"),          # a tab and a newline inside quoted captions
    ("quoted.csv", ",", "utf-8", "\r\n"),         # Windows line ends, quoted commas
    ("bom.csv", ",", "utf-8-sig", "\n"),          # Excel's "CSV UTF-8": a byte-order mark
    ("semicolon.csv", ";", "utf-8", "\n"),        # a European Excel
])
def test_captions_equal_pandas(tmp_path: Path, images: Path, name: str, delimiter: str, encoding: str,
                               lineterminator: str) -> None:
    table = write_table(tmp_path / name, ["file", "caption", "source"],
                        [(f, c, "test") for f, c in ROWS], delimiter, encoding, lineterminator)
    result = convert_to_shards(images, table, tmp_path / "out", shard_size=4, quiet=True)
    expected = pandas_rows(table, delimiter)
    assert len(expected) == len(CAPTIONS)
    assert shard_rows(tmp_path / "out") == expected
    assert result["written"] == len(CAPTIONS) and result["skipped"] == {} and result["multiline"] == 1


def test_open_clip_tab_separated_csv(tmp_path: Path, images: Path) -> None:
    """open_clip's own table: a .csv separated by tabs with `filepath` and `title`, as pandas writes it
    (`to_csv(sep="\\t")`) and open_clip's CsvDataset reads it; the separator and columns are found alone."""
    from open_clip_train.data import CsvDataset

    frame = pd.DataFrame({"filepath": [str(images / f) for f, _ in ROWS], "title": CAPTIONS})
    table = tmp_path / "train.csv"
    frame.to_csv(table, sep="\t", index=False)
    convert_to_shards(tmp_path, table, tmp_path / "out", quiet=True)
    peer = CsvDataset(str(table), None, img_key="filepath", caption_key="title", sep="\t")
    assert shard_rows(tmp_path / "out", "filepath") == list(zip(peer.images, peer.captions))

    make_shards([str(tmp_path), str(table), str(tmp_path / "cli"), "--separator", "\\t"])  # as a shell passes "\t"
    assert shard_rows(tmp_path / "cli", "filepath") == list(zip(peer.images, peer.captions))


def test_malformed_lines_are_skipped_and_counted_by_line(tmp_path: Path, images: Path, caplog) -> None:
    """A hand-written TSV: an unquoted tab in a caption (3 fields) and an unquoted newline (a line of one
    field) are malformed, not a truncated caption or an 'empty caption'; blank lines are no rows."""
    table = tmp_path / "hand.tsv"
    table.write_text("file\tcaption\n"
                     "img0.png\ta plain caption\n"
                     "\n"
                     "img1.png\ta tab\tunquoted\n"         # line 4
                     "img2.png\tline one\n"
                     "line two\n"                          # line 6
                     "img3.png\t\"quoted\nnewline\"\n"     # lines 7-8: one good row
                     "   \n"
                     "img4.png\tlast\n")
    caplog.set_level("INFO", "magclip.data")
    result = convert_to_shards(images, table, tmp_path / "out", quiet=True)
    assert result["skipped"] == {"malformed": 2}
    assert result["skipped_lines"] == {"malformed": ["4", "6"]}
    assert result["multiline"] == 1
    # pandas pads a short row and can skip a long one: the rows it reads whole are the ones written
    whole = [(f, c) for f, c in pandas_rows(table, "\t", on_bad_lines="skip") if c]
    assert shard_rows(tmp_path / "out") == whole
    assert any("line 4 skipped (malformed)" in r.getMessage() for r in caplog.records)
    assert any("tab-separated (sniffed" in r.getMessage() for r in caplog.records)


def test_latin1_named_by_line_and_read_with_encoding(tmp_path: Path, images: Path) -> None:
    table = write_table(tmp_path / "excel.csv", ["file", "caption"],
                        [("img0.png", "plain"), ("img1.png", "café crème")], ",", "latin-1")
    with pytest.raises(ValueError, match=r"excel\.csv: line 3: bytes b'\\xe9' are not valid UTF-8.*--encoding"):
        convert_to_shards(images, table, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()
    convert_to_shards(images, table, tmp_path / "out", encoding="latin-1", quiet=True)
    assert shard_rows(tmp_path / "out") == pandas_rows(table, ",", encoding="latin-1")


def test_unclosed_quote_is_refused_like_pandas(tmp_path: Path, images: Path) -> None:
    table = tmp_path / "q.csv"
    table.write_text('file,caption\nimg0.png,fine\nimg1.png,"never closed\nimg2.png,swallowed\n')
    with pytest.raises(pd.errors.ParserError, match="EOF inside string"):
        pd.read_csv(table)
    with pytest.raises(ValueError, match=r"q\.csv: line 3: a quote opened on this line is never closed"):
        convert_to_shards(images, table, tmp_path / "out", quiet=True)


@pytest.mark.parametrize("header, given, expected", [
    ("file,caption", {}, ("file", "caption")),
    ("filepath,title", {}, ("filepath", "title")),
    ("id,filepath,caption", {}, ("filepath", "caption")),
    ("path,text", {"image_column": "path", "caption_column": "text"}, ("path", "text")),
    ("file\tcaption", {"image_column": "file"}, ("file", "caption")),
])
def test_columns_and_separator_found(tmp_path: Path, header: str, given: dict, expected: tuple) -> None:
    table = tmp_path / "t.txt"
    table.write_text(header + "\n")
    found = open_table(table, **given)
    assert (found.image_column, found.caption_column) == expected
    assert found.separator == ("\t" if "\t" in header else ",")


@pytest.mark.parametrize("header, given, message", [
    ("path,text", {}, (r"t\.csv: no image column \('file' or 'filepath'; --image-column NAME names it\); no "
                       r"caption column .*--caption-column.*split on comma .*\['path', 'text'\]")),
    ("file,filepath,caption", {}, r"both 'file' and 'filepath' could be the image column"),
    ("file,caption", {"caption_column": "text"}, r"no caption column 'text' \(--caption-column\)"),
    ("file,caption", {"separator": "\t"}, r"split on tab \(--separator\).*\['file,caption'\]"),
])
def test_header_without_the_columns_is_one_line(tmp_path: Path, header: str, given: dict, message: str) -> None:
    table = tmp_path / "t.csv"
    table.write_text(header + "\nx,y,z\n")
    with pytest.raises(ValueError, match=message) as info:
        open_table(table, **given)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, expected", [("\\t", "\t"), ("\t", "\t"), ("tab", "\t"), ("TAB", "\t"),
                                            (",", ","), ("comma", ","), (";", ";"), ("|", "|")])
def test_separator_option(text: str, expected: str) -> None:
    assert parse_separator(text) == expected


@pytest.mark.parametrize("text", ["", "xx", '"', "\\n"])
def test_bad_separator_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--separator"):
        parse_separator(text)


def test_command_refuses_latin1_in_one_line(tmp_path: Path, images: Path) -> None:
    table = write_table(tmp_path / "excel.csv", ["file", "caption"], [("img1.png", "café")], ",", "latin-1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_shards.py"), str(images), str(table),
                           str(tmp_path / "out")], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {table}: line 2: ") and "--encoding" in lines[0]
