"""Relevance judgements in the field's layouts (magclip/data/layouts.py), recognised by their signature.

- BEIR's `qrels/SPLIT.tsv`: three tab-separated columns under the header `query-id corpus-id score`, read
  by name; without the header, by BEIR's positions (query-id, corpus-id, score), said at WARNING.
- TREC qrels, as MS MARCO ships `qrels.dev.small.tsv`: four columns split on tabs or spaces (query-id,
  iteration, doc-id, relevance), as pytrec_eval's `parse_qrel` and ir_datasets' `TrecQrels` read them
  (`line.split()`); the iteration is ignored. Said at WARNING with the mapping and the row count.
- MTEB's qrels parquet: the columns `query-id`, `corpus-id`, `score` by name.

The first line decides the layout (its column count, or the BEIR header's names); every later line must
have the same count, or the file is refused at that line. A first line of another count is refused in one
line listing the layouts read. A repeated (query, document) row replaces the earlier score, as BEIR's and
ir_datasets' dicts do (pytrec_eval asserts it never happens); the repeated pairs are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from magclip.data.layouts import (
    QRELS_BEIR,
    QRELS_BEIR_NO_HEADER,
    QRELS_TABLE,
    QRELS_TREC,
    Layout,
    announce,
    no_layout,
)
from magclip.io import is_lfs_pointer, lfs_pointer_error

BEIR_HEADER = ["query-id", "corpus-id"]
MAPPINGS = {QRELS_TREC: "query-id<-1, iteration<-2 (ignored), doc-id<-3, relevance<-4",
            QRELS_BEIR_NO_HEADER: "query-id<-1, corpus-id<-2, score<-3"}


@dataclass
class QrelsRead:
    """The judgements {query: {document: relevance}}, the repeated pairs (did a later row change the score?),
    the layout recognised and the number of judgement rows."""

    qrels: dict[str, dict[str, int]] = field(default_factory=dict)
    repeated: dict[tuple[str, str], bool] = field(default_factory=dict)
    layout: Layout | None = None
    rows: int = 0

    def add(self, qid: str, did: str, score: int) -> None:
        judged = self.qrels.setdefault(qid, {})
        if did in judged:
            self.repeated[(qid, did)] = self.repeated.get((qid, did), False) or judged[did] != score
        judged[did] = score
        self.rows += 1


def _fields(line: str, layout: Layout) -> list[str]:
    return line.split() if layout is QRELS_TREC else line.split("\t")


def recognise(first_line: str) -> Layout | None:
    """The qrels layout a file's first line shows, or None."""
    tabbed = first_line.split("\t")
    if tabbed[:2] == BEIR_HEADER and len(tabbed) == 3:
        return QRELS_BEIR
    if len(tabbed) == 3:
        return QRELS_BEIR_NO_HEADER
    if len(first_line.split()) == 4:
        return QRELS_TREC
    return None


def read_qrels_file(path: str | Path) -> QrelsRead:
    """A qrels text file in any layout above; a positional reading is announced once at WARNING."""
    if is_lfs_pointer(path):
        raise lfs_pointer_error(path, "a BEIR file")
    read = QrelsRead()
    with open(path, encoding="utf-8", newline="") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            if read.layout is None:
                read.layout = recognise(line)
                if read.layout is None:
                    raise no_layout(path, "qrels", f"line {number} ({len(line.split())} columns: {line[:60]!r})")
                if read.layout is QRELS_BEIR:
                    continue
            fields = _fields(line, read.layout)
            width = 4 if read.layout is QRELS_TREC else 3
            try:
                if len(fields) != width:
                    raise ValueError
                qid, did, score = (fields[0], fields[2], fields[3]) if width == 4 else fields
                read.add(qid, did, int(float(score)))
            except ValueError:
                expected = "query-id iteration doc-id relevance" if width == 4 else "query-id<TAB>corpus-id<TAB>score"
                raise ValueError(f"{path}:{number}: expected {expected} (the file is {read.layout.name}, by its first "
                                 f"line), got {line[:80]!r}") from None
    if read.layout in MAPPINGS:
        announce(path, read.layout, MAPPINGS[read.layout], read.rows)
    return read


def read_qrels_table(path: str | Path, read: QrelsRead | None = None) -> QrelsRead:
    """MTEB's qrels parquet, by its column names (added to `read` when given: a split in several parts)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if not {"query-id", "corpus-id", "score"} <= set(table.column_names):
        raise no_layout(path, "qrels", f"a table with the columns {table.column_names}")
    read = read or QrelsRead()
    read.layout = QRELS_TABLE
    columns = table.select(["query-id", "corpus-id", "score"]).to_pydict()
    for qid, did, score in zip(columns["query-id"], columns["corpus-id"], columns["score"], strict=True):
        read.add(str(qid), str(did), int(score))
    return read
