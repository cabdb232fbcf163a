"""Where a retrieval folder keeps its corpus, queries and judgements, in each of the field's folder layouts.

- BEIR: `corpus.jsonl`, `queries.jsonl`, `qrels/SPLIT.tsv`; its hub copies gzip the two JSON lines files
  (`corpus.jsonl.gz`, `queries.jsonl.gz`), read the same.
- MTEB's hub layout: parquet files under `corpus/` and `queries/` (or `corpus.parquet`, `queries.parquet`)
  with BEIR's columns (`_id` or `id`, `title`, `text`), and the qrels at `qrels/SPLIT.parquet` or
  `qrels|data|default/SPLIT-*.parquet` (`query-id`, `corpus-id`, `score`), read by column name.
- MS MARCO passage: `collection.tsv` (pid, passage), `queries.SPLIT.tsv` or `queries.tsv` (qid, text) and
  TREC qrels `qrels.SPLIT.tsv` (split `dev.small` finds `qrels.dev.small.tsv` and `queries.dev.small.tsv`),
  unquoted TSVs read by MS MARCO's positions as ir_datasets reads them, said at WARNING. A passage has no
  title, as in BEIR's own msmarco conversion.

Each role is looked up on its own, so a folder may mix forms; a role found in two forms is refused (which
one is meant is not known), and a missing one is refused naming what was looked for and the layouts read.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from magclip.data.layouts import CORPUS_MSMARCO, QUERIES_MSMARCO, announce, names_of, no_layout
from magclip.data.qrels import QrelsRead, read_qrels_file, read_qrels_table
from magclip.io import is_lfs_pointer, lfs_pointer_error

QRELS_FOLDERS = ("qrels", "data", "default")


def _only(folder: Path, role: str, forms: list[list[Path]]) -> list[Path]:
    """The files of the one form present of a role (a form: one file, or a folder's parquet parts)."""
    present = [files for files in forms if files]
    if len(present) > 1:
        names = ", ".join(str(files[0].relative_to(folder)) for files in present)
        raise ValueError(f"{folder}: the {role} is there in more than one form ({names}); which one is meant "
                         "is not known: keep one")
    return present[0] if present else []


def _file(path: Path) -> list[Path]:
    return [path] if path.is_file() else []


def _parts(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern)) if folder.is_dir() else []


def corpus_files(folder: Path) -> list[Path]:
    """The corpus file(s): corpus.jsonl(.gz), corpus.parquet, corpus/*.parquet or collection.tsv."""
    forms = [_file(folder / n) for n in ("corpus.jsonl", "corpus.jsonl.gz", "corpus.parquet", "collection.tsv")]
    return _only(folder, "corpus", forms + [_parts(folder / "corpus", "*.parquet")])


def queries_files(folder: Path, split: str | None) -> list[Path]:
    """queries.jsonl(.gz), queries.parquet, queries/*.parquet, or MS MARCO's queries.SPLIT.tsv (else queries.tsv)."""
    forms = [_file(folder / n) for n in ("queries.jsonl", "queries.jsonl.gz", "queries.parquet")]
    tsv = _file(folder / f"queries.{split}.tsv") if split else []
    forms.append(tsv or _file(folder / "queries.tsv"))
    return _only(folder, "queries", forms + [_parts(folder / "queries", "*.parquet")])


def qrels_files(folder: Path, split: str) -> list[Path]:
    """qrels/SPLIT.tsv (BEIR), qrels.SPLIT.tsv (MS MARCO, TREC) or SPLIT parquet part(s) (MTEB)."""
    forms = [_file(folder / "qrels" / f"{split}.tsv"), _file(folder / f"qrels.{split}.tsv")]
    forms += [_parts(folder / d, f"{split}.parquet") + _parts(folder / d, f"{split}-*.parquet") for d in QRELS_FOLDERS]
    return _only(folder, f"qrels of split {split!r}", forms)


def splits_found(folder: Path) -> list[str]:
    """The splits a folder judges, for a refusal."""
    names = {p.stem for p in (folder / "qrels").glob("*.tsv")} | {p.name[len("qrels."):-len(".tsv")]
                                                                  for p in folder.glob("qrels.*.tsv")}
    names |= {p.stem.split("-")[0] for d in QRELS_FOLDERS for p in (folder / d).glob("*.parquet")}
    return sorted(names)


def check_folder(folder: str | Path, split: str) -> tuple[list[Path], list[Path], list[Path]]:
    """(corpus, queries, qrels) files, or a FileNotFoundError naming what the folder lacks."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"BEIR folder not found: {folder}")
    found = (corpus_files(folder), queries_files(folder, split), qrels_files(folder, split))
    for role, files, looked in zip(("corpus", "queries", f"qrels of split {split!r}"), found, (
            f"{folder / 'corpus.jsonl'}, corpus.jsonl.gz, corpus.parquet, corpus/*.parquet, collection.tsv",
            f"{folder / 'queries.jsonl'}, queries.jsonl.gz, queries.parquet, queries/*.parquet, queries.{split}.tsv, queries.tsv",
            f"{folder / 'qrels' / (split + '.tsv')}, qrels.{split}.tsv, {{qrels,data,default}}/{split}(-*).parquet"), strict=True):
        if not files:
            splits = splits_found(folder) if role.startswith("qrels") else []
            raise FileNotFoundError(f"{folder} is not a retrieval folder with split {split!r}: no {role} "
                                    f"({looked}){f'; splits found: {chr(44).join(splits)}' if splits else ''}; "
                                    f"layouts read: {names_of('folder')}")
    return found


def _refuse_lfs_pointer(path: Path) -> None:
    if is_lfs_pointer(path):
        raise lfs_pointer_error(path, "a BEIR file")


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """JSON lines, gzipped or not (a hub copy's corpus.jsonl.gz); a broken line is refused naming it."""
    _refuse_lfs_pointer(Path(path))
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None


def _parquet_rows(path: Path, kind: str, needed: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    _refuse_lfs_pointer(path)
    table = pq.ParquetFile(path)
    columns = table.schema_arrow.names
    id_column = "_id" if "_id" in columns else "id" if "id" in columns else None
    if id_column is None or not set(needed) <= set(columns):
        raise no_layout(path, kind, f"a table with the columns {columns}")
    for batch in table.iter_batches(batch_size=4096):
        data = batch.to_pydict()
        for i in range(batch.num_rows):
            yield {"_id": data[id_column][i], **{c: data[c][i] for c in ("title", "text") if c in data}}


def _tsv_rows(path: Path, layout, names: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """MS MARCO's unquoted two-column TSV (id, text), by position; announced once with the row count."""
    _refuse_lfs_pointer(path)
    rows = 0
    with open(path, encoding="utf-8", newline="") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise no_layout(path, layout.kind, f"line {number} ({len(fields)} tab-separated columns)")
            rows += 1
            yield {"_id": fields[0], "text": fields[1]}
    announce(path, layout, f"{names[0]}<-1, {names[1]}<-2", rows)


def rows(files: list[Path], kind: str) -> Iterator[dict[str, Any]]:
    """Records {_id, title?, text} of a corpus or queries, whatever the layout of its files."""
    for path in files:
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            yield from read_jsonl(path)
        elif path.suffix == ".parquet":
            yield from _parquet_rows(path, kind, ("text",))
        elif kind == "corpus":
            yield from _tsv_rows(path, CORPUS_MSMARCO, ("pid", "passage"))
        else:
            yield from _tsv_rows(path, QUERIES_MSMARCO, ("qid", "query"))


def read_qrels_files(files: list[Path]) -> QrelsRead:
    """The judgements of one split, from its TSV (BEIR or TREC) or its parquet part(s)."""
    if files[0].suffix != ".parquet":
        return read_qrels_file(files[0])
    read = QrelsRead()
    for path in files:
        read_qrels_table(path, read)
    return read
