"""Training tables in the files sentence-transformers users hold, read with the `datasets` library.

sentence-transformers trains from a `datasets.Dataset`, and its users keep their data as the hub does:
a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or `.parquet`, `.csv`, `.tsv`
and `.json` files (`.gz` compressed or not). Each is read here by `datasets` itself, so a row is what
sentence-transformers' trainer would see: the columns in the table's order, a missing cell as None.
`table_rows` yields the rows as dicts; `magclip.data.pairs` applies its column rules to them, as to a
JSON line.

JSON lines (`.jsonl`, and a `.json` file whose first character opens an object) stay with the line
reader of `magclip.data.pairs`: `datasets` refuses a whole file for one broken line, where a long run
skips that line and counts it. A `.json` file holding one array of records (DPR's nq-train.json) is read
with `json.load`, as DPR reads it, and a `.tsv` by magclip/data/tsv_pairs.py (unquoted, as MS MARCO's);
a JSON record is read by its names, never by its key order.

A DatasetDict folder is read at its `split` (data.train_split; the other splits are named at WARNING,
with their row counts) or refused in one line listing its splits; a file in no format read here, or one `datasets` cannot read, is refused in one line naming
the file (ValueError).
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# file name ending -> the `datasets` builder that reads it
TABLE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".csv.gz": "csv", ".tsv.gz": "csv",
                  ".json": "json", ".json.gz": "json"}
JSON_LINES = (".jsonl", ".jsonl.gz")
SHARDS = (".tar",)
PAIR_FILE_ENDINGS = (*JSON_LINES, *SHARDS, *TABLE_BUILDERS)
FORMATS_READ = ("a datasets save_to_disk folder (Dataset or DatasetDict), .parquet, .csv, .tsv, .json, .jsonl "
                "(.gz), webdataset .tar shards of KEY.json records, or a folder of these")
ROWS_PER_BATCH = 1024
log = logging.getLogger("magclip.data")


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json + dataset_info.json) or `DatasetDict.save_to_disk`."""
    return (folder / "dataset_dict.json").is_file() or \
        ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def is_pair_file(path: Path) -> bool:
    return path.name.endswith(PAIR_FILE_ENDINGS)


def _json_head(path: Path) -> str:
    """The first non-blank character of a .json(.gz) file ("" for another ending): "{" opens JSON lines, "[" an array."""
    if not path.name.endswith((".json", ".json.gz")):
        return ""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read(4096).lstrip()[:1]


def is_json_lines(path: Path) -> bool:
    """JSON lines by name (.jsonl) or by content (a .json file whose first character opens an object)."""
    return path.name.endswith(JSON_LINES) or _json_head(path) == "{"


def is_json_array(path: Path) -> bool:
    """A .json file holding one array of records (DPR's nq-train.json), read with `json.load` by name."""
    return _json_head(path) == "["


def refuse_format(path: Path) -> ValueError:
    return ValueError(f"{path}: not a training file format magclip reads; it reads {FORMATS_READ}")


def load_table(path: Path, split: str = "train"):
    """The `datasets.Dataset` of a save_to_disk folder (a DatasetDict at `split`) or of a table file."""
    import datasets

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path}: a DatasetDict without the split {split!r} (its splits: "
                                 f"{', '.join(loaded)}); set data.train_split to one of them")
            others = [name for name in loaded if name != split]
            if others:
                log.warning("%s: a DatasetDict; its split %r is read (%d rows), not %s (data.train_split picks "
                            "another)", path, split, len(loaded[split]),
                            ", ".join(f"{name!r} ({len(loaded[name])} rows)" for name in others))
            return loaded[split]
        return loaded
    builder = next((b for ending, b in TABLE_BUILDERS.items() if path.name.endswith(ending)), None)
    if builder is None:
        raise refuse_format(path)
    extra: dict[str, Any] = {"delimiter": "\t"} if ".tsv" in path.name else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
    except Exception as exn:  # noqa: BLE001 (pyarrow / pandas / json errors of many kinds, none naming the file)
        first = " ".join(str(exn).split())[:300]
        raise ValueError(f"{path}: not a readable {builder} file ({type(exn).__name__}: {first})") from None


def table_rows(path: Path, split: str = "train") -> Iterator[dict[str, Any]]:
    """The rows of a table as dicts, in the table's column order (read in batches: a row at a time is slow)."""
    table = load_table(path, split)
    columns = table.column_names
    for batch in table.iter(batch_size=ROWS_PER_BATCH):
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield {c: batch[c][i] for c in columns}
